"""The commit point: a graph writes no variable until Python says its iteration has ended,
so most iterations need no snapshot (section 3.9).

A fallback restores the variables the graph writes to their values at the iteration's start.
Reading them all before every job (the snapshot) costs a copy of every written buffer, since
the graph's first write then copies on write: for an Adam-trained ResNet50, 23M parameters
and two slots each, ~250 MB more resident memory and a memcpy per step.

So where the plan allows it, the graph gets a gate (:func:`gate`): its writes, and every op
that follows from them, wait (control dependency) for a dequeue from the ``commit`` channel,
which waits for a ``ready`` enqueue, which waits for every other op. At the path's end Python
waits for ``ready`` only (:func:`ready`: the graph's errors are still this iteration's), and
sends the token (:func:`send`) when the iteration ends: the next tape enter, an op after the
path's end, ``terra.reset()``. Until then nothing is written, so a fallback (a new op in a
tape still open, a read of a value the graph does not return, Terra's own failure) restores
nothing. At the token Python reads the variables first (nothing is written yet) only if a
fallback can still come: verify mode's iteration, or a stand-in Python holds that the graph
does not return; and before waiting for a value the gated ops compute (a metric read after
its update), which the graph cannot give before the token.

The plan allows a gate when every write is an op of the function's top level (not inside a
switch-case or a loop, whose op would hold back everything in it) and every gated op is one
that cannot fail at run time on the shapes the plan checked (variable reads and writes,
dense optimizer updates, elementwise float math, queue ops: ``SAFE_OPS``): since the gate
waits for every other op, a graph that fails has failed before writing anything. Other
graphs keep the snapshot before every job (``graph_runner``).
"""

import collections

from tensorflow.python.eager import record
from tensorflow.python.framework import constant_op, dtypes, ops, tensor_util

from terra import interception, opdefs, syncs
from terra.folding import SHAPE_OF
from terra.queues import Channel

# Ops after the gate: none of them fails at run time on checked shapes (a queue op only when
# cancelled, after which nothing is restored anyway). Division and powers only on floats: an
# integer division by zero fails.
SAFE_OPS = frozenset({
    "Placeholder", "Const", "Identity", "IdentityN", "NoOp", "Snapshot", "StopGradient",
    "EnsureShape", "QueueEnqueueV2", "QueueDequeueV2", "ReadVariableOp", "AssignVariableOp",
    "AssignAddVariableOp", "AssignSubVariableOp", "VariableShape", "Cast", "Shape", "Size",
    "Rank", "ZerosLike", "OnesLike", "Add", "AddV2", "AddN", "Sub", "Mul", "Neg", "Square",
    "Sqrt", "Rsqrt", "Exp", "Log", "Log1p", "Abs", "Sign", "Maximum", "Minimum",
    "SquaredDifference", "Tanh", "Sigmoid", "Relu", "Less", "LessEqual", "Greater",
    "GreaterEqual", "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "Select",
    "SelectV2", "Sum", "Max", "Min", "DivNoNan", "MulNoNan",
})
_FLOAT_ONLY = frozenset({"RealDiv", "Div", "Pow", "Reciprocal", "Inv", "Mean", "FloorDiv",
                         "FloorMod", "Mod", "TruncateDiv"})
# Ops that fail only on their shapes and attrs where every input that is not a float has a
# value known when the graph is built (a convolution's ``input_sizes``, a slice's bounds): a
# trace ran them on the same shapes, so in the graph they cannot fail (but for exhaustion).
_SHAPE_CHECKED = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Conv2D", "Conv2DBackpropInput",
    "Conv2DBackpropFilter", "Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter", "BiasAdd", "BiasAddGrad", "ReluGrad", "Relu6",
    "Relu6Grad", "LeakyRelu", "LeakyReluGrad", "TanhGrad", "SigmoidGrad", "SqrtGrad",
    "RsqrtGrad", "ReciprocalGrad", "InvGrad", "Elu", "EluGrad", "Selu", "SeluGrad", "Softplus",
    "SoftplusGrad", "Softmax", "LogSoftmax", "Reshape", "Transpose", "StridedSlice", "Slice",
    "ConcatV2", "Pack", "Tile", "BroadcastTo", "Pad", "PadV2", "ExpandDims", "Squeeze", "Fill",
    "Prod", "ShapeN", "BroadcastGradientArgs", "MaxPoolGrad", "AvgPoolGrad",
    "FusedBatchNormV3", "FusedBatchNormGradV3",
})
_NOT_GATED = frozenset({"Placeholder", "Const"})  # function inputs and constants
NO_GATE = (None, None, frozenset(), frozenset())
_NOT_WRITES = frozenset({"QueueEnqueueV2", "QueueDequeueV2", "Assert", "CheckNumerics",
                         "CheckNumericsV2"})
