/* terra._native: the co-execution door and the common lanes, in C.
 *
 * It does what terra/doors.py's ``CoexecDoor.fast_entry`` and a lane's ``follow``
 * (terra/lanes.py) do in their common case, with the same checks in the same order; the
 * Python code stays the reference and takes everything else. A lane of a form this file
 * knows (inputs that are stand-ins, constants or the same tensor, as many as eight, and
 * outputs as many; no input fed or read again, not the path's end: ``lanes._twin``) gets a
 * native twin, a ``Lane`` here. ``Door`` is TF's fast path while co-executing: for the
 * loop's thread, at a step whose lane has a twin of the op's type, it runs the twin. The
 * twin either answers the op (the stand-ins, their entries and the op's record, exactly as
 * the Python lane makes them) or, before doing anything, *defers*: the Python entry then
 * handles the op from the start (its lane, or the general path). A twin answers only what
 * the Python lane would answer without writing a memo; a Python value never seen, an
 * array, a shape never seen, and any error before the match are the Python lane's.
 *
 * Why C: a lane is ~120 bytecodes, and in a program whose Python between two ops is long
 * (YOLOv3's loss) a lane's function, defaults and code are out of the caches by the time
 * its op comes again: the same lanes cost twice the chain's there. Here an op touches its
 * few objects and no frame.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <pythread.h>

#define MAX_INPUTS 8
#define MAX_OUTPUTS 8

enum { DEFER = 0, HIT = 1, FAILED = 2 };  /* a twin's outcome */
enum { NODE = 0, CONST = 1, SAME = 2 };   /* how an input is checked (lanes.py's kinds) */

/* set once by setup(): TF's EagerTensor type, the hook table, the conversions' notes,
 * the list holding whether the tapes are stopped, and the slots written or read by offset */
static PyTypeObject *ET;
static PyTypeObject *EntryType;
static PyTypeObject *LaneType;
static PyTypeObject *LoggedOpType;
static PyObject *tensors, *converted, *stopped, *pack_fast;
static Py_ssize_t o_runner, o_iteration, o_step, o_out, o_value, o_visit, o_seq, o_shape,
    o_stopped, o_inputs, o_op_type, o_native;
static PyObject *s_id, *s_it, *s_seq, *s_cur, *s_entries, *s_log, *s_datatype_enum,
    *s_copy_to_device, *s_owner, *s_runner, *s_lanes, *s_visit, *s_shape_tuple, *s_zero, *s_one;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static void
set_slot(PyObject *o, Py_ssize_t off, PyObject *v)
{
    PyObject *old = SLOT(o, off);
    Py_XINCREF(v);
    SLOT(o, off) = v;
    Py_XDECREF(old);
}

typedef struct {
    int kind;
    int single;      /* NODE: the producer has one output, so the entry's ``out`` is not read */
    PyObject *a, *b, *c, *d;  /* NODE: P, K; CONST: LAST, DT, CONVERTS, CID; SAME: ID */
    /* CONST: the Python value a tensor was last found converted from among CONVERTS (which
     * only grows): a literal of the user's code is that very object at every call */
    PyObject *src;
} Input;

typedef struct Lane {
    PyObject_HEAD
    PyObject *runner, *step, *attrs, *by_shapes, *sources, *values, *plan, *device, *seqs,
        *visits;
    /* the native twin of the lane into the step after this one (``runner.lanes`` has one
     * value per step, never replaced), and its op type, once found there: the door then
     * skips the lookup */
    struct Lane *next;
    PyObject *next_op_type;
    Py_ssize_t n, n_inputs, n_out, spread_j, spread_m;  /* spread_j < 0: an input an argument */
    int one;  /* the op's one output is its result (else ``fast_path.pack_fast`` packs them) */
    int check;  /* ``TERRA_CHECK``: a stand-in input's entry has its tensor's shape */
    Py_ssize_t answered;  /* ops it answered (the tests ask) */
    Input inputs[MAX_INPUTS];
} Lane;

static int
lane_traverse(Lane *self, visitproc visit, void *arg)
{
    Py_VISIT(self->runner); Py_VISIT(self->step); Py_VISIT(self->attrs);
    Py_VISIT(self->by_shapes); Py_VISIT(self->sources); Py_VISIT(self->values);
    Py_VISIT(self->plan); Py_VISIT(self->device); Py_VISIT(self->seqs); Py_VISIT(self->visits);
    Py_VISIT(self->next); Py_VISIT(self->next_op_type);
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        Py_VISIT(self->inputs[i].a); Py_VISIT(self->inputs[i].b);
        Py_VISIT(self->inputs[i].c); Py_VISIT(self->inputs[i].d);
        Py_VISIT(self->inputs[i].src);
    }
    return 0;
}

