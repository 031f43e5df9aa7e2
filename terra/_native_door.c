/* terra._native: the module, its globals and the door. See _native.h. */
#include "_native.h"
#include <pythread.h>
#include <structmember.h>

PyTypeObject *ET, *EntryType, *LaneType, *LoggedOpType;
PyObject *tensors, *converted, *stopped, *pack_fast;
Py_ssize_t o_runner, o_iteration, o_step, o_out, o_value, o_visit, o_seq, o_shape, o_stopped,
    o_inputs, o_op_type, o_native;
PyObject *s_id, *s_it, *s_seq, *s_cur, *s_entries, *s_log, *s_datatype_enum, *s_copy_to_device,
    *s_owner, *s_runner, *s_lanes, *s_visit, *s_shape_tuple, *s_zero, *s_one;

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
    unsigned long owner;  /* the thread Terra serves (``Runtime.owner``; ``Runtime.take_turn``
                           * sets it as a MirroredStrategy's replica threads take turns) */
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
    if (native == NULL || Py_TYPE(native) != &TwinType || type == NULL)
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
    int outcome = twin_follow(lane, args + 3, nargs - 3, &result);
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

static PyMemberDef door_members[] = {
    {"owner", T_ULONG, offsetof(Door, owner), 0, "the thread whose ops this door answers"},
    {NULL},
};

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
    .tp_members = door_members,
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
    if (PyType_Ready(&TwinType) < 0 || PyType_Ready(&DoorType) < 0)
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
    if (PyModule_AddObjectRef(m, "Lane", (PyObject *)&TwinType) < 0 ||
        PyModule_AddObjectRef(m, "Door", (PyObject *)&DoorType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
