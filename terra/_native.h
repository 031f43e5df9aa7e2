/* terra._native: the co-execution door and the common lanes, in C.
 *
 * Three files: _native_door.c (the module, its globals and ``Door``), _native_twin.c (a
 * twin: ``Lane``, built from a Python lane) and _native_follow.c (what a twin does at an
 * op); this header is what they share.
 *
 * It does what terra/doors.py's ``CoexecDoor.fast_entry`` and a lane's ``follow``
 * (terra/lanes.py) do in their common case, with the same checks in the same order; the
 * Python code stays the reference and takes everything else. A lane of a form these files
 * know (inputs that are stand-ins, constants or the same tensor, as many as eight, and
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
#ifndef TERRA_NATIVE_H
#define TERRA_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define MAX_INPUTS 8
#define MAX_OUTPUTS 8

enum { DEFER = 0, HIT = 1, FAILED = 2 };  /* a twin's outcome */
enum { NODE = 0, CONST = 1, SAME = 2 };   /* how an input is checked (lanes.py's kinds) */

/* set once by setup() (_native_door.c): TF's EagerTensor type, the Python classes whose
 * slots are read or written by offset, the hook table, the conversions' notes, the list
 * holding whether the tapes are stopped, ``fast_path.pack_fast``; interned names */
extern PyTypeObject *ET, *EntryType, *LaneType, *LoggedOpType;
extern PyObject *tensors, *converted, *stopped, *pack_fast;
extern Py_ssize_t o_runner, o_iteration, o_step, o_out, o_value, o_visit, o_seq, o_shape,
    o_stopped, o_inputs, o_op_type, o_native;
extern PyObject *s_id, *s_it, *s_seq, *s_cur, *s_entries, *s_log, *s_datatype_enum,
    *s_copy_to_device, *s_owner, *s_runner, *s_lanes, *s_visit, *s_shape_tuple, *s_zero,
    *s_one;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static inline void
set_slot(PyObject *o, Py_ssize_t off, PyObject *v)
{
    PyObject *old = SLOT(o, off);
    Py_XINCREF(v);
    SLOT(o, off) = v;
    Py_XDECREF(old);
}

/* The objects an input's check reads, by its kind: NODE, the producer's step and which of
 * its outputs; CONST, the Python lane's memos of the constant (LAST, DT, CONVERTS and CID in
 * terra/lanes.py) and ``src``, the Python value a tensor was last found converted from among
 * CONVERTS (which only grows: a literal of the user's code is that very object at every
 * call); SAME, the tensor's id. One list for the struct, the GC's visit and the clear. */
#define INPUT_OBJECTS(X) X(producer) X(out) X(last) X(dtype) X(converts) X(validated) \
    X(src) X(id)

#define DECLARE(field) PyObject *field;

typedef struct {
    int kind;
    int single;  /* NODE: the producer has one output, so the entry's ``out`` is not read */
    INPUT_OBJECTS(DECLARE)
} Input;

/* A twin's objects: its Python lane's runner, step, attrs, memo of input shapes (shaped) or
 * stand-ins' sources, the outputs' build-time values, the packing plan, the device, where
 * the step's pass is noted (``seqs``) and its fetch visits counted (``visits``); and the
 * twin of the lane into the step after this one (``runner.lanes`` has one value per step,
 * never replaced) with its op type, once found there: the door then skips the lookup. */
#define LANE_OBJECTS(X) X(runner) X(step) X(attrs) X(by_shapes) X(sources) X(values) X(plan) \
    X(device) X(seqs) X(visits) X(next_op_type)

typedef struct Lane {
    PyObject_HEAD
    LANE_OBJECTS(DECLARE)
    struct Lane *next;
    Py_ssize_t n, n_inputs, n_out, spread_j, spread_m;  /* spread_j < 0: an input an argument */
    int one;  /* the op's one output is its result (else ``fast_path.pack_fast`` packs them) */
    int check;  /* ``TERRA_CHECK``: a stand-in input's entry has its tensor's shape */
    Py_ssize_t answered;  /* ops it answered (the tests ask) */
    Input inputs[MAX_INPUTS];
} Lane;

#undef DECLARE

extern PyTypeObject TwinType;  /* terra._native.Lane */

/* Follow the twin for an op's arguments after its type and name (``args``, ``nargs``):
 * DEFER with nothing done and no error set, HIT with the op's results in ``*result``, or
 * FAILED with an error set. */
int twin_follow(Lane *self, PyObject *const *args, Py_ssize_t nargs, PyObject **result);

#endif