static int
lane_clear(Lane *self)
{
    Py_CLEAR(self->runner); Py_CLEAR(self->step); Py_CLEAR(self->attrs);
    Py_CLEAR(self->by_shapes); Py_CLEAR(self->sources); Py_CLEAR(self->values);
    Py_CLEAR(self->plan); Py_CLEAR(self->device); Py_CLEAR(self->seqs); Py_CLEAR(self->visits);
    Py_CLEAR(self->next); Py_CLEAR(self->next_op_type);
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        Py_CLEAR(self->inputs[i].a); Py_CLEAR(self->inputs[i].b);
        Py_CLEAR(self->inputs[i].c); Py_CLEAR(self->inputs[i].d);
        Py_CLEAR(self->inputs[i].src);
    }
    return 0;
}

static void
lane_dealloc(Lane *self)
{
    PyObject_GC_UnTrack(self);
    lane_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
none_to_null(PyObject *o)
{
    if (o == Py_None)
        return NULL;
    Py_INCREF(o);
    return o;
}

/* A triple (dummy, spares, shape) per output: where a stand-in comes from. */
static int
are_sources(PyObject *sources, Py_ssize_t n_out)
{
    if (!PyTuple_CheckExact(sources) || PyTuple_GET_SIZE(sources) != n_out)
        return 0;
    for (Py_ssize_t k = 0; k < n_out; k++) {
        PyObject *f = PyTuple_GET_ITEM(sources, k);
        if (!PyTuple_CheckExact(f) || PyTuple_GET_SIZE(f) != 3 ||
            !PyList_CheckExact(PyTuple_GET_ITEM(f, 1)))
            return 0;
    }
    return 1;
}

/* Lane(runner, step, attrs, n, spread, inputs, by_shapes, sources, values, plan, device,
 *      seqs, visits, check):
 * ``attrs`` None for an op called without attrs; ``spread`` None or (j, m); ``inputs`` a
 * list of (kind, single, a, b, c, d); ``by_shapes`` the Python lane's memo where output
 * shapes follow input shapes (else None, and ``sources`` is a tuple of (dummy, spares,
 * shape) per output); ``values`` the outputs' values known when the graph was built;
 * ``plan`` how results are packed ("one": the one output); ``seqs`` the runner's where the
 * step's pass is noted, ``visits`` where it has fetch channels, else None; ``check``:
 * ``TERRA_CHECK``'s assertion on the entries' shapes. */
static PyObject *
lane_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *runner, *step, *attrs, *spread, *inputs, *by_shapes, *sources, *values, *plan,
        *device, *seqs, *visits;
    Py_ssize_t n;
    int check;
    if (!PyArg_ParseTuple(args, "OOOnOO!OOO!OOOOp", &runner, &step, &attrs, &n, &spread,
                          &PyList_Type, &inputs, &by_shapes, &sources, &PyTuple_Type, &values,
                          &plan, &device, &seqs, &visits, &check))
        return NULL;
    Py_ssize_t n_inputs = PyList_GET_SIZE(inputs), n_out = PyTuple_GET_SIZE(values);
    if (n_inputs > MAX_INPUTS || n_out > MAX_OUTPUTS) {
        PyErr_SetString(PyExc_ValueError, "too many inputs or outputs for a native lane");
        return NULL;
    }
    if (attrs != Py_None && !PyTuple_CheckExact(attrs)) {
        PyErr_SetString(PyExc_TypeError, "a lane's attrs are a tuple");
        return NULL;
    }
    if (by_shapes == Py_None ? !are_sources(sources, n_out) : !PyDict_CheckExact(by_shapes)) {
        PyErr_SetString(PyExc_TypeError, "a lane's sources: (dummy, spares, shape) an output");
        return NULL;
    }
    Lane *self = (Lane *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->runner = Py_NewRef(runner);
    self->step = Py_NewRef(step);
    self->attrs = none_to_null(attrs);
    self->n = n;
    self->n_out = n_out;
    self->check = check;
    self->spread_j = -1;
    if (spread != Py_None &&
        !PyArg_ParseTuple(spread, "nn", &self->spread_j, &self->spread_m))
        goto error;
    self->by_shapes = none_to_null(by_shapes);
    self->sources = by_shapes == Py_None ? Py_NewRef(sources) : NULL;
    self->values = Py_NewRef(values);
    self->plan = Py_NewRef(plan);
    self->one = PyUnicode_Check(plan) && PyUnicode_CompareWithASCIIString(plan, "one") == 0;
    if (self->one && n_out != 1) {
        PyErr_SetString(PyExc_ValueError, "the plan \"one\" packs one output");
        goto error;
    }
    self->device = Py_NewRef(device);
    self->seqs = none_to_null(seqs);
    self->visits = none_to_null(visits);
    for (Py_ssize_t i = 0; i < n_inputs; i++) {
        Input *in = &self->inputs[i];
        PyObject *a = NULL, *b = NULL, *c = NULL, *d = NULL;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(inputs, i), "ii|OOOO", &in->kind, &in->single,
                              &a, &b, &c, &d))
            goto error;
        in->a = Py_XNewRef(a); in->b = Py_XNewRef(b); in->c = Py_XNewRef(c);
        in->d = Py_XNewRef(d);
        self->n_inputs = i + 1;
        if (in->kind == CONST && !(a && PyList_Check(a) && PyList_GET_SIZE(a) == 5 && b &&
                                   c && PyDict_Check(c) && d && PyList_Check(d) &&
                                   PyList_GET_SIZE(d) == 1)) {
            PyErr_SetString(PyExc_ValueError, "a constant's memos: LAST, DT, CONVERTS, CID");
            goto error;
        }
        if ((in->kind == NODE && !(a && b)) || (in->kind == SAME && !a) ||
            in->kind < NODE || in->kind > SAME) {
            PyErr_SetString(PyExc_ValueError, "an input's check is malformed");
            goto error;
        }
    }
    return (PyObject *)self;
