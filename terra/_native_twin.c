/* terra._native.Lane: a lane's native twin, built from the values and memo objects its
 * Python code is bound to (``lanes._twin``). See _native.h. */
#include "_native.h"

static int
lane_traverse(Lane *self, visitproc visit, void *arg)
{
#define VISIT(field) Py_VISIT(self->field);
#define VISIT_INPUT(field) Py_VISIT(self->inputs[i].field);
    LANE_OBJECTS(VISIT)
    Py_VISIT(self->next);
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        INPUT_OBJECTS(VISIT_INPUT)
    }
#undef VISIT
#undef VISIT_INPUT
    return 0;
}

static int
lane_clear(Lane *self)
{
#define CLEAR(field) Py_CLEAR(self->field);
#define CLEAR_INPUT(field) Py_CLEAR(self->inputs[i].field);
    LANE_OBJECTS(CLEAR)
    Py_CLEAR(self->next);
    for (Py_ssize_t i = 0; i < self->n_inputs; i++) {
        INPUT_OBJECTS(CLEAR_INPUT)
    }
#undef CLEAR
#undef CLEAR_INPUT
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
        self->n_inputs = i + 1;
        if (in->kind == NODE && a && b) {  /* (0, single, producer, out) */
            in->producer = Py_NewRef(a);
            in->out = Py_NewRef(b);
        } else if (in->kind == CONST && a && PyList_Check(a) && PyList_GET_SIZE(a) == 5 && b &&
                   c && PyDict_Check(c) && d && PyList_Check(d) && PyList_GET_SIZE(d) == 1) {
            in->last = Py_NewRef(a);  /* (1, 0, LAST, DT, CONVERTS, CID) */
            in->dtype = Py_NewRef(b);
            in->converts = Py_NewRef(c);
            in->validated = Py_NewRef(d);
        } else if (in->kind == SAME && a) {  /* (2, 0, id) */
            in->id = Py_NewRef(a);
        } else {
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

PyTypeObject TwinType = {
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
