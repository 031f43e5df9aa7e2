"""GraphGenerator: one symbolic graph from a path of the TraceGraph (paper §3.2.2).

The graph is a ConcreteFunction. Graph-side ops are recreated from their recorded type and
attributes with ``create_op``; TF's automatic control dependencies order variable reads and
writes as the trace did. Input Feeding points become ``QueueDequeueV2`` on a per-point queue,
Output Fetching points ``QueueEnqueueV2``; every dequeue waits for the enqueues of fetch points
that precede it in Python's order (Fig. 3.4), so the graph never waits for a value Python can
only produce after a fetch the graph has not served yet.

Alongside the function it emits the PythonRunner's plan: one :class:`Step` per path node with
everything the hot path needs precomputed (channels, output specs, static values).
"""

import itertools

from tensorflow.python.eager import context, def_function
from tensorflow.python.framework import constant_op, ops, tensor_util
from tensorflow.python.ops import gen_resource_variable_ops

from terra import opdefs
from terra.queues import Channel
from terra.tracegraph import NodeKind, TraceNode

_READ_ONLY_VAR_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                                "VariableShape"})
_names = itertools.count()


class Step:
    """What the PythonRunner does at one position of the path."""

    __slots__ = ("node", "kind", "op_type", "attrs", "fp_attrs", "slots", "feed", "out_specs",
                 "check_shapes", "fetch", "static", "dynamic", "python", "out_feed", "result",
                 "body_len", "results", "pack", "slow_attrs", "list_inputs")

    def __init__(self, node: TraceNode):
        self.node = node
        self.kind = node.kind
        self.op_type = node.op_type
        self.attrs = node.attrs
        self.fp_attrs = None  # the raw fast-path attr tuple, learned on first validation
        self.slow_attrs = None  # the same for the slow path
        self.slots = node.inputs
        self.feed = [None] * len(node.inputs)  # slot index -> Channel for feed slots
        self.out_specs = node.out_specs
        self.check_shapes = len(node.sigs) > 1
        n_out = len(node.out_specs)
        self.fetch = [None] * n_out  # out -> Channel (graph enqueues, Python dequeues)
        self.static = [None] * n_out  # out -> value known when the graph was built (a tensor)
        self.dynamic = False  # output shapes depend on data: fetch instead of a stand-in
        self.python = node.kind == NodeKind.OP and not node.in_graph
        self.out_feed = [None] * n_out  # python op outputs the graph consumes
        self.result = {}  # out -> index among the function's outputs
        self.body_len = node.body_len
        self.results = node.results
        self.pack = None  # how the fast path groups outputs, learned on first use
        self.list_inputs = node.kind == NodeKind.OP and any(opdefs.info(node.op_type).list_inputs)


class SymbolicGraph:
    """The generated function, its channels, and the PythonRunner's plan for it."""

    def __init__(self, path, steps, function, outputs, written):
        self.path = path
        self.steps = steps
        self.function = function
        self.outputs = outputs  # [(node, out)] returned by the function
        self.written = written  # [(handle, dtype)] variables the graph writes
        inference = function._inference_function
        self.fn_name = inference.name.decode()
        self.captures = list(function.captured_inputs)
        self.n_outputs = len(function.function_type.flat_outputs) if outputs else 0
        self.call_attrs = tuple(itertools.chain(
            *context.context().function_call_options.as_attrs().items()))
        self.snapshot_fn = _snapshot_function(written)
        self.fetch_channels = [(s, c) for s in steps for c in s.fetch if c is not None]

    def __str__(self):
        feeds = sum(c is not None for s in self.steps for c in s.feed + s.out_feed)
        fetches = sum(c is not None for s in self.steps for c in s.fetch)
        return (f"SymbolicGraph({len(self.steps)} steps, {feeds} feeds, {fetches} fetches, "
                f"{len(self.outputs)} outputs, {len(self.written)} written variables)")


def _snapshot_function(written):
    if not written:
        return None

    def snapshot():
        return [gen_resource_variable_ops.read_variable_op(h, dt) for h, dt in written]

    return def_function.function(snapshot, autograph=False).get_concrete_function()


def _attr_protos(node):
    types = opdefs.info(node.op_type).attr_types
    return {name: opdefs.attr_value(types[name], value)
            for name, value in node.attrs if name in types and value is not None}


def _var_dtype(node):
    attrs = dict(node.attrs)
    return attrs.get("dtype", attrs.get("T"))


def _unseen_by_python(steps):
    """Backward ops inside gradient regions that are not gradient results: the PythonRunner
    skips them, so it never needs their values (nor their data-dependent shapes)."""
    unseen = set()
    for i, step in enumerate(steps):
        if step.kind == NodeKind.GRAD:
            unseen.update(s.node for s in steps[i + 1:i + 1 + step.body_len])
            for r in step.results:
                unseen.difference_update(p[0] for p in (r or ())[1:] if p is not None)
    return unseen