error:
    Py_DECREF(self);
    return NULL;
}

static PyMemberDef lane_members[] = {
    {"answered", T_PYSSIZET, offsetof(Lane, answered), READONLY, "ops this twin answered"},
    {NULL},
};

static PyTypeObject LaneObjType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "terra._native.Lane",
    .tp_members = lane_members,
    .tp_doc = "The native twin of a lanes.Lane of a common form: follows it, or defers.",
    .tp_basicsize = sizeof(Lane),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = lane_new,
    .tp_traverse = (traverseproc)lane_traverse,
    .tp_clear = (inquiry)lane_clear,
    .tp_dealloc = (destructor)lane_dealloc,
};

/* The entry of a stand-in of this iteration from the one producer ``in``, or NULL (defer;
 * no error set). Borrowed. */
static PyObject *
node_entry(PyObject *a, Input *in, PyObject *it)
{
    if (Py_TYPE(a) != ET)
        return NULL;
    PyObject *id = PyObject_GetAttr(a, s_id);
    if (id == NULL)
        return NULL;
    PyObject *e = PyDict_GetItemWithError(tensors, id);
    Py_DECREF(id);
    if (e == NULL || Py_TYPE(e) != EntryType || SLOT(e, o_iteration) != it ||
        SLOT(e, o_step) != in->a)
        return NULL;
    if (!in->single) {
        PyObject *out = SLOT(e, o_out);
        if (out == NULL || (out != in->b && PyObject_RichCompareBool(out, in->b, Py_EQ) != 1))
            return NULL;
    }
    return e;
}

/* Whether the constant ``a`` is one the Python lane would take without a memo written:
 * a converted tensor of a known source or the one validated last, the Python value matched
 * last, a float equal to it, a fresh list or tuple equal to it element by element and type
 * by type. 0 defers (errors cleared by the caller). */
static int
const_ok(PyObject *a, Input *in)
{
    PyObject *last = in->a;
    if (Py_TYPE(a) == ET) {
        PyObject *id = PyObject_GetAttr(a, s_id);
        if (id == NULL)
            return 0;
        int ok = 0;
        int held = PyDict_Contains(tensors, id);
        if (held != 0)  /* a stand-in where a value is read (or an error) */
            goto done;
        PyObject *src = PyDict_GetItemWithError(converted, id);
        if (src != NULL) {
            int known = src == in->src;
            if (!known && PyDict_GetItemWithError(in->c, src) == (PyObject *)Py_TYPE(src)) {
                known = 1;
                Py_XSETREF(in->src, Py_NewRef(src));
            }
            if (known) {
                PyObject *dt = PyObject_CallMethodNoArgs(a, s_datatype_enum);
                if (dt == NULL)
                    goto done;
                int same = PyObject_RichCompareBool(dt, in->b, Py_EQ);
                Py_DECREF(dt);
                if (same == 1) {
                    ok = 1;
                    goto done;
                }
            }
        }
        if (PyErr_Occurred())
            goto done;
        /* else the tensor validated last, by its id */
        ok = PyObject_RichCompareBool(id, PyList_GET_ITEM(in->d, 0), Py_EQ) == 1;
    done:
        Py_DECREF(id);
        return ok;
    }
    PyObject *previous = PyList_GET_ITEM(last, 0);
    if (a == previous)
        return 1;
    if (PyFloat_CheckExact(a) && PyFloat_CheckExact(previous)) {
        double x = PyFloat_AS_DOUBLE(a);
        return x == PyFloat_AS_DOUBLE(previous) && x != 0.0;
    }
    PyObject *seq_type = PyList_GET_ITEM(last, 2), *types = PyList_GET_ITEM(last, 4);
    if ((PyObject *)Py_TYPE(a) != seq_type || (seq_type != (PyObject *)&PyList_Type &&
                                                seq_type != (PyObject *)&PyTuple_Type) ||
        !PyTuple_Check(types))
        return 0;
    Py_ssize_t size = Py_SIZE(a);
    if (size != PyTuple_GET_SIZE(types))
        return 0;
    PyObject **items = PyList_Check(a) ? ((PyListObject *)a)->ob_item
                                       : ((PyTupleObject *)a)->ob_item;
    for (Py_ssize_t k = 0; k < size; k++)
        if ((PyObject *)Py_TYPE(items[k]) != PyTuple_GET_ITEM(types, k))
            return 0;
    return PyObject_RichCompareBool(a, PyList_GET_ITEM(last, 3), Py_EQ) == 1;
}

