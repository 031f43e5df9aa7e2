/* What a native twin does at an op: the Python lane's checks in their order, then what
 * it makes (terra/lanes.py, ``_input_check``, ``_shaped`` and ``_outputs``). See _native.h. */
#include "_native.h"

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
        SLOT(e, o_step) != in->producer)
        return NULL;
    if (!in->single) {
        PyObject *out = SLOT(e, o_out);
        if (out == NULL || (out != in->out && PyObject_RichCompareBool(out, in->out, Py_EQ) != 1))
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
    PyObject *last = in->last;
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
            if (!known && PyDict_GetItemWithError(in->converts, src) == (PyObject *)Py_TYPE(src)) {
                known = 1;
                Py_XSETREF(in->src, Py_NewRef(src));
            }
            if (known) {
                PyObject *dt = PyObject_CallMethodNoArgs(a, s_datatype_enum);
                if (dt == NULL)
                    goto done;
                int same = PyObject_RichCompareBool(dt, in->dtype, Py_EQ);
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
        ok = PyObject_RichCompareBool(id, PyList_GET_ITEM(in->validated, 0), Py_EQ) == 1;
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
int
twin_follow(Lane *self, PyObject *const *args, Py_ssize_t nargs, PyObject **result)
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
            int ok = PyObject_RichCompareBool(id, in->id, Py_EQ) == 1 &&
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
