"""Static values: what a graph tensor Python reads holds in every iteration, known at build.

Python often reads values that only depend on static shapes: Keras' dropout passes
``tf.shape(x)`` as the noise shape and TF turns it into a ``TensorShape``, reading each
``shape[i]`` with ``__index__``. In co-execution each such read is a fetch, and a fetch makes
Python wait for the graph to reach it (a small BERT read 26 of them per step). Where the
value cannot change while the graph is the same, the PythonRunner hands it out at once
(``Step.static``), and the graph neither waits nor enqueues.

TF's ``constant_value`` knows ``Shape`` of a fully defined shape and a few ops on constants,
but not ``StridedSlice``, the op that ``shape[i]`` is. :func:`static_value` adds: an op of a
small set of integer-only, deterministic ops (indexing, packing, arithmetic on shapes) whose
inputs are all static is run eagerly on those values, with the graph op's own attributes.
"""

from tensorflow.python.eager import context, execute
from tensorflow.python.framework import constant_op, dtypes, tensor_util

from terra import interception

# Deterministic ops with integer or type attributes only, whose eager kernel computes what
# the graph's does: shape arithmetic. Floating-point ops are left out (their rounding is the
# graph's business), and so are random and stateful ops.
_FOLDABLE = frozenset({
    "StridedSlice", "Slice", "Pack", "Unpack", "ConcatV2", "GatherV2", "Reshape", "Squeeze",
    "ExpandDims", "Cast", "Identity", "Shape", "Size", "Rank", "Range", "Fill", "Prod", "Sum",
    "Add", "AddV2", "Sub", "Mul", "FloorDiv", "FloorMod", "Maximum", "Minimum", "Neg",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "Select", "SelectV2", "Tile", "BroadcastArgs",
})
_INTEGRAL = frozenset({dtypes.int32, dtypes.int64, dtypes.bool})
MAX_ELEMENTS = 64  # larger values are not worth holding in Python


def static_value(t, memo):
    """The numpy value graph tensor ``t`` has whenever the graph runs, or None. ``memo``
    (``tensor.ref()`` -> value or None) is shared by the calls of one graph's build."""
    key = t.ref()
    if key in memo:
        return memo[key]
    value = tensor_util.constant_value(t)
    if value is None and _foldable(t.op):
        inputs = [static_value(x, memo) for x in t.op.inputs]
        if all(x is not None for x in inputs):
            value = _run(t, inputs)
    if value is not None and value.size > MAX_ELEMENTS:
        value = None
    memo[key] = value
    return value


def _foldable(op):
    return op.type in _FOLDABLE and not op.control_inputs and \
        all(x.dtype in _INTEGRAL for x in (*op.inputs, *op.outputs)) and \
        all(x.shape.num_elements() is not None and x.shape.num_elements() <= MAX_ELEMENTS
            for x in (*op.inputs, *op.outputs))


def _run(t, inputs):
    """Output ``t.value_index`` of ``t.op`` run eagerly on ``inputs``, or None if TF
    refuses."""
    op = t.op
    attrs = []
    for name in op.node_def.attr:
        if not name.startswith("_"):  # TF's own marks (XLA scopes, colocation)
            attrs += [name, op.get_attr(name)]
    try:
        with interception.paused(), context.eager_mode():
            outs = execute.execute(op.type, len(op.outputs), [
                constant_op.constant(v, x.dtype) for v, x in zip(inputs, op.inputs, strict=True)],
                tuple(attrs), context.context())
    except Exception:  # noqa: BLE001 - an attr TF will not take eagerly: the value is fetched
        return None
    return outs[t.value_index].numpy()
