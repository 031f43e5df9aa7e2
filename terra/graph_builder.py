"""GraphGenerator: one symbolic graph from the whole TraceGraph (paper §3.2.2).

The graph is a ConcreteFunction. Graph-side ops are recreated from their recorded type and
attributes with ``create_op``; TF's automatic control dependencies order variable reads and
writes as the trace did. Input Feeding points become ``QueueDequeueV2`` on a per-point queue,
Output Fetching points ``QueueEnqueueV2``; every dequeue waits for the enqueues of fetch points
that precede it in Python's order (Fig. 3.4), so the graph never waits for a value Python can
only produce after a fetch the graph has not served yet.

A node with several successors is a branch point: the ops after it become a
``tf.switch_case`` whose index (the Case Select input) the PythonRunner feeds once it knows
which successor the iteration takes. Until merge-back lands, the TraceGraph is a tree of
traces, so each branch holds the rest of its iteration and no value has to leave a branch;
fetched and escaping values go out through channels.

Alongside the function it emits the PythonRunner's plan: one :class:`Step` per node with
everything the hot path needs precomputed (channels, output specs, static values, successors).
"""

import itertools

from tensorflow.python.eager import context, def_function
from tensorflow.python.framework import constant_op, dtypes, ops, tensor_util
from tensorflow.python.ops import control_flow_switch_case, gen_resource_variable_ops

from terra import opdefs
from terra.queues import Channel
from terra.tracegraph import NodeKind, TraceNode

_READ_ONLY_VAR_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                                "VariableShape"})
_names = itertools.count()
_INT32 = dtypes.int32.as_datatype_enum


class Step:
    """What the PythonRunner does at one node of the TraceGraph."""

    __slots__ = ("node", "kind", "op_type", "attrs", "fp_attrs", "slots", "feed", "out_specs",
                 "check_shapes", "fetch", "has_fetch", "static", "dynamic", "python", "out_feed",
                 "body", "results", "pack", "slow_attrs", "next", "select",
                 "visits")

    def __init__(self, node: TraceNode | None):
        self.node = node
        self.next = []  # successor steps, None for the end of the iteration
        self.select = None  # Case Select channel when there is more than one successor
        self.has_fetch = False
        self.visits = 0  # iterations that passed this step: the position in its channels
        self.body = []  # GRAD: the steps of its region, which Python skips
        if node is None:  # the start of the iteration
            self.kind = NodeKind.START
            return
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
        self.results = node.results
        self.pack = None  # how the fast path groups outputs, learned on first use

    def __repr__(self):
        return "<start>" if self.node is None else f"<step {self.node!r} {self.op_type}>"


class SymbolicGraph:
    """The generated function, its channels, and the PythonRunner's plan for it."""

    def __init__(self, start, steps, function, written):
        self.start = start  # Step before the first op; ``start.next`` are the first steps
        self.steps = steps  # {TraceNode: Step}
        self.function = function
        self.written = written  # [(handle, dtype)] variables the graph writes
        inference = function._inference_function
        self.fn_name = inference.name.decode()
        self.captures = list(function.captured_inputs)
        self.call_attrs = tuple(itertools.chain(
            *context.context().function_call_options.as_attrs().items()))
        self.snapshot_fn = _snapshot_function(written)

    def __str__(self):
        steps = self.steps.values()
        feeds = sum(c is not None for s in steps for c in s.feed + s.out_feed)
        fetches = sum(c is not None for s in steps for c in s.fetch)
        selects = sum(s.select is not None for s in [self.start, *steps])
        return (f"SymbolicGraph({len(self.steps)} steps, {feeds} feeds, {fetches} fetches, "
                f"{selects} switch-cases, {len(self.written)} written variables)")


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


def _plan(tracegraph):
    """One Step per node, linked: ``next`` follows the TraceGraph's edges, except that a
    gradient head continues after its region (Python skips the backward ops)."""
    steps = {n: Step(n) for n in tracegraph.nodes if n.kind not in (NodeKind.START, NodeKind.END)}
    start = Step(None)

    def successors(node):
        return [None if s.kind is NodeKind.END else steps[s] for s in node.succs]

    for node, step in [(tracegraph.start, start), *steps.items()]:
        last = node
        if step.kind is NodeKind.GRAD:
            for _ in range(node.body_len):
                if len(last.succs) != 1:
                    raise NotImplementedError(f"{node.format()}: the gradient region branches")
                last = last.succs[0]
                step.body.append(steps[last])
        step.next = successors(last)
        if len(step.next) > 1:
            with ops.init_scope():
                step.select = Channel(_INT32, ())  # the index into ``next``
    return start, steps


def _unseen_by_python(steps):
    """Backward ops inside gradient regions that are not gradient results: the PythonRunner
    skips them, so it never needs their values (nor their data-dependent shapes)."""
    unseen = set()
    for step in steps.values():
        if step.kind == NodeKind.GRAD:
            unseen.update(s.node for s in step.body)
            for r in step.results:
                unseen.difference_update(p[0] for p in (r or ())[1:] if p is not None)
    return unseen