# functional control flow: a write inside is the emitter's to see (``Emitter.first_write``)
_CONTROL_FLOW = frozenset({"Case", "StatelessCase", "If", "StatelessIf", "While",
                           "StatelessWhile"})


def _safe(op):
    # shapes known when the graph was built are the run's (dequeues check theirs): no
    # broadcast or assignment can then meet a shape it rejects
    if not all(x.shape.is_fully_defined() for x in op.inputs if x.dtype != dtypes.resource):
        return False
    if op.type in SAFE_OPS:
        return True
    if op.type in _FLOAT_ONLY:
        return all(t.dtype.is_floating for t in op.outputs)
    # dense optimizer updates: every input's shape is the plan's (sparse ones index)
    return op.type.startswith("ResourceApply") and opdefs.info(op.type).in_graph


def may_write(op_type):
    """Whether an op of ``op_type`` may change a variable (a stateful op of the graph other
    than Terra's queue ops and the checks; a ``tf.function`` call counts)."""
    return op_type not in _NOT_WRITES and not opdefs.info(op_type).effect_free


def gate(graph, first_write, enqueued):
    """Put the commit gate into ``graph`` (the function being built), whose ops before index
    ``first_write`` change no state and whose writes are all of its top level;
    ``enqueued``: the ``(QueueEnqueueV2 op, Channel)`` of every fetch point.

    The gated ops are the writes and what follows from them: their consumers, and any later
    op on a resource a gated op used (TF's automatic control dependencies will order it after
    the write). Where a gated op might fail at run time, the variables whose writes it
    follows from are written early instead, ungated, and snapshotted before every job (a
    Keras 3 dropout's seed generator, whose state the next dropout reads again: 2 numbers,
    not the model). Returns the commit channel, the ``ready`` channel (a value once every op
    not gated has run, so Python can wait for the graph's errors without letting it write),
    the ids of the fetch channels the gated ops fill and the ids of the early variables'
    handles; or ``NO_GATE`` where nothing would be gated (the module's docstring)."""
    everything = graph.get_operations()
    early = set()  # resources written early, as (op, output index) of their placeholders
    while True:
        gated, unsafe = _gated(everything[first_write:], early)
        if unsafe is None:
            break
        if not unsafe or unsafe <= early:
            return NO_GATE
        early |= unsafe
    if not gated:
        return NO_GATE
    unused = _unused(everything, graph.outputs)
    free = [op for op in everything
            if op not in gated and op not in unused and op.type not in _NOT_GATED]
    consumed = {x.op for op in free for x in op.inputs} | \
        {c for op in free for c in op.control_inputs}
    sinks = [op for op in free if op not in consumed]
    with ops.init_scope():
        channel = Channel(dtypes.int32.as_datatype_enum, ())
        ready = Channel(dtypes.int32.as_datatype_enum, ())
    int32 = opdefs.attr_value("list(type)", [channel.dtype])
    forever = opdefs.attr_value("int", -1)
    with ops.control_dependencies(sinks):
        told = graph._create_op_internal(
            "QueueEnqueueV2", [graph.capture(ready.handle), constant_op.constant(0)],
            attrs={"Tcomponents": int32, "timeout_ms": forever})
    with ops.control_dependencies([told]):
        token = graph._create_op_internal(
            "QueueDequeueV2", [graph.capture(channel.handle)],
            attrs={"component_types": int32, "timeout_ms": forever})
    for op in gated:  # the first gated ops wait for the token; the rest follow them
        if op.type not in _NOT_GATED and not any(x.op in gated for x in op.inputs) and \
                not any(c in gated for c in op.control_inputs):
            op._add_control_input(token)
    late = frozenset(id(c) for op, c in enqueued if op in gated)
    outer = {inner.op: outer._id for outer, inner in graph.captures}
    return channel, ready, late, frozenset(outer[op] for op, _ in early if op in outer)