def generate(path: list[TraceNode]) -> SymbolicGraph:
    """Build the symbolic graph for one path (start and end excluded)."""
    steps = [Step(n) for n in path]
    consumers_needing_value = set()  # (node, out) read by a Python-run op
    graph_consumed = set()  # (node, out) of Python-run ops read by graph ops
    unseen = _unseen_by_python(steps)
    for step in steps:
        if step.node in unseen and any(slot.kind == "feed" for slot in step.slots):
            raise NotImplementedError(
                f"{step.node.format()}: a backward op reads a value that changes every step; "
                "the gradient code that computes it is skipped in co-execution")
        for slot in step.slots:
            if slot.kind != "node":
                continue
            if step.python and slot.node.in_graph:
                consumers_needing_value.add((slot.node, slot.out))
            elif not step.python and step.kind == NodeKind.OP and not slot.node.in_graph:
                graph_consumed.add((slot.node, slot.out))

    with ops.init_scope():
        for step in steps:
            node = step.node
            for i, slot in enumerate(step.slots):
                if slot.kind == "feed" and step.kind == NodeKind.OP and not step.python:
                    step.feed[i] = Channel(slot.dtype, slot.shape)
            for k, (_, dtype) in enumerate(step.out_specs):
                if step.python and (node, k) in graph_consumed:
                    step.out_feed[k] = Channel(dtype, node.out_relaxed[k])

    outputs = []
    written = {}

    def body():
        g = ops.get_default_graph()
        env = {}
        slot_env = {}  # (node, input index) -> graph tensor of an external input
        last_fetch = []

        def dequeue(channel):
            with ops.control_dependencies(last_fetch):
                op = g._create_op_internal(
                    "QueueDequeueV2", [g.capture(channel.handle)],
                    attrs={"component_types": opdefs.attr_value("list(type)", [channel.dtype]),
                           "timeout_ms": opdefs.attr_value("int", -1)})
            t = op.outputs[0]
            if channel.shape is not None:
                t.set_shape(channel.shape)
            return t

        def enqueue(step, k, t):
            shape = tuple(t.shape.as_list()) if t.shape.rank is not None else None
            with ops.init_scope():  # the graph's shape: relaxed where observations differ
                channel = Channel(t.dtype.as_datatype_enum, shape)
            with ops.control_dependencies(last_fetch):
                op = g._create_op_internal(
                    "QueueEnqueueV2", [g.capture(channel.handle), t],
                    attrs={"Tcomponents": opdefs.attr_value("list(type)", [channel.dtype]),
                           "timeout_ms": opdefs.attr_value("int", -1)})
            last_fetch[:] = [op]
            step.fetch[k] = channel

        for step in steps:
            node = step.node
            if step.kind != NodeKind.OP:
                continue
            if step.python:
                for k, channel in enumerate(step.out_feed):
                    if channel is not None:
                        env[(node, k)] = dequeue(channel)
                continue
            inputs = []
            for i, slot in enumerate(step.slots):
                if slot.kind == "node":
                    inputs.append(env[(slot.node, slot.out)])
                    continue
                if slot.kind == "same":
                    t = slot_env[(slot.node, slot.out)]
                elif slot.kind in ("var", "capture"):
                    t = g.capture(slot.tensor)
                elif slot.kind == "const":
                    t = constant_op.constant(slot.value, dtype=slot.dtype)
                else:
                    t = dequeue(step.feed[i])
                slot_env[(node, i)] = t
                inputs.append(t)
            op = g._create_op_internal(node.op_type, inputs, attrs=_attr_protos(node))
            for k, t in enumerate(op.outputs):
                env[(node, k)] = t
                shape, dtype = step.out_specs[k]
                if t.dtype.as_datatype_enum != dtype:
                    raise AssertionError(f"{node.format()}: graph dtype {t.dtype} differs")
                if not t.shape.is_fully_defined() and not step.check_shapes:
                    step.dynamic = True  # shape not implied by input shapes: data-dependent
            if node.in_graph and node.op_type not in _READ_ONLY_VAR_OPS:
                for slot in step.slots:
                    if slot.kind == "var":
                        written.setdefault(slot.tensor._id, (slot.tensor, _var_dtype(node)))
            for k, t in enumerate(op.outputs):
                wanted = k in node.fetched or (node, k) in consumers_needing_value
                if wanted or step.dynamic and node not in unseen:
                    value = tensor_util.constant_value(t) if wanted else None
                    if value is not None:
                        with ops.init_scope():
                            step.static[k] = constant_op.constant(value)
                    else:
                        enqueue(step, k, t)
                if k in node.escaped or k in node.fetched:
                    step.result[k] = len(outputs)
                    outputs.append((node, k))
        return [env[x] for x in outputs]

    body.__name__ = f"terra_step_{next(_names)}"
    function = def_function.function(body, autograph=False)
    function = function.get_concrete_function()
    return SymbolicGraph(path, steps, function, outputs, list(written.values()))