/* The op's flat inputs from its arguments ``args[0:n]`` (then its attrs), into ``a``;
 * 0 if the call has another shape than the lane's. */
static int
flat_inputs(Lane *self, PyObject *const *args, Py_ssize_t nargs, PyObject **a)
{
    Py_ssize_t n = self->n;
    if (self->attrs == NULL) {
        if (nargs != n)
            return 0;
    } else {
        Py_ssize_t k = PyTuple_GET_SIZE(self->attrs);
        if (nargs != n + k)
            return 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            PyObject *x = args[n + j], *y = PyTuple_GET_ITEM(self->attrs, j);
            if (x != y) {
                int same = PyObject_RichCompareBool(x, y, Py_EQ);
                if (same != 1) {
                    PyErr_Clear();
                    return 0;
                }
            }
        }
    }
    if (self->spread_j < 0) {
        if (n != self->n_inputs)
            return 0;
        for (Py_ssize_t i = 0; i < n; i++)
            a[i] = args[i];
        return 1;
    }
    Py_ssize_t j = self->spread_j, m = self->spread_m, i = 0;
    PyObject *items = args[j];
    if (!(PyList_CheckExact(items) || PyTuple_CheckExact(items)) || Py_SIZE(items) != m ||
        j + m + (n - j - 1) != self->n_inputs)
        return 0;
    for (Py_ssize_t t = 0; t < j; t++)
        a[i++] = args[t];
    for (Py_ssize_t t = 0; t < m; t++)
        a[i++] = PyList_CheckExact(items) ? PyList_GET_ITEM(items, t)
                                          : PyTuple_GET_ITEM(items, t);
    for (Py_ssize_t t = j + 1; t < n; t++)
        a[i++] = args[t];
    return 1;
}

/* The sources of the stand-ins for these input entries ``e`` (NULL where not an input
 * from a stand-in), from the Python lane's memo: a (dummy, spares, shape) triple per
 * output, as a tuple (one output) or a list; borrowed, or NULL (defer). */
static PyObject *
shaped_sources(Lane *self, PyObject **e)
{
    PyObject *key = NULL, *found;
    Py_ssize_t n_nodes = 0;
    for (Py_ssize_t i = 0; i < self->n_inputs; i++)
        if (e[i] != NULL) {
            if (SLOT(e[i], o_shape) == NULL)
                return NULL;
            n_nodes++;
        }
    if (n_nodes <= 1) {  /* the one stand-in's shape, or None */
        key = Py_None;
        for (Py_ssize_t i = 0; i < self->n_inputs; i++)
            if (e[i] != NULL)
                key = SLOT(e[i], o_shape);
        found = PyDict_GetItemWithError(self->by_shapes, key);
    } else {
        if ((key = PyTuple_New(n_nodes)) == NULL)
            return NULL;
        for (Py_ssize_t i = 0, k = 0; i < self->n_inputs; i++)
            if (e[i] != NULL)
                PyTuple_SET_ITEM(key, k++, Py_NewRef(SLOT(e[i], o_shape)));
        found = PyDict_GetItemWithError(self->by_shapes, key);
        Py_DECREF(key);
    }
    if (found == NULL)
        return NULL;
    PyObject *one = found;
    if (self->n_out != 1) {
        if (!PyList_CheckExact(found) || PyList_GET_SIZE(found) != self->n_out)
            return NULL;
        for (Py_ssize_t k = 0; k < self->n_out; k++) {
            one = PyList_GET_ITEM(found, k);
            if (!PyTuple_CheckExact(one) || PyTuple_GET_SIZE(one) != 3 ||
                !PyList_CheckExact(PyTuple_GET_ITEM(one, 1)))
                return NULL;
        }
        return found;
    }
    if (!PyTuple_CheckExact(one) || PyTuple_GET_SIZE(one) != 3 ||
        !PyList_CheckExact(PyTuple_GET_ITEM(one, 1)))
        return NULL;
    return found;
}

