"""The two handlers the interception layer calls (``interception.set_handler``).

``TracingDoor`` runs every op for real: in every phase but co-execution, and between
iterations after a fully matched path. ``CoexecDoor`` answers an op along the PythonRunner's
lane where one is (``terra.lanes``; its ``fast_entry`` is TF's fast path itself while it is
the handler, so a lane costs one call), else hands it to the PythonRunner's general path and
any exception to ``Runtime.handle``, then runs the op through ``TracingDoor`` unless the
replay already ran it. Where ``terra._native`` was built, its ``Door`` is the entry: a lane's
native twin answers the op in C, anything else goes on to the Python entry. Both doors act
on the runtime they are given (its recorder and runner, its ``value`` and ``handle``), and
read the hook table (``terra.hooks``), which they never fill.
"""

import threading
from time import process_time as _clock  # an op's kernels may run in TF's threads

from tensorflow.python.eager.core import _FallbackException
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops

from terra import fallback as fallback_lib
from terra import functions, interception, lanes, opdefs
from terra.config import config
from terra.hooks import tensors as _tensors  # the one dict, never rebound: one lookup per op

_EagerTensor = ops.EagerTensor
_Variable = resource_variable_ops.BaseResourceVariable
_MISS = lanes.MISS


class TracingDoor:
    """Handler while ops run for real: makes variable reads explicit (the C fast path reads
    variable arguments without telling anyone) and swaps known stand-ins for their values."""

    def __init__(self, runtime):
        self.runtime = runtime

    def real(self, a):
        """``a`` as the op runs it for real: a stand-in swapped for its value, a variable
        read explicitly (in sequences too)."""
        if type(a) is _EagerTensor:
            e = _tensors.get(a._id)
            return a if e is None or not hasattr(e, "runner") else self.runtime.value(e)
        if isinstance(a, _Variable):
            return a.value()
        if isinstance(a, (list, tuple)) and _tensors:
            items = [self.real(x) for x in a]
            if all(x is y for x, y in zip(items, a)):
                return a
            return _rebuilt(a, items)
        return a

    def fast(self, ctx, op_type, name, args):
        recorder = self.runtime.recorder
        if recorder is None:
            return interception.ORIGINAL_FAST(ctx, op_type, name, *[self.real(a) for a in args])
        start = len(recorder.records)
        real = [self.real(a) for a in args]  # may read variables: recorded from ``start`` on
        began = _clock()
        try:
            return interception.ORIGINAL_FAST(ctx, op_type, name, *real)
        except _FallbackException:
            # the op wrapper takes its slow path, which reads the variables again: the reads
            # made here for the fast path were never seen by eager (C reads them unseen)
            recorder.forget(start)
            raise
        finally:
            recorder.executing += _clock() - began

    def custom_gradient(self, op_type, outputs, inputs, backward):
        """Count it for the trace; and if stand-ins are alive, record their values instead:
        a custom gradient that a fallback interrupted (``tf.custom_gradient`` took its
        arguments as stand-ins, then the iteration went on eagerly) would otherwise sit on
        the tape over tensors no recorded op produced, and the gradient would bypass it."""
        if self.runtime.recorder is not None:
            self.runtime.recorder.custom_gradients += 1
        if _tensors:
            return ([self.real(t) if type(t) is _EagerTensor else t for t in outputs],
                    [self.real(t) if type(t) is _EagerTensor else t for t in inputs])
        return None

    def slow(self, op_type, num_outputs, inputs, attrs, ctx, name=None):
        # The generated op wrapper records the gradient after this returns, with the very
        # list it passed here: swap in place, or the tape would record the stand-in as the
        # input and the gradient would stop there (after a fallback: no gradient at all for
        # the replayed part of the iteration).
        if not isinstance(inputs, list):
            inputs = list(inputs)
        for i, a in enumerate(inputs):
            real = self.real(a)
            if real is not a:
                inputs[i] = real
        outputs = functions.forward_instead(op_type, num_outputs, inputs)
        if outputs is not None:  # a tf.function called in co-execution, run after a fallback
            return outputs
        recorder = self.runtime.recorder
        if recorder is None:
            return interception.ORIGINAL_SLOW(op_type, num_outputs, inputs, attrs, ctx, name)
        began = _clock()
        try:
            return interception.ORIGINAL_SLOW(op_type, num_outputs, inputs, attrs, ctx, name)
        finally:
            recorder.executing += _clock() - began


