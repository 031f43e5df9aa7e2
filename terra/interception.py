"""The two Python-visible doors every eager op passes through (docs/architecture.md §3.1).

``pywrap_tfe.TFE_Py_FastPathExecute`` (generated op wrappers) and ``execute.execute`` (their
slow-path fallbacks and function calls) are module attributes looked up at call time, so
wrapping them sees every op except C++-internal constant conversion. A handler may bring its
own function for the first (``handler.fast_entry``, with its signature, passing other
threads' ops): ``CoexecDoor``'s answers an op on a lane without a call more per op.
``record.record_operation`` is wrapped the same way, to hear of custom gradients,
``constant_op.convert_to_eager_tensor`` to note which Python scalar or small array each new
constant tensor holds (:data:`converted`: a lane then knows a fresh ``tf.add(x, 1.0)``
constant by the ``1.0``, and ``tf.reduce_sum(x)``'s axes by their array, without reading
the tensor back), and ``tape.variable_accessed`` to note which variable each handle a tape
would watch belongs to (:data:`accessed`).
While a handler is set, ops issued by the owning thread go to it; everything else (other
threads, Terra's own queue ops, which call ``quick_execute`` directly) passes straight
through. While no handler is set (Terra waiting, or eager between graphs) TF's own functions
are put back, so a program Terra keeps eager runs at eager's speed, not one Python call per
op slower; :func:`paused` puts them back too.

``record.stop_recording`` (``tf.init_scope``, a custom gradient's forward function, a
function call) is wrapped from :func:`install` on, whatever the handler, so that
:data:`tapes_stopped` follows every pause of the owning thread's gradient recording: a lane
notes it per op from there, where asking TF would be a call more per op.

The op callback used for recording is added on the context directly rather than with
``op_callbacks.add_op_callback``, which would rebind ``execute.execute`` over our wrapper;
the slow door therefore hands off to ``execute_with_callbacks``.
"""

import contextlib
import math
import threading
import weakref

import numpy as np
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context, execute, record
from tensorflow.python.eager import tape as tape_lib
from tensorflow.python.framework import constant_op

from terra import functions

ORIGINAL_FAST = pywrap_tfe.TFE_Py_FastPathExecute
ORIGINAL_SLOW = execute.execute_with_callbacks
ORIGINAL_RECORD = record.record_operation
ORIGINAL_CONVERT = constant_op.convert_to_eager_tensor
ORIGINAL_STOP = record.stop_recording
ORIGINAL_CLEAR_SCALARS = pywrap_tfe.TFE_ClearScalarCache
ORIGINAL_ACCESSED = tape_lib.variable_accessed

# EagerTensor._id -> the Python scalar (int, float, bool), the (dtype string, shape, bytes)
# of the small numeric numpy array (the axes ``tf.reduce_sum(x)`` makes at every call), or
# the value_key of the small list or tuple of scalars (a shape, split sizes), the owning
# thread converted to that tensor while a handler was set; emptied at each iteration's
# start. A float zero is noted as the zero TF's cache of converted scalars holds for it,
# "+0.0" or "-0.0" (below).
converted: dict = {}
# TF converts a Python scalar through a cache keyed by its value, its dtype asked for, the
# context and the device, where 0.0 and -0.0 are one key: the zero converted first is the
# one every later conversion of either gets, until the cache is cleared. Its sign, read once:
# (dtype asked for, context, device) -> "+0.0" or "-0.0"; emptied when TF clears the cache.
_zeros: dict = {}
_SCALARS = (int, float, bool)
_SMALL = 64  # elements of an array worth noting: a lane compares its bytes
# EagerTensor._id of a variable's handle -> a weak reference to the variable eager's tapes
# watch when it is read (``tape.variable_accessed``: a trainable variable, or what
# ``tf.distribute`` resolves it to), noted while a handler is set. A read Terra replays after
# a fallback, or runs eagerly at one, had its Python side (``variable_accessed``) run while
# no real tape was entered, or never (a skipped layer call): ``fallback.watch_read`` lets
# the tapes watch the variable itself by its handle, so that ``watched_variables()`` answers
# as eager's does (a graph tape stands for a region's tape only where every trace's tape
# watched the same variables: ``terra.graph_tapes``).
accessed: dict = {}
# whether the owning thread's gradient recording is paused (TFE_Py_TapeSetIsStopped): read
# from TF when a handler is set, kept by the wrapped ``record.stop_recording`` after
tapes_stopped = [False]