/* Under ``TERRA_CHECK``: whether each stand-in input's entry has the shape of its tensor
 * ``a[i]``; 0 with an AssertionError set (as the Python lane raises) or another error. */
static int
shapes_held(Lane *self, PyObject **a, PyObject **e)
{
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        if (e[i] == NULL)
            continue;
        PyObject *shape = PyObject_CallMethodNoArgs(a[i], s_shape_tuple);
        if (shape == NULL)
            return 0;
        int same = PyObject_RichCompareBool(SLOT(e[i], o_shape), shape, Py_EQ);
        Py_DECREF(shape);
        if (same != 1) {
            if (same == 0)
                PyErr_SetString(PyExc_AssertionError,
                                "an entry has another shape than its tensor");
            return 0;
        }
    }
    return 1;
}

/* Output ``k``'s (dummy, spares, shape) among ``sources`` (a lane's or the memo's). */
static PyObject *
source(Lane *self, PyObject *sources, Py_ssize_t k)
{
    if (self->n_out == 1 && self->by_shapes != NULL)
        return sources;  /* the memo's one triple */
    return PyTuple_CheckExact(sources) ? PyTuple_GET_ITEM(sources, k)
                                       : PyList_GET_ITEM(sources, k);
}

/* Follow the lane for the call's ``args``: DEFER with nothing done (and no error set), HIT
 * with the op's results in ``*result``, or FAILED with an error set after the match began.
 * Once matched, it does what the Python lane's ``_outputs`` lines do, in their order. */