def _rebuilt(seq, items):
    """``seq`` with ``items`` in place of its elements. A plain list or tuple keeps its type, a
    namedtuple is rebuilt field by field; any other subclass (tf_keras's ``ListWrapper``,
    whose constructor wraps rather than copies) becomes a plain list or tuple, which is what
    TF's conversion makes of it anyway."""
    kind = type(seq)
    if kind is list or kind is tuple:
        return kind(items)
    if isinstance(seq, tuple):
        return kind(*items) if hasattr(seq, "_fields") else tuple(items)
    return items


class CoexecDoor:
    """Handler during co-execution: the PythonRunner, with fallback on any mismatch."""

    def __init__(self, runtime):
        self.runtime = runtime
        entry = self._entry()
        # in C where it was built: a lane's native twin answers, anything else is ``entry``'s
        self.fast_entry = entry if lanes.native is None or not config.native else \
            lanes.native.Door(runtime, entry, self._failed)

    def _entry(self):
        """``pywrap_tfe.TFE_Py_FastPathExecute`` while this door is the handler: the lane at
        the runner's step answers an op of the loop's thread (the only one that sets this
        door), anything else goes on to :meth:`fast`."""
        rt, fast, original, get_ident = self.runtime, self.fast, interception.ORIGINAL_FAST, \
            threading.get_ident

        def fast_entry(ctx, op_type, name, *args):
            if get_ident() != rt.owner:
                return original(ctx, op_type, name, *args)
            runner = rt.runner
            at = runner.cur
            lane = runner.lanes.get(at)
            if lane and lane.op_type == op_type:  # the common case, without a call more
                try:
                    result = lane.follow(args)  # a MISS did nothing
                except Exception as why:  # noqa: BLE001 - Terra's own: the general path's
                    return self._failed(why, at, ctx, op_type, name, args)
                if result is not _MISS:
                    return result
            return fast(ctx, op_type, name, args)
        return fast_entry

    def fast(self, ctx, op_type, name, args):
        """An op of the loop's thread no lane answered: the PythonRunner's general path."""
        runner = self.runtime.runner
        at = runner.cur  # where the op found the runner: was its step matched?
        try:
            return runner.fast(ctx, op_type, name, args)
        except _FallbackException:  # the op wrapper takes its slow path, through the doors
            raise
        except Exception as why:  # noqa: BLE001 - a divergence, a graph error, Terra's own
            return self._failed(why, at, ctx, op_type, name, args)

    def _failed(self, why, at, ctx, op_type, name, args):
        """The runtime handles ``why`` (raised for the op found at ``at``): its result where
        that gives one, else the op run eagerly."""
        rt = self.runtime
        if rt.handle(why, at_op=at):
            return why.result
        fallback_lib.watch_read(rt.open_tapes, op_type, args[0] if args else None)
        return rt.tracing_door.fast(ctx, op_type, name, args)

    def slow(self, op_type, num_outputs, inputs, attrs, ctx, name=None):
        rt = self.runtime
        at = rt.runner.cur
        try:
            return rt.runner.slow(op_type, num_outputs, inputs, attrs, ctx, name)
        except Exception as why:  # noqa: BLE001 - a divergence, a graph error, Terra's own
            if rt.handle(why, at_op=at):
                return why.result
        fallback_lib.watch_read(rt.open_tapes, opdefs.op_name(op_type),
                                inputs[0] if inputs else None)
        return rt.tracing_door.slow(op_type, num_outputs, inputs, attrs, ctx, name)

    def custom_gradient(self, op_type, outputs, inputs, backward):
        """No tape records in co-execution (gradient regions are skipped), but a fallback's
        replay must put the custom gradient back on the tapes it re-enters: log it."""
        rt = self.runtime
        if rt.coexecuting():
            rt.runner.custom_gradient(op_type, outputs, inputs, backward)

