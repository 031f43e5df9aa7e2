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

Where shapes vary between iterations (a sequence length per batch) such a value is not
static, but Python still holds everything it depends on: a stand-in has the shape of the
graph tensor it stands for, so ``tf.shape`` of it is the graph's shape. Such a step is
*local* (``Step.local``, :func:`local_op`): the PythonRunner runs the op itself, eagerly on
its own inputs (the values of the local steps before it), and the graph computes its own
copy for the ops that read it; nobody waits. GPT-2's ``tf.range(tf.shape(tokens)[1])`` made
Python wait for the graph to finish the previous iteration at the start of every step.
"""

import numpy as np
from tensorflow.python.eager import context, execute
from tensorflow.python.framework import constant_op, dtypes, tensor_util

from terra import interception
from terra.nodes import SlotKind

# Deterministic ops with integer or type attributes only, whose eager kernel computes what
# the graph's does: shape arithmetic. Floating-point ops are left out (their rounding is the
# graph's business), and so are random and stateful ops.
FOLDABLE = frozenset({
    "StridedSlice", "Slice", "Pack", "Unpack", "ConcatV2", "GatherV2", "Reshape", "Squeeze",
    "ExpandDims", "Cast", "Identity", "Shape", "Size", "Rank", "Range", "Fill", "Prod", "Sum",
    "Add", "AddV2", "Sub", "Mul", "FloorDiv", "FloorMod", "Maximum", "Minimum", "Neg",
    "Equal", "NotEqual", "Less", "LessEqual", "Greater", "GreaterEqual", "LogicalAnd",
    "LogicalOr", "LogicalNot", "Select", "SelectV2", "Tile", "BroadcastArgs",
})
_INTEGRAL = frozenset({dtypes.int32, dtypes.int64, dtypes.bool})
MAX_ELEMENTS = 64  # larger values are not worth holding in Python
MAX_LOCAL = 1024  # larger values Python reads are the graph's to compute (a fetch)
# Ops that read only their inputs' shapes, which Python's stand-ins have right.
SHAPE_OF = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Ops whose shape functions give their output shapes from their input shapes and the values
# of some integer inputs (a shape, a size, paddings: their indices): where Python has those
# values, it infers the shapes of the stand-ins, as for shapes no trace had
# (``terra.standins``).
VALUE_SHAPED = {
    "Reshape": (1,), "Fill": (0,), "BroadcastTo": (1,), "Tile": (1,), "Slice": (1, 2),
    "StridedSlice": (1, 2, 3), "Pad": (1,), "PadV2": (1,), "MirrorPad": (1,),
    "ExpandDims": (1,), "Range": (0, 1, 2), "OneHot": (1,),
    **dict.fromkeys((
        "RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt",
        "StatelessRandomUniform", "StatelessRandomNormal", "StatelessTruncatedNormal",
        "StatelessRandomUniformInt", "StatelessRandomUniformV2", "StatelessRandomNormalV2",
        "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
        "StatelessRandomUniformFullIntV2"), (0,)),
}


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
    return op.type in FOLDABLE and not op.control_inputs and \
        all(x.dtype in _INTEGRAL for x in (*op.inputs, *op.outputs)) and \
        all(x.shape.num_elements() is not None and x.shape.num_elements() <= MAX_ELEMENTS
            for x in (*op.inputs, *op.outputs))


def local_op(op):
    """Whether graph op ``op`` is one Python may run itself on its inputs' values (a shape
    read, or shape arithmetic on integers): then its attrs as eager execution takes them,
    else None. Whether its inputs are Python's to have is the emitter's to say."""
    if op.type not in FOLDABLE and op.type not in SHAPE_OF or op.control_inputs or \
            any(x.dtype not in _INTEGRAL for x in op.outputs):
        return None
    if op.type in SHAPE_OF:
        if any(x.dtype in (dtypes.resource, dtypes.variant) for x in op.inputs):
            return None
    elif any(x.dtype not in _INTEGRAL for x in op.inputs):
        return None
    return eager_attrs(op)


def small_outputs(node):
    """Whether every output ``node`` had in the traces is shape-sized (``MAX_LOCAL``
    elements at most): what Python computes itself costs it an eager op."""
    return all(np.prod(shape, dtype=np.int64) <= MAX_LOCAL
               for specs in (node.out_specs, *node.sigs.values()) for shape, _ in specs)


def eager_attrs(op):
    """The attributes of graph op ``op`` as ``execute.execute`` takes them."""
    attrs = []
    for name in op.node_def.attr:
        if not name.startswith("_"):  # TF's own marks (XLA scopes, colocation)
            attrs += [name, op.get_attr(name)]
    return tuple(attrs)


def _run(t, inputs):
    """Output ``t.value_index`` of ``t.op`` run eagerly on ``inputs``, or None if TF
    refuses."""
    op = t.op
    try:
        with interception.paused(), context.eager_mode():
            outs = execute.execute(op.type, len(op.outputs), [
                constant_op.constant(v, x.dtype) for v, x in zip(inputs, op.inputs, strict=True)],
                eager_attrs(op), context.context())
    except Exception:  # noqa: BLE001 - an attr TF will not take eagerly: the value is fetched
        return None
    return outs[t.value_index].numpy()


class LocalSteps:
    """Emission's choice of the local steps (``Step.local``) and of the steps whose
    stand-ins' shapes Python infers from local values: the plan's ``steps`` and the graph op
    each node was emitted as (``emitted``)."""

    def __init__(self, steps):
        self.steps = steps
        self._ops = {}  # node -> its graph op (the last emitted)
        self._can = {}  # node -> whether Python can compute its outputs

    def emitted(self, node, op):
        self._ops[node] = op

    def can(self, step):
        """Whether Python can compute ``step``'s outputs itself, on values it holds: a local
        op (:func:`local_op`) whose inputs are constants, values Python fed, outputs of ops
        Python runs or of other local steps (any input but a variable, for a shape read),
        with shape-sized outputs."""
        node = step.node
        found = self._can.get(node)
        if found is None:
            op = self._ops.get(node)
            found = op is not None and not step.python and local_op(op) is not None and \
                not any(step.fetch) and small_outputs(node) and \
                all(self._input(step, slot) for slot in step.slots)
            self._can[node] = found
        return found

    def _input(self, step, slot):
        if slot.kind in (SlotKind.CONST, SlotKind.FEED):
            return True
        if slot.kind is SlotKind.NODE and len(slot.alts) == 1:
            producer = self.steps[slot.alts[0][0]]
            if producer.python or self.can(producer):
                return True
        return step.op_type in SHAPE_OF and slot.kind not in (SlotKind.VAR, SlotKind.RESOURCE)

    def make(self, step):
        """Make ``step`` (one Python :meth:`can` compute) and the local steps it reads local."""
        if step.local is not None or step.python:
            return
        step.local = local_op(self._ops[step.node])
        for slot in step.slots:
            if slot.kind is SlotKind.NODE and len(slot.alts) == 1:
                producer = self.steps[slot.alts[0][0]]
                if self._can.get(producer.node):
                    self.make(producer)

    def infer_shapes(self, step):
        """If ``step``'s output shapes follow from values Python has when it calls the op
        (one of ``VALUE_SHAPED`` whose inputs its shape function reads values of are Python's
        own: constants, values it feeds, outputs of local steps; a dropout's noise shape from
        ``tf.shape`` of a sequence whose length varies), mark it to have them inferred as
        Python calls it, make those inputs' producers local and return True."""
        valued = VALUE_SHAPED.get(step.op_type)
        if valued is None or step.node not in self._ops or not all(
                slot.kind in (SlotKind.CONST, SlotKind.FEED) or
                slot.kind is SlotKind.NODE and len(slot.alts) == 1 and
                self.can(self.steps[slot.alts[0][0]])
                for slot in (step.slots[i] for i in valued)):
            return False
        step.check_shapes = True
        for slot in (step.slots[i] for i in valued):
            if slot.kind is not SlotKind.CONST:
                step.value_shaped = True  # by the values, not the input shapes alone
            if slot.kind is SlotKind.NODE:
                self.make(self.steps[slot.alts[0][0]])
        return True