static int
follow(Lane *self, PyObject *const *args, Py_ssize_t nargs, PyObject **result)
{
    PyObject *a[MAX_INPUTS], *e[MAX_INPUTS];
    if (!flat_inputs(self, args, nargs, a))
        return DEFER;
    PyObject *runner = self->runner;
    PyObject *it = PyObject_GetAttr(runner, s_it);
    if (it == NULL) {
        PyErr_Clear();
        return DEFER;
    }
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        Input *in = &self->inputs[i];
        e[i] = NULL;
        if (in->kind == NODE) {
            if ((e[i] = node_entry(a[i], in, it)) == NULL)
                goto defer;
        } else if (in->kind == SAME) {
            if (Py_TYPE(a[i]) != ET)
                goto defer;
            PyObject *id = PyObject_GetAttr(a[i], s_id);
            if (id == NULL)
                goto defer;
            int ok = PyObject_RichCompareBool(id, in->a, Py_EQ) == 1 &&
                     PyDict_Contains(tensors, id) == 0;
            Py_DECREF(id);
            if (!ok)
                goto defer;
        } else if (!const_ok(a[i], in)) {
            goto defer;
        }
    }
    if (self->check && self->by_shapes != NULL && !shapes_held(self, a, e)) {
        Py_DECREF(it);
        return FAILED;  /* nothing done yet */
    }
    PyObject *sources = self->by_shapes != NULL ? shaped_sources(self, e) : self->sources;
    if (sources == NULL)
        goto defer;

    /* matched: from here on, what the Python lane does once its checks passed */
    PyObject *outs[MAX_OUTPUTS], *s[MAX_OUTPUTS], *spares[MAX_OUTPUTS];
    PyObject *seq = NULL, *visit = NULL, *logged = NULL, *record = NULL, *packed = NULL;
    Py_ssize_t n_out = self->n_out, made = 0;
    Py_INCREF(sources);  /* held: Python code may run below */
    if ((seq = PyObject_GetAttr(runner, s_seq)) == NULL)
        goto failed;
    if (self->visits != NULL) {  /* the step's position in its fetch channels */
        visit = PyDict_GetItemWithError(self->visits, self->step);
        if (visit == NULL && PyErr_Occurred())
            goto failed;
        visit = Py_NewRef(visit != NULL ? visit : s_zero);
    }
    if ((logged = PyTuple_New(self->n_inputs)) == NULL)
        goto failed;
    for (Py_ssize_t i = 0; i < self->n_inputs; i++)
        PyTuple_SET_ITEM(logged, i, Py_NewRef(e[i] != NULL ? e[i] : a[i]));
    for (; made < n_out; made++) {
        Py_ssize_t k = made;
        PyObject *from = source(self, sources, k), *spare = PyTuple_GET_ITEM(from, 1);
        Py_ssize_t left = PyList_GET_SIZE(spare);
        if (left > 0) {  /* list.pop(): the list's reference becomes the lane's */
            s[k] = PyList_GET_ITEM(spare, left - 1);
            Py_SET_SIZE(spare, left - 1);
        } else if ((s[k] = PyObject_CallMethodOneArg(PyTuple_GET_ITEM(from, 0),
                                                     s_copy_to_device, self->device)) == NULL) {
            goto failed;
        }
        spares[k] = Py_NewRef(spare);
        if ((outs[k] = EntryType->tp_alloc(EntryType, 0)) == NULL) {
            Py_DECREF(s[k]);
            Py_DECREF(spares[k]);
            goto failed;
        }
        PyObject *index = PyLong_FromSsize_t(k);
        if (index == NULL) {
            Py_DECREF(s[k]); Py_DECREF(spares[k]); Py_DECREF(outs[k]);
            goto failed;
        }
        PyObject *out = outs[k];
        set_slot(out, o_runner, runner);
        set_slot(out, o_iteration, it);
        set_slot(out, o_step, self->step);
        set_slot(out, o_out, index);
        Py_DECREF(index);
        set_slot(out, o_value, PyTuple_GET_ITEM(self->values, k));
        set_slot(out, o_visit, visit != NULL ? visit : s_zero);
        set_slot(out, o_seq, seq);
        set_slot(out, o_shape, PyTuple_GET_ITEM(from, 2));
        if (n_out == 1) {  /* the entry is the op's record too */
            set_slot(out, o_stopped, PyList_GET_ITEM(stopped, 0));
            set_slot(out, o_inputs, logged);
        }
        PyObject *id = PyObject_GetAttr(s[k], s_id);
        if (id == NULL) {
            made++;
            goto failed;
        }
        int put = PyDict_SetItem(tensors, id, out);
        Py_DECREF(id);
        if (put < 0) {
            made++;
            goto failed;
        }
    }
    PyObject *handed = PyObject_GetAttr(it, s_entries);
    if (handed == NULL)
        goto failed;
    int put = 0;
    for (Py_ssize_t k = 0; k < n_out && !put; k++)
        put = PyList_Append(handed, outs[k]) || PyList_Append(handed, s[k]) ||
              PyList_Append(handed, spares[k]);
    Py_DECREF(handed);
    if (put)
        goto failed;
    if (n_out == 1) {
        record = Py_NewRef(outs[0]);
    } else {  /* a fallback.LoggedOp: (step, stopped, n_out, *outputs, *inputs) */
        if ((record = LoggedOpType->tp_alloc(LoggedOpType, 3 + n_out + self->n_inputs)) == NULL)
            goto failed;
        PyObject *count = PyLong_FromSsize_t(n_out);
        if (count == NULL)
            goto failed;
        PyTuple_SET_ITEM(record, 0, Py_NewRef(self->step));
        PyTuple_SET_ITEM(record, 1, Py_NewRef(PyList_GET_ITEM(stopped, 0)));
        PyTuple_SET_ITEM(record, 2, count);
        for (Py_ssize_t k = 0; k < n_out; k++)
            PyTuple_SET_ITEM(record, 3 + k, Py_NewRef(outs[k]));
        for (Py_ssize_t i = 0; i < self->n_inputs; i++)
            PyTuple_SET_ITEM(record, 3 + n_out + i, Py_NewRef(PyTuple_GET_ITEM(logged, i)));
    }
    PyObject *log = PyObject_GetAttr(it, s_log);
    if (log == NULL)
        goto failed;
    put = PyList_Append(log, record);
    Py_DECREF(log);
    if (put || PyObject_SetAttr(runner, s_cur, self->step) < 0)
        goto failed;
    if (self->seqs != NULL && PyObject_SetItem(self->seqs, self->step, seq) < 0)
        goto failed;
    PyObject *next = PyNumber_Add(seq, s_one);
    if (next == NULL)
        goto failed;
    put = PyObject_SetAttr(runner, s_seq, next);
    Py_DECREF(next);
    if (put < 0)
        goto failed;
    if (self->visits != NULL) {  /* PythonRunner._visit */
        PyObject *done = PyObject_CallMethodOneArg(runner, s_visit, self->step);
        if (done == NULL)
            goto failed;
        Py_DECREF(done);
    }
    if (self->one) {
        packed = Py_NewRef(s[0]);
    } else {
        PyObject *list = PyList_New(n_out);
        if (list == NULL)
            goto failed;
        for (Py_ssize_t k = 0; k < n_out; k++)
            PyList_SET_ITEM(list, k, Py_NewRef(s[k]));
        packed = PyObject_CallFunctionObjArgs(pack_fast, self->plan, list, NULL);
        Py_DECREF(list);
        if (packed == NULL)
            goto failed;
    }
    *result = packed;
    packed = NULL;
    self->answered++;
    int outcome = HIT;
    goto done;
failed:
    outcome = FAILED;
