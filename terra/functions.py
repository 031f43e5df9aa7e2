"""``tf.function`` calls inside a training step.

A ``tf.function`` called eagerly runs as one op named after a function of the eager context's
library. With a tape recording, it runs its *forward* function (its outputs, then the
intermediates its gradient needs) and puts its *backward* function on the tape
(``record_operation``); with none, it runs its *inference* function (the outputs alone).
Terra traces with the user's tapes recording, so the TraceGraph holds the forward call and,
in the gradient region, the backward call; the graph calls both
(``graph_ops.call_function``). In co-execution no real tape records, so the same Python
call arrives as the inference function. This module pairs the two names, from what TF hands
the tape while tracing, and lets a fallback's replay put the backward function back on the
tapes for a forward call that co-execution matched with its inference twin.
"""

import functools
import sys
import threading
import weakref

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import concrete_function
from tensorflow.python.ops import gradients_util, resource_variable_ops

from terra import opdefs

_FORWARD_PREFIX = "__forward_"  # TF's name for a forward function
_INFERENCE_PREFIX = "__inference_"  # and for an inference function
_FRAMES = 4  # frames above ``record_operation`` searched for TF's gradient functions object

# forward function name -> TF's tape-gradient functions of the concrete function (kept as
# long as the user's function keeps them)
_functions = weakref.WeakValueDictionary()
_forward_of = {}  # inference function name -> forward function name
_local = threading.local()  # .calls: the tf.function calls under way, (function, stopped)
_ORIGINAL_CALL = concrete_function.ConcreteFunction._call_flat


def called(op_types) -> int:
    """Nodes in the bodies of the distinct ``tf.function``s among ``op_types``: TF
    instantiates each at the first call of the generated graph that reaches it (not before:
    ``terra.background`` instantiates the graph, not what it calls), at about the cost per
    node of the graph's own (GPflow's compiled GPR: ~60 ms in its first co-executed step)."""
    return sum(_body_size(name) for name in set(op_types) if opdefs.info(name).op_def is None)


@functools.cache
def _body_size(name: str) -> int:
    try:
        return len(context.context().get_function_def(name).node_def)
    except Exception:  # noqa: BLE001 - not in the eager library: nothing to instantiate
        return 0


def note_record(op_type: str):
    """``record_operation`` is being called for ``op_type`` (while tracing): for a
    ``tf.function``'s forward call, remember which functions object made it, found as the
    ``self`` of TF's ``record`` method (``_TapeGradientFunctions``) a few frames up."""
    if not op_type.startswith(_FORWARD_PREFIX) or op_type in _functions:
        return
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        frame = frame.f_back
        if frame is None:
            return
        owner = frame.f_locals.get("self")
        forward = getattr(owner, "_forward", None)
        inference = getattr(getattr(owner, "_delayed_rewrite_functions", None),
                            "_inference_function", None)
        if forward is not None and inference is not None and \
                _name(forward) == op_type and callable(getattr(owner, "record", None)):
            _functions[op_type] = owner
            _forward_of[_name(inference)] = op_type
            return


def forward_of(op_type: str):
    """The forward function traced for the inference function ``op_type``, or None (also
    once its functions are gone: a replay could not record its gradient)."""
    forward = _forward_of.get(op_type)
    return forward if forward is not None and forward in _functions else None


def tape_record(forward: str):
    """How a replay puts the backward function of a call of ``forward`` back on the tapes,
    or None if its function is gone."""
    functions = _functions.get(forward)
    return None if functions is None else TapeRecord(functions)


def forward_instead(op_type, num_outputs: int, inputs):
    """Run a ``tf.function``'s call as its forward function, its backward function put on the
    tapes, if TF chose the inference function only because no tape recorded when it chose.

    TF decides in ``ConcreteFunction._call_flat``, before it issues the op (with recording
    paused around it). In co-execution no real tape records, so a call made there is an
    inference call; if Terra falls back at that very op (a new path, say), the op runs
    eagerly with the user's tapes recording again, and as an inference call it would leave
    them without the function's gradient. Returns the first ``num_outputs`` outputs of the
    forward call, or None where TF's choice stands: not an inference call of the function
    being called, recording paused on the thread when it was called (``tf.init_scope``), or
    no tape watching its inputs (``tape.stop_recording()`` takes the tape off the set)."""
    calls = getattr(_local, "calls", None)
    if not calls:  # the common case, first: every eager slow-path op asks
        return None
    op_type = opdefs.op_name(op_type)
    if not op_type.startswith(_INFERENCE_PREFIX):
        return None
    concrete, stopped = calls[-1]
    if stopped or _name(concrete._inference_function) != op_type:
        return None
    paused = pywrap_tfe.TFE_Py_TapeSetIsStopped()  # by the call itself, around the op
    if paused:
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        for variable in concrete._func_graph.variables:  # as the call does under a tape
            resource_variable_ops.variable_accessed(variable)
        possible = gradients_util.PossibleTapeGradientTypes(inputs)
        if possible == gradients_util.POSSIBLE_GRADIENT_TYPES_NONE:
            return None
        pair = concrete._select_forward_and_backward_functions(inputs, possible, True)
        forward, args = pair.forward()
        outputs = forward.call_flat(*args)
        pair.record(outputs)
        return list(outputs[:num_outputs])
    finally:
        if paused:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def install():
    """Note every ``tf.function`` call, and whether recording was stopped when it was made
    (for :func:`forward_instead`)."""
    concrete_function.ConcreteFunction._call_flat = _noted_call


def uninstall():
    concrete_function.ConcreteFunction._call_flat = _ORIGINAL_CALL


def _noted_call(self, tensor_inputs, captured_inputs):
    calls = getattr(_local, "calls", None)
    if calls is None:
        calls = _local.calls = []
    calls.append((self, pywrap_tfe.TFE_Py_TapeSetIsStopped()))
    try:
        return _ORIGINAL_CALL(self, tensor_inputs, captured_inputs)
    finally:
        calls.pop()


class TapeRecord:
    """In a co-executed iteration's custom gradients, the place of a forward call's backward
    function, which the replay records as TF does, over the replayed outputs."""

    __slots__ = ("functions",)

    def __init__(self, functions):
        self.functions = functions

    def record(self, outputs, inputs):
        # as the call does: the tapes watch the function's trainable variables, then learn
        # its backward function
        for variable in self.functions._func_graph.variables:
            resource_variable_ops.variable_accessed(variable)
        self.functions.record(list(outputs), list(inputs), [])


def _name(atomic) -> str:
    name = atomic.name
    return name.decode() if isinstance(name, bytes) else name