def generate(tracegraph) -> SymbolicGraph:
    """Build the symbolic graph for every path of the TraceGraph."""
    start, steps = _plan(tracegraph)
    consumers_needing_value = set()  # (node, out) read by a Python-run op
    graph_consumed = set()  # (node, out) of Python-run ops read by graph ops
    unseen = _unseen_by_python(steps)
    for step in steps.values():
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
        for step in steps.values():
            node = step.node
            for i, slot in enumerate(step.slots):
                if slot.kind == "feed" and step.kind == NodeKind.OP and not step.python:
                    step.feed[i] = Channel(slot.dtype, slot.shape)
            for k, (_, dtype) in enumerate(step.out_specs):
                if step.python and (node, k) in graph_consumed:
                    step.out_feed[k] = Channel(dtype, node.out_relaxed[k])

    written = {}

    def body():
        top = ops.get_default_graph()
        outer = {}  # id -> the top graph's capture of an eager tensor (handles, variables)
        env = {}  # (node, out) -> graph tensor
        slot_env = {}  # (node, input index) -> graph tensor of an external input

        def captured(t):
            c = outer.get(t._id)
            if c is None:
                c = outer[t._id] = top.capture(t)
            return c

        def dequeue(channel, last_fetch):
            with ops.control_dependencies(last_fetch):
                op = ops.get_default_graph()._create_op_internal(
                    "QueueDequeueV2", [captured(channel.handle)],
                    attrs={"component_types": opdefs.attr_value("list(type)", [channel.dtype]),
                           "timeout_ms": opdefs.attr_value("int", -1)})
            t = op.outputs[0]
            if channel.shape is not None:
                t.set_shape(channel.shape)
            return t

        def enqueue(step, k, t, last_fetch):
            shape = tuple(t.shape.as_list()) if t.shape.rank is not None else None
            with ops.init_scope():  # the graph's shape: relaxed where observations differ
                channel = Channel(t.dtype.as_datatype_enum, shape)
            with ops.control_dependencies(last_fetch):
                op = ops.get_default_graph()._create_op_internal(
                    "QueueEnqueueV2", [captured(channel.handle), t],
                    attrs={"Tcomponents": opdefs.attr_value("list(type)", [channel.dtype]),
                           "timeout_ms": opdefs.attr_value("int", -1)})
            last_fetch[:] = [op]
            step.fetch[k] = channel
            step.has_fetch = True

        def emit(step, last_fetch):
            node = step.node
            if step.python:
                for k, channel in enumerate(step.out_feed):
                    if channel is not None:
                        env[(node, k)] = dequeue(channel, last_fetch)
                return
            inputs = []
            for i, slot in enumerate(step.slots):
                if slot.kind == "node":
                    inputs.append(env[(slot.node, slot.out)])
                    continue
                if slot.kind == "same":
                    t = slot_env[(slot.node, slot.out)]
                elif slot.kind in ("var", "capture"):
                    t = captured(slot.tensor)
                elif slot.kind == "const":
                    t = constant_op.constant(slot.value, dtype=slot.dtype)
                else:
                    t = dequeue(step.feed[i], last_fetch)
                slot_env[(node, i)] = t
                inputs.append(t)
            op = ops.get_default_graph()._create_op_internal(node.op_type, inputs,
                                                             attrs=_attr_protos(node))
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
                wanted = (k in node.fetched or k in node.escaped
                          or (node, k) in consumers_needing_value)
                if wanted or step.dynamic and node not in unseen:
                    value = tensor_util.constant_value(t) if wanted else None
                    if value is not None:
                        with ops.init_scope():
                            step.static[k] = constant_op.constant(value)
                    else:
                        enqueue(step, k, t, last_fetch)

        def emit_from(step, last_fetch):
            """Emit ``step`` and what follows it; a branch point becomes a switch-case
            whose branches each emit the rest of their iteration."""
            while True:
                if step.kind is NodeKind.OP:
                    emit(step, last_fetch)
                for body_step in step.body:  # GRAD: the backward ops Python skips
                    emit(body_step, last_fetch)
                nxt = step.next
                if step.select is not None:
                    index = dequeue(step.select, last_fetch)
                    branches = [_branch(emit_from, s) for s in nxt]
                    with ops.control_dependencies(last_fetch):
                        control_flow_switch_case.switch_case(index, branches)
                    return
                if nxt[0] is None:
                    return
                step = nxt[0]

        emit_from(start, [])

    body.__name__ = f"terra_step_{next(_names)}"
    function = def_function.function(body, autograph=False)
    function = function.get_concrete_function()
    return SymbolicGraph(start, steps, function, list(written.values()))


def _branch(emit_from, step):
    """One switch-case branch. It starts after the fetches before the switch (the switch op
    waits for them), so its own ordering starts empty."""

    def branch():
        if step is not None:
            emit_from(step, [])

    return branch