done:
    for (Py_ssize_t k = 0; k < made; k++) {
        Py_DECREF(outs[k]); Py_DECREF(s[k]); Py_DECREF(spares[k]);
    }
    Py_DECREF(it); Py_DECREF(sources); Py_XDECREF(seq); Py_XDECREF(visit);
    Py_XDECREF(logged); Py_XDECREF(record);
    return outcome;
defer:
    PyErr_Clear();
    Py_DECREF(it);
    return DEFER;
}

/* The exception raised, normalized, with its traceback (PyErr_GetRaisedException). */
static PyObject *
raised(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* Door(runtime, python_entry, failed): TF's fast path while co-executing. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *rt, *python_entry, *failed;
    unsigned long owner;  /* the runtime's loop thread (``Runtime.owner``, set once) */
    Lane *last;           /* the twin that answered the op before, if it was the last op */
} Door;

/* The native twin of the lane at ``at`` of ``runner`` (``runner.lanes.get(at)``) if its op
 * type is ``op_type``; borrowed, or NULL (no error: the Python entry decides). */
static Lane *
lane_at(Door *self, PyObject *runner, PyObject *at, PyObject *op_type)
{
    Lane *last = self->last;
    if (last != NULL && last->step == at && last->runner == runner && last->next != NULL)
        return last->next_op_type == op_type ||
               PyObject_RichCompareBool(last->next_op_type, op_type, Py_EQ) == 1
               ? last->next : NULL;
    PyObject *lanes = PyObject_GetAttr(runner, s_lanes);
    if (lanes == NULL)
        return NULL;
    PyObject *lane = PyDict_Check(lanes) ? PyDict_GetItemWithError(lanes, at) : NULL;
    Py_DECREF(lanes);
    if (lane == NULL || Py_TYPE(lane) != LaneType)  /* none yet, or False */
        return NULL;
    PyObject *type = SLOT(lane, o_op_type), *native = SLOT(lane, o_native);
    if (native == NULL || Py_TYPE(native) != &LaneObjType || type == NULL)
        return NULL;
    if (last != NULL && last->step == at && last->runner == runner) {  /* known from now on */
        Py_XSETREF(last->next, (Lane *)Py_NewRef(native));
        Py_XSETREF(last->next_op_type, Py_NewRef(type));
    }
    return type == op_type || PyObject_RichCompareBool(type, op_type, Py_EQ) == 1
           ? (Lane *)native : NULL;
}

static PyObject *
door_call(Door *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL || nargs < 3 || PyThread_get_thread_ident() != self->owner)
        goto python;
    PyObject *runner = PyObject_GetAttr(self->rt, s_runner);
    if (runner == NULL)
        return NULL;
    PyObject *at = PyObject_GetAttr(runner, s_cur);
    if (at == NULL) {
        Py_DECREF(runner);
        return NULL;
    }
    Lane *lane = lane_at(self, runner, at, args[1]);
    Py_DECREF(runner);
    if (lane == NULL) {
        Py_DECREF(at);
        if (PyErr_Occurred())
            return NULL;
        goto python;
    }
    PyObject *result = NULL;
    Py_INCREF(lane);
    int outcome = follow(lane, args + 3, nargs - 3, &result);
    if (outcome == HIT) {
        Py_XSETREF(self->last, lane);  /* the lane's reference becomes the door's */
        Py_DECREF(at);
        return result;
    }
    Py_DECREF(lane);
    if (outcome == FAILED && !PyErr_ExceptionMatches(PyExc_Exception)) {
        Py_DECREF(at);  /* KeyboardInterrupt, SystemExit: the Python entry lets them through */
        return NULL;
    }
    if (outcome == FAILED) {  /* as the Python entry: the runtime handles it */
        PyObject *why = raised();
        PyObject *rest = PyTuple_New(nargs - 3);
        if (rest == NULL) {
            Py_DECREF(at);
            Py_DECREF(why);
            return NULL;
        }
        for (Py_ssize_t i = 3; i < nargs; i++)
            PyTuple_SET_ITEM(rest, i - 3, Py_NewRef(args[i]));
        PyObject *res = PyObject_CallFunctionObjArgs(self->failed, why, at, args[0], args[1],
                                                     args[2], rest, NULL);
        Py_DECREF(why);
        Py_DECREF(at);
        Py_DECREF(rest);
        return res;
    }
    Py_DECREF(at);
python:
    return PyObject_Vectorcall(self->python_entry, args, nargsf, kwnames);
}