_handler = None
_owner = None
_get_ident = threading.get_ident


def _fast(ctx, op_type, name, *args):
    h = _handler
    if h is None or _get_ident() != _owner:
        return ORIGINAL_FAST(ctx, op_type, name, *args)
    return h.fast(ctx, op_type, name, args)


def _convert(value, ctx, dtype=None):
    t = ORIGINAL_CONVERT(value, ctx, dtype)
    if _handler is not None and _get_ident() == _owner:
        kind = type(value)
        if kind in _SCALARS:
            converted[t._id] = value if value or kind is not float else \
                _zero(t, dtype, ctx) or value
        elif kind is np.ndarray:  # as its bytes: Python may change the array afterwards
            if value.size <= _SMALL and value.dtype.kind in "biufc":
                # the dtype by its string: a numpy dtype hashes and compares ~1 us slower
                converted[t._id] = (value.dtype.str, value.shape, value.tobytes())
        elif (kind is tuple or kind is list) and len(value) <= _SMALL:
            key = value_key(value)  # a shape, split sizes, axes: made anew at each call
            if key is not None:
                converted[t._id] = key
    return t


def _zero(t, dtype, ctx):
    """The zero TF's cache of converted scalars gave ``t``, converted from a Python float
    zero with ``dtype`` asked for (see :data:`_zeros`): "+0.0" or "-0.0", read back the
    first time; None for a dtype that is not a real float."""
    key = (dtype, ctx, ctx.device_name)
    zero = _zeros.get(key)
    if zero is None:
        v = t._numpy_internal()
        if v.dtype.kind != "f":
            return None
        zero = _zeros[key] = "-0.0" if math.copysign(1.0, float(v)) < 0 else "+0.0"
    return zero


def _clear_scalars():
    """``pywrap_tfe.TFE_ClearScalarCache`` while installed: a zero converted next may have
    the other sign."""
    _zeros.clear()
    return ORIGINAL_CLEAR_SCALARS()


def value_key(a):
    """What decides the conversion of the Python value ``a`` to a constant, as a set's key:
    a scalar's type and value (1, 1.0 and True differ), each element's of a flat list or
    tuple of scalars (and a zero's sign: -0.0 == 0.0, but 1 / x tells them apart), a numpy
    array's dtype, shape and bytes; None for anything else (then it is converted every
    time). A scalar's zero keeps no sign: TF converts a Python scalar through its cache of
    constants, where 0.0 and -0.0 are one key, so eager has the one first converted."""
    kind = type(a)
    if kind in _SCALARS:
        return kind, a
    if kind is tuple or kind is list:
        if all(type(x) in _SCALARS for x in a):
            return kind, tuple((type(x), x) if x or type(x) is not float else
                               (float, x, math.copysign(1.0, x)) for x in a)
        return None
    if kind is np.ndarray and a.dtype.kind in "biufc":  # not objects or strings
        return a.dtype.str, a.shape, a.tobytes()
    return None


def plain_scalars(seq):
    """Whether equality tells the :func:`value_key` of a list or tuple like ``seq`` from
    another's of the same element types: its elements are scalars and none is a float zero
    (-0.0 == 0.0) or NaN (never equal to itself)."""
    return all(type(x) in _SCALARS and (x == x and x or type(x) is not float) for x in seq)


def _slow(op_type, num_outputs, inputs, attrs, ctx, name=None):
    h = _handler
    if h is None or _get_ident() != _owner:
        return ORIGINAL_SLOW(op_type, num_outputs, inputs, attrs, ctx, name)
    return h.slow(op_type, num_outputs, inputs, attrs, ctx, name)