def _unused(everything, returned):
    """The ops whose values nothing uses (no op reads them, but ops like them, and the
    function does not return them) and that have no effect and cannot fail: eager ran them
    (a gradient function computes the gradient of every input of its op, and the tape keeps
    the ones it needs), the graph need not. The ``ready`` enqueue does not wait for them, so
    TF prunes them from the function (DCGAN: seven convolutions and matmuls of gradients
    nobody asked for)."""
    fixed = _fixed(everything)
    users = collections.Counter(t.op for t in returned)
    for op in everything:
        users.update(x.op for x in op.inputs)
        users.update(op.control_inputs)
    unused = set()
    stack = [op for op in everything if not users[op]]
    while stack:
        op = stack.pop()
        if op in unused or users[op] or op not in fixed:
            continue
        unused.add(op)
        for producer in [x.op for x in op.inputs] + list(op.control_inputs):
            users[producer] -= 1
            if not users[producer]:
                stack.append(producer)
    return unused


def _fixed(everything):
    """The ops without effects that cannot fail at run time: whose failures depend only on
    what is the same at every run as in the traces, which ran them without one (every input's
    shape, and an integer input's value: a slice's bounds, a convolution's ``input_sizes``,
    the axes ``BroadcastGradientArgs`` gives a gradient's sum). One pass in the graph's order
    (its producers come first)."""
    fixed = set()

    def shape_fixed(x):
        return x.shape.is_fully_defined() or x.op in fixed

    def value_fixed(x):
        op = x.op
        if op.type in SHAPE_OF:  # a shape read: of input k for ShapeN's output k
            return shape_fixed(op.inputs[x.value_index if op.type == "ShapeN" else 0])
        if op.type == "BroadcastGradientArgs":
            return all(value_fixed(y) for y in op.inputs)
        return tensor_util.constant_value(x) is not None

    for op in everything:
        kind = op.type
        if kind in SAFE_OPS or kind in _SHAPE_CHECKED:
            pass
        elif kind not in _FLOAT_ONLY or not all(t.dtype.is_floating for t in op.outputs):
            continue
        if op.op_def.is_stateful:
            continue
        if all(value_fixed(x) if x.dtype.is_integer else shape_fixed(x) for x in op.inputs):
            fixed.add(op)
    return fixed


def _gated(ops_, early):
    """The ops gated when the writes of the ``early`` resources are not, each with the
    resources whose writes it follows from; and the resources of the first gated op that
    might fail (None if none does)."""
    gated = {}  # op -> the written resources it follows from
    users = {}  # resource -> the written resources the gated ops using it follow from
    for op in ops_:
        resources = [(x.op, x.value_index) for x in op.inputs if x.dtype == dtypes.resource]
        roots = set()
        if op.type not in _CONTROL_FLOW and may_write(op.type):
            roots.update(r for r in resources if r not in early)
        for x in op.inputs:
            roots |= gated.get(x.op, set())
        for c in op.control_inputs:
            roots |= gated.get(c, set())
        for r in resources:
            roots |= users.get(r, set())
        if not roots:
            continue
        if not _safe(op):
            return gated, roots
        gated[op] = roots
        for r in resources:
            users.setdefault(r, set()).update(roots)
    return gated, None


_TOKEN = []


def send(graph, job, snapshot):
    """Let ``job``'s graph write (once per job). ``snapshot``: a fallback may still come, so
    read the variables first (they are the iteration's start: nothing is written before the
    token). Returns whether a snapshot was taken."""
    if job.committed:
        return False
    job.committed = True
    if snapshot and graph.gated_fn is not None:
        with interception.paused(), record.stop_recording():  # Terra's read, not the user's
            job.snapshot = graph.gated_fn()
    if not _TOKEN:
        with interception.paused():
            _TOKEN.append(constant_op.constant(0, dtype=dtypes.int32))
    graph.commit.put(_TOKEN[0])
    return job.snapshot is not None


def ready(graph, job, waiting, step, closing):
    """At the path's end (``step``): wait until every op before the gate has run, so the
    graph's errors are this iteration's. Returns whether to let it write now: only when the
    iteration ends (``closing``), since until then an op (inside a tape still open), a read
    of a value the graph does not return, or Terra's own failure may still fall back, and
    the commit needs a snapshot only if one still can."""
    if not job.ready:
        waiting.value(graph.ready, graph.ready.taken, job, step, syncs.END)
        job.ready = True
    return closing