static PyObject *
door_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *rt, *python_entry, *failed;
    if (!PyArg_ParseTuple(args, "OOO", &rt, &python_entry, &failed))
        return NULL;
    PyObject *owner = PyObject_GetAttr(rt, s_owner);
    if (owner == NULL)
        return NULL;
    unsigned long who = PyLong_AsUnsignedLong(owner);
    Py_DECREF(owner);
    if (who == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    Door *self = (Door *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->owner = who;
    self->vectorcall = (vectorcallfunc)door_call;
    self->rt = Py_NewRef(rt);
    self->python_entry = Py_NewRef(python_entry);
    self->failed = Py_NewRef(failed);
    return (PyObject *)self;
}

static int
door_traverse(Door *self, visitproc visit, void *arg)
{
    Py_VISIT(self->rt); Py_VISIT(self->python_entry); Py_VISIT(self->failed);
    Py_VISIT(self->last);
    return 0;
}

static int
door_clear(Door *self)
{
    Py_CLEAR(self->rt); Py_CLEAR(self->python_entry); Py_CLEAR(self->failed);
    Py_CLEAR(self->last);
    return 0;
}

static void
door_dealloc(Door *self)
{
    PyObject_GC_UnTrack(self);
    door_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject DoorType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "terra._native.Door",
    .tp_doc = "TF's fast path while co-executing: a native lane's answer, else the Python "
              "entry's.",
    .tp_basicsize = sizeof(Door),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Door, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = door_new,
    .tp_traverse = (traverseproc)door_traverse,
    .tp_clear = (inquiry)door_clear,
    .tp_dealloc = (destructor)door_dealloc,
};

/* The offset of ``cls``'s slot ``name`` (a member descriptor of an object field). */
static int
slot_offset(PyTypeObject *cls, const char *name, Py_ssize_t *offset)
{
    PyObject *descr = PyDict_GetItemString(cls->tp_dict, name);
    if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type ||
        ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", cls->tp_name, name);
        return -1;
    }
    *offset = ((PyMemberDescrObject *)descr)->d_member->offset;
    return 0;
}

static PyObject *
setup(PyObject *module, PyObject *args)
{
    PyObject *et, *entry, *lane, *logged;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!O!O", &PyType_Type, &et, &PyType_Type, &entry,
                          &PyType_Type, &lane, &PyType_Type, &logged, &PyDict_Type, &tensors,
                          &PyDict_Type, &converted, &PyList_Type, &stopped, &pack_fast))
        return NULL;
    if (PyList_GET_SIZE(stopped) != 1 ||
        !PyType_IsSubtype((PyTypeObject *)logged, &PyTuple_Type)) {
        PyErr_SetString(PyExc_ValueError, "tapes_stopped holds one flag; LoggedOp is a tuple");
        return NULL;
    }
    ET = (PyTypeObject *)Py_NewRef(et);
    EntryType = (PyTypeObject *)Py_NewRef(entry);
    LaneType = (PyTypeObject *)Py_NewRef(lane);
    LoggedOpType = (PyTypeObject *)Py_NewRef(logged);
    Py_INCREF(tensors); Py_INCREF(converted); Py_INCREF(stopped); Py_INCREF(pack_fast);
    if (slot_offset(EntryType, "runner", &o_runner) || slot_offset(EntryType, "iteration",
        &o_iteration) || slot_offset(EntryType, "step", &o_step) ||
        slot_offset(EntryType, "out", &o_out) || slot_offset(EntryType, "value", &o_value) ||
        slot_offset(EntryType, "visit", &o_visit) || slot_offset(EntryType, "seq", &o_seq) ||
        slot_offset(EntryType, "shape", &o_shape) ||
        slot_offset(EntryType, "stopped", &o_stopped) ||
        slot_offset(EntryType, "inputs", &o_inputs) ||
        slot_offset(LaneType, "op_type", &o_op_type) ||
        slot_offset(LaneType, "native", &o_native))
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"setup", setup, METH_VARARGS,
     "setup(EagerTensor, Entry, lanes.Lane, LoggedOp, tensors, converted, tapes_stopped, "
     "pack_fast)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "terra._native",
    "The co-execution door and its common lanes, in C (see terra/lanes.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&LaneObjType) < 0 || PyType_Ready(&DoorType) < 0)
        return NULL;
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_id, "_id"); INTERN(s_it, "it"); INTERN(s_seq, "seq"); INTERN(s_cur, "cur");
    INTERN(s_entries, "entries"); INTERN(s_log, "log");
    INTERN(s_datatype_enum, "_datatype_enum"); INTERN(s_copy_to_device, "_copy_to_device");
    INTERN(s_owner, "owner"); INTERN(s_runner, "runner"); INTERN(s_lanes, "lanes");
    INTERN(s_visit, "_visit"); INTERN(s_shape_tuple, "_shape_tuple");
#undef INTERN
    s_zero = PyLong_FromLong(0);
    s_one = PyLong_FromLong(1);
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Lane", (PyObject *)&LaneObjType) < 0 ||
        PyModule_AddObjectRef(m, "Door", (PyObject *)&DoorType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