def _record(op_type, output_tensors, input_tensors, backward_function,
            forward_function=None):
    """``tf.custom_gradient`` (and ``recompute_grad``) put their own backward function on the
    tapes for tensors ops already produced: the handler hears of it (the graph's own gradient
    of those ops is then not the tape's). A record made while a graph is being built (a
    ``FuncGraph`` capturing an eager tensor: tf_keras infers a model's output signature so at
    every new input shape) concerns that graph's tensors, not the iteration's."""
    h = _handler
    if h is not None and _get_ident() == _owner and context.executing_eagerly():
        functions.note_record(op_type)
        swapped = h.custom_gradient(op_type, output_tensors, input_tensors, backward_function)
        if swapped is not None:
            output_tensors, input_tensors = swapped
    return ORIGINAL_RECORD(op_type, output_tensors, input_tensors, backward_function,
                           forward_function)


def _accessed(variable):
    """``tape.variable_accessed`` while a handler is set: the tapes watch ``variable``, and
    :data:`accessed` notes what they watch by its handle."""
    ORIGINAL_ACCESSED(variable)
    for watched in tape_lib._variables_override(variable):
        key = watched.handle._id
        if key not in accessed:
            accessed[key] = weakref.ref(watched, lambda _, key=key: accessed.pop(key, None))


@contextlib.contextmanager
def _stop_recording():
    mine = _get_ident() == _owner
    try:
        with ORIGINAL_STOP():
            if mine:
                tapes_stopped[0] = True
            yield
    finally:
        if mine:  # paused before, or not
            tapes_stopped[0] = pywrap_tfe.TFE_Py_TapeSetIsStopped()


_installed = False
_plain_execute = None  # ``execute.execute`` as it was when installed (TF's quick_execute)


def install():
    global _installed, _plain_execute
    if not _installed:
        _plain_execute = execute.execute
    _installed = True
    _route(_handler)
    record.stop_recording = _stop_recording
    _zeros.clear()  # TF may have cleared its cache while Terra was not installed
    pywrap_tfe.TFE_ClearScalarCache = _clear_scalars
    functions.install()


def uninstall():
    global _handler, _installed
    _handler = None
    _route(None)
    _installed = False
    record.stop_recording = ORIGINAL_STOP
    pywrap_tfe.TFE_ClearScalarCache = ORIGINAL_CLEAR_SCALARS
    functions.uninstall()


def _route(handler):
    """Put the doors in TF's way, or take them out: with no handler set (Terra waiting, or
    eager between graphs, or :func:`paused`) the ops run through TF's own functions, at no
    cost per op."""
    if handler is not None:
        pywrap_tfe.TFE_Py_FastPathExecute = getattr(handler, "fast_entry", _fast)
        execute.execute = _slow
        record.record_operation = _record
        constant_op.convert_to_eager_tensor = _convert
        tape_lib.variable_accessed = _accessed
    elif _installed:
        pywrap_tfe.TFE_Py_FastPathExecute = ORIGINAL_FAST
        execute.execute = _plain_execute
        record.record_operation = ORIGINAL_RECORD
        constant_op.convert_to_eager_tensor = ORIGINAL_CONVERT
        tape_lib.variable_accessed = ORIGINAL_ACCESSED


def set_handler(handler):
    """Route the calling thread's ops to ``handler`` (``None`` restores plain eager)."""
    global _handler, _owner
    _owner = _get_ident()
    tapes_stopped[0] = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if _installed and handler is not _handler:
        _route(handler)
    _handler = handler


def take_turn(ident):
    """The doors serve thread ``ident`` from now on, in place of the thread that held the
    turn (``terra.replicas``); called in that thread, whose tapes' pause state is read."""
    global _owner
    _owner = ident
    tapes_stopped[0] = pywrap_tfe.TFE_Py_TapeSetIsStopped()


@contextlib.contextmanager
def paused():
    """Run Terra's own eager work (graph building, snapshots) without interception."""
    global _handler
    saved = _handler
    _handler = None
    if _installed and saved is not None:
        _route(None)
    try:
        yield
    finally:
        _handler = saved
        if _installed and saved is not None:
            _route(saved)
