"""GraphGenerator: one symbolic graph from the whole TraceGraph (paper §3.2.2).

The graph is a ConcreteFunction. Graph-side ops are recreated from their recorded type and
attributes with ``create_op``; TF's automatic control dependencies order variable reads and
writes as the trace did. Input Feeding points become ``QueueDequeueV2`` on a per-point queue,
Output Fetching points ``QueueEnqueueV2``; every dequeue waits for the enqueues of fetch points
that precede it in Python's order (Fig. 3.4), so the graph never waits for a value Python can
only produce after a fetch the graph has not served yet.

Control flow follows the case assignment (``terra.case_assignment``, Algorithm 1): the
TraceGraph, with each gradient region taken as one node, is cut into an ordered list of
switch-cases. A switch-case with several cases becomes a ``tf.switch_case`` whose index (the
Case Select input) the PythonRunner feeds once it takes one of the case's control edges; one
with a single case is emitted inline. Once some path can have ended (an edge into ``end``),
every later switch-case gets one more, empty, case that a finished path selects.

Values cross switch-cases as the ``tf.switch_case``'s outputs: each branch returns what later
switch-cases read, a branch that did not compute a value returns a placeholder of its dtype
and shape (never read: the PythonRunner validates that every input's producer ran). An input
that joins paths (a ``phi`` slot) reads whichever of its producers ran last; in the graph it is
a running value that each of those producers overwrites.

With ``xla``, the graph's compute ops carry the attributes ``tf.xla.experimental.jit_scope``
sets, so TF's clustering pass compiles them with XLA (on CPU too: an explicit request) and
leaves out what XLA cannot compile (queues, Python-run values, ``tf.switch_case`` itself).
Random ops stay outside the clusters: XLA draws other numbers than TF's kernels for the same
seed, and Terra must compute what eager computes. The scope changes at every fetch: a cluster
never spans one, so Python does not wait for the whole cluster around a value it reads (the
paper saw XLA delay Output Fetching on YOLOv3). Ops whose input shapes vary between iterations
are not marked: XLA compiles a cluster per input shape, and recompiling at every new shape
made GPT2 and SDPoint 3-5x slower than without XLA.

Alongside the function it emits the PythonRunner's plan: one :class:`Step` per node with
everything the hot path needs precomputed (channels, output specs, static values, successors).
"""

import collections
import functools
import itertools
import math

import numpy as np
from tensorflow.core.framework import attr_value_pb2, function_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context, def_function
from tensorflow.python.framework import (
    constant_op,
    dtypes,
    errors,
    ops,
    tensor_shape,
    tensor_util,
)
from tensorflow.python.ops import (
    array_ops,
    control_flow_switch_case,
    gen_array_ops,
    gen_resource_variable_ops,
    gradients_impl,
    math_ops,
    while_loop,
)
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import _pywrap_util_port, compat

from terra import opdefs, queues, regions
from terra.case_assignment import assign_cases
from terra.loops import roll
from terra.queues import Channel
from terra.tracegraph import SMALL_CONST, NodeKind, TraceNode, relax

_READ_ONLY_VAR_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                                "VariableShape"})
# Outputs whose graph shape TF leaves unknown although it depends on nothing but the input
# shapes (a kernel's scratch space): not data-dependent, so not fetched
_SCRATCH_OUTPUTS = {"FusedBatchNormV3": frozenset({5}), "_FusedBatchNormEx": frozenset({5})}
_names = itertools.count()
_INT32 = dtypes.int32.as_datatype_enum
_INT_DTYPES = frozenset(d.as_datatype_enum for d in (dtypes.int32, dtypes.int64))


class Step:
    """What the PythonRunner does at one node of the TraceGraph."""

    __slots__ = ("node", "kind", "op_type", "attrs", "fp_attrs", "slots", "feed", "out_specs",
                 "check_shapes", "value_shaped", "fetch", "has_fetch", "static", "dynamic",
                 "python", "out_feed",
                 "body", "results", "pack", "slow_attrs", "next", "puts", "visits", "seq",
                 "owner", "cone_phis", "backward_feeds", "looped", "any_path")

    def __init__(self, node: TraceNode | None):
        self.node = node
        self.next = []  # successor steps, None for the end of the iteration
        # per successor: the Case Select values taking that edge feeds, ((channel, index),
        # ...); None when no edge out of this step feeds any
        self.puts = None
        self.has_fetch = False
        self.visits = 0  # iterations that passed this step: the position in its channels
        self.seq = -1  # when the PythonRunner last passed it (its running count of steps)
        self.owner = self  # whose ``seq`` counts for it: a gradient op's is its region's head
        self.looped = node is not None and node.loop is not None  # passed once per trip
        self.body = []  # GRAD: the steps of its region, which Python skips; LOOP: its body
        # GRAD: the joined inputs of its cone, ((slot, input index of the call or None,
        # producer), ...): the producer each must have taken this iteration
        self.cone_phis = ()
        # GRAD: (channels of its backward ops' feed inputs, {iteration signature: values})
        self.backward_feeds = None
        if node is None:  # the start of the iteration
            self.kind = NodeKind.START
            return
        self.kind = node.kind
        self.op_type = node.op_type
        self.attrs = node.attrs
        self.fp_attrs = None  # the raw fast-path attr tuple, learned on first validation
        self.slow_attrs = None  # the same for the slow path
        self.slots = [_settled(slot) for slot in node.inputs]
        self.feed = [None] * len(node.inputs)  # slot index -> Channel for feed slots
        self.out_specs = node.out_specs
        # the output shape follows a small integer fed from Python that took several values
        # (a resize's size), whatever the input shapes: it is inferred every time
        self.value_shaped = _value_shaped(node)
        self.check_shapes = len(node.sigs) > 1 or self.value_shaped
        n_out = len(node.out_specs)
        self.fetch = [None] * n_out  # out -> Channel (graph enqueues, Python dequeues)
        self.static = [None] * n_out  # out -> value known when the graph was built (a tensor)
        self.dynamic = False  # output shapes depend on data: fetch instead of a stand-in
        self.python = node.kind == NodeKind.OP and not node.in_graph
        self.out_feed = [None] * n_out  # python op outputs the graph consumes
        self.results = node.results
        # GRAD: one region for every forward path (terra.regions), whose gradient is None
        # where eager's is: the PythonRunner checks each iteration reaches its sources
        self.any_path = node.kind is NodeKind.GRAD and regions.folded(node) and \
            node.attrs[4].endswith("NONE")
        self.pack = None  # how the fast path groups outputs, learned on first use

    def __repr__(self):
        return "<start>" if self.node is None else f"<step {self.node!r} {self.op_type}>"


class SymbolicGraph:
    """The generated function, its channels, and the PythonRunner's plan for it."""

    def __init__(self, start, steps, switch_cases, function, written, rewriters_off=(),
                 loops=()):
        self.start = start  # Step before the first op; ``start.next`` are the first steps
        self.steps = steps  # {TraceNode: Step}
        self.loops = loops  # the loop nodes (terra.loops), each a While
        self.switch_cases = switch_cases  # [(SwitchCase, Case Select channel or None)]
        self.function = function
        self.written = written  # [(handle, dtype)] variables the graph writes
        inference = function._inference_function
        self.fn_name = inference.name.decode()
        self.captures = list(function.captured_inputs)
        attrs = context.context().function_call_options.as_attrs()
        if rewriters_off:
            attrs["config_proto"] = _with_rewriters_off(attrs["config_proto"], rewriters_off)
        self.call_attrs = tuple(itertools.chain(*attrs.items()))
        self.snapshot_fn = _snapshot_function(written)

    def rewind(self):
        """Make the graph ready for a new iteration after one was abandoned mid-way (a
        cancelled job): its channels drained and counted from zero, as the steps' visits.
        A completed iteration leaves them so by itself (``PythonRunner.finish``)."""
        queues.settle()
        steps = list(self.steps.values())
        for step in steps:
            steps.extend(step.body)
        channels = {id(c): c for _, c in self.switch_cases if c is not None}
        for step in steps:
            step.visits = 0
            found = [*step.feed, *step.out_feed, *step.fetch]
            if step.backward_feeds:
                found += step.backward_feeds[0]
            for puts in step.puts or ():
                found += [c for c, _ in puts]
            channels.update((id(c), c) for c in found if c is not None)
        for channel in channels.values():
            channel.drain()

    def __str__(self):
        steps = self.steps.values()
        feeds = sum(c is not None for s in steps for c in s.feed + s.out_feed)
        fetches = sum(c is not None for s in steps for c in s.fetch)
        selects = sum(c is not None for _, c in self.switch_cases)
        return (f"SymbolicGraph({len(self.steps)} steps, {feeds} feeds, {fetches} fetches, "
                f"{selects} switch-cases, {len(self.loops)} while loops, "
                f"{len(self.written)} written variables)")


def _with_rewriters_off(serialized, names):
    """The function-call config with Grappler's rewriters ``names`` off.

    ``constant_folding``, where shapes vary between iterations: ops recorded for one shape
    constrain the shapes of tensors that other paths share; Grappler's shape inference unifies
    them as if every branch ran, and constant folding then turned a ``tf.shape`` of a shared
    tensor into one path's shape (a wrong value, found on FasterRCNN; right again with only
    this pass off).

    ``arithmetic_optimization`` and ``remapping``, under XLA: they run before XLA's clustering
    and replace marked ops by fused TF-only ops without the marks (``_UnaryOpsComposition``,
    ``_FusedConv2D``), which cut the clusters; XLA fuses those ops itself."""
    config = config_pb2.ConfigProto()
    config.ParseFromString(serialized)
    for name in names:
        setattr(config.graph_options.rewrite_options, name,
                rewriter_config_pb2.RewriterConfig.OFF)
    return config.SerializeToString()


_last_snapshot = [None, None]  # (key, function) of the last graph built


def _snapshot_function(written):
    """The function reading every variable the graph writes (what a fallback restores). A
    graph built again for the same program writes the same variables: the last one is
    reused (handles keyed by ``_id``, which TF never gives twice), saving a function trace
    per rebuild; only the last is kept, so no program's variables outlive it here."""
    if not written:
        return None
    key = tuple((h._id, dt) for h, dt in written)
    if _last_snapshot[0] == key:
        return _last_snapshot[1]

    def snapshot():
        return [gen_resource_variable_ops.read_variable_op(h, dt) for h, dt in written]

    fn = def_function.function(snapshot, autograph=False).get_concrete_function()
    _last_snapshot[:] = key, fn
    return fn


def _var_dtype(node, handle):
    """The dtype of the variable behind ``handle``: from its handle data (an eager handle
    carries it), else from the writing op's attrs (``RngReadAndSkip``, which writes a
    ``tf.random.Generator``'s state, names no dtype)."""
    data = getattr(handle, "_handle_data", None)
    if data is not None and data.shape_and_type:
        return data.shape_and_type[0].dtype
    attrs = dict(node.attrs)
    return attrs.get("dtype", attrs.get("T"))


def _plan(tracegraph):
    """One Step per node. A gradient head owns its region's steps (Python skips the
    backward ops); a loop node holds its body's steps, which Python visits once per trip."""
    steps = {n: Step(n) for n in tracegraph.nodes if n.kind not in (NodeKind.START, NodeKind.END)}
    start = Step(None)
    for node, step in steps.items():
        if node.kind not in (NodeKind.GRAD, NodeKind.LOOP):
            continue
        last = node
        for _ in range(node.body_len):
            if len(last.succs) != 1:
                raise NotImplementedError(f"{node.format()}: the region branches")
            last = last.succs[0]
            step.body.append(steps[last])
            if node.kind is NodeKind.GRAD:
                steps[last].owner = step
        if node.kind is NodeKind.GRAD and not node.rolled:
            step.cone_phis = tuple(  # a settled input reads one value whoever read it first
                (slot, k if n is None else None, (p, out))
                for (n, k), (_, p, out) in node.cone.items()
                if len((slot := (node if n is None else n).inputs[k]).alts) > 1
                and _settled(slot) is slot)
    return start, steps


def _exit(node):
    """The node whose edges leave ``node``'s unit: the last op of a gradient region or of a
    loop's body."""
    for _ in range(node.body_len if node.kind in (NodeKind.GRAD, NodeKind.LOOP) else 0):
        node = node.succs[0]
    return node


def _switch_cases(tracegraph):
    """Algorithm 1 over the units of the TraceGraph (a loop node and its body are one), and
    a Case Select channel for every switch-case the graph must branch at. Returns
    ``[(SwitchCase, channel or None, skip index or None)]`` and what taking each edge
    between units feeds: ``{(unit head, successor): [(channel, index)]}``."""
    switch_cases = assign_cases(tracegraph.start, tracegraph.end, lambda n: _exit(n).succs)
    puts = {}
    planned = []
    ended = []  # exits seen so far: a path may have ended before the switch-cases after them
    for sc in switch_cases:
        channel = skip = None
        if sc.is_switch or ended:
            with ops.init_scope():
                channel = Channel(_INT32, ())
            for index, case in enumerate(sc.cases):
                for u, v in case.control_edges:
                    puts.setdefault((u, v), []).append((channel, index))
            if ended:
                skip = len(sc.cases)
                for u, v in ended:
                    puts.setdefault((u, v), []).append((channel, skip))
        ended += [(u, v) for u, v in sc.exits]
        planned.append((sc, channel, skip))
    return planned, puts


def _link(tracegraph, start, steps, puts, conds):
    """Each step's ``next`` and ``puts``. An edge into a loop node leads to its body's first
    step, with the Loop Cond saying "go on" (1), and past the loop, with "stop" (0) and the
    Case Selects of the edge out of the loop; the body's last step leads round again or out
    the same way."""
    end = tracegraph.end

    def arrivals(node, puts_so_far):
        if node is end:
            return [(None, puts_so_far)]
        if node.kind is not NodeKind.LOOP:
            return [(steps[node], puts_so_far)]
        go, stop = (conds[node], 1), (conds[node], 0)
        found = [(steps[node.succs[0]], puts_so_far + [go])]
        for s in _exit(node).succs:
            found += arrivals(s, puts_so_far + [stop] + puts.get((node, s), []))
        return found

    for node, step in [(tracegraph.start, start), *steps.items()]:
        if node.in_body or node.kind is NodeKind.LOOP:
            continue
        loop = node.loop
        if loop is not None and node is _exit(loop):  # round again, or out of the loop
            found = [(steps[loop.succs[0]], [(conds[loop], 1)])]
            for s in node.succs:
                found += arrivals(s, [(conds[loop], 0)] + puts.get((loop, s), []))
        elif loop is not None:
            found = [(steps[node.succs[0]], [])]
        else:
            found = [a for s in _exit(node).succs
                     for a in arrivals(s, list(puts.get((node, s), ())))]
        step.next = [target for target, _ in found]
        if any(p for _, p in found):
            step.puts = [tuple(p) for _, p in found]


def _settled(slot):
    """A ``same`` input (an external value an earlier op of the iteration read first) whose
    first readers all read one captured tensor, or one constant: that capture or constant
    itself. Which op reads such a value first depends on the path (a mask read on both sides
    of two random choices); as a ``same`` input, a combination of branches no trace took
    would find its first reader had not run, and fall back."""
    if slot.kind != "same":
        return slot
    firsts = [node.inputs[k] for node, k in slot.alts]
    if all(f.kind == "capture" for f in firsts) and len({f.tensor._id for f in firsts}) == 1 \
            or all(f.kind == "const" for f in firsts) and len(
                {(f.value.shape, f.value_bytes) for f in firsts}) == 1:
        return firsts[0]
    return slot


def _small_int_feed(slot):
    """Whether ``slot`` is fed a small integer tensor from Python (a size, a shape)."""
    return slot.kind == "feed" and slot.dtype in _INT_DTYPES and slot.shape is not None and \
        None not in slot.shape and math.prod(slot.shape) <= SMALL_CONST


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


def _backward_feeds(step, fetched_shapes, shaped):
    """The values a region's backward ops read from outside that change between iterations
    (``Tile`` multiples, the count a mean divides by: a gradient function computes them in
    Python from shapes). The PythonRunner skips those functions, so it feeds the values the
    traces saw, looked up by the iteration's signature: the shapes and tiny values of
    everything fed before the call, and the output shapes of the ops before it whose shapes
    depend on data (``fetched_shapes``, fetched anyway). None when it reads no such value.

    Where the forward pass may take shapes no trace had (``shaped``: an op of the cone checks
    its shapes), the values every trace saw alike are constants of the region that may not
    hold for a new shape (the traces' feature maps all ended 6x6, a new resize size ends them
    4x4: the mean's divisor is stale, and the gradient silently wrong). The region then accepts
    only the signatures traces had, even with nothing to feed."""
    feeds = [(body_step, i) for body_step in step.body
             for i, slot in enumerate(body_step.slots) if slot.kind == "feed"]
    if not feeds and not shaped:
        return None
    table = {}
    for before, body in step.node.observations:
        sig = tuple(part for n, k, part in before if (n in fetched_shapes if k is None else
                    n.inputs[k].kind == "feed" and n.kind is NodeKind.OP and n.in_graph and
                    not n.in_body))
        values = [body.get((s.node, i)) for s, i in feeds]
        if any(v is None for v in values):
            raise NotImplementedError(
                f"{step.node.format()}: a backward op reads a large value that changes "
                "every step; the gradient code that computes it is skipped in co-execution")
        known = table.setdefault(sig, values)
        if any(a.tobytes() != b.tobytes() for a, b in zip(known, values)):
            raise NotImplementedError(
                f"{step.node.format()}: a backward op reads a value that the shapes and "
                "values fed before the gradient call do not determine")
    with ops.init_scope():
        table = {sig: [constant_op.constant(v, dtype=s.slots[i].dtype)
                       for v, (s, i) in zip(values, feeds)] for sig, values in table.items()}
    return [s.feed[i] for s, i in feeds], table


def _symbolic(step, in_branch):
    """Whether a gradient region is emitted as TF's symbolic gradient of the graph's forward
    ops rather than as its recorded backward ops.

    The recorded ops read values that gradient functions computed in Python from shapes
    (``Tile`` multiples, the count a mean divides by, a ``Reshape`` target). Where those vary,
    ``_backward_feeds`` can only feed the values of signatures a trace had; a shape that keeps
    changing (a boolean mask's row count) would fall back at every new value. The symbolic
    gradient runs the same gradient functions in graph mode, which compute those values from
    the shapes at run time. It differentiates the graph rather than the tape, so it is taken
    only where both agree (``TraceNode.taped``: the tape recorded every forward op between
    the sources and the target) and the region and its forward ops are emitted outside any
    ``tf.switch_case`` (``in_branch``: a gradient through a switch-case's outputs would rewrite
    its branches, and inside a branch the sources would have to be mapped to the branch's
    captures, which is not built); and where Python feeds nothing the region reads (its
    inputs are validated, never fed). A region merged from the regions of every trip count
    through a loop (``rolled``) has no recorded ops for trip counts no trace took: it is
    symbolic, or its loop stays unrolled."""
    node = step.node
    if step.kind is not NodeKind.GRAD or not node.taped:
        return False
    if not node.rolled and not any(
            slot.kind == "feed" for body_step in step.body for slot in body_step.slots):
        return False
    if any(slot.kind == "feed" for slot in step.slots):
        return False
    return node not in in_branch and (regions.folded(node) or not any(
        producer in in_branch for _, producer, _ in node.cone.values()))


def _bodies_read_outside(steps):
    """Gradient regions whose backward ops are read other than as the region's results (a
    gradient taken through a nested tape's gradient differentiates its backward ops, and
    reads their values): TF's symbolic gradient would not make those ops, so such a region
    keeps its recorded ones."""
    needed = set()
    for step in steps.values():
        owner = step.owner
        for slot in step.slots:
            if slot.kind not in ("node", "same"):
                continue
            for p, out in slot.alts:
                region = steps[p].owner if p in steps else None
                if region is None or region is steps[p] or region is owner:
                    continue
                results = {q for r in region.node.results or () if r for q in r[1:]}
                if slot.kind == "same" or (p, out) not in results:
                    needed.add(region.node)
    return needed


def _shapes_vary(tracegraph):
    """Nodes whose input shapes may differ from every recorded signature: downstream of a
    feed or Python-run op whose shape varied, or of joined inputs of different shapes. The
    PythonRunner looks their output shapes up by input shapes (``check_shapes``): a node
    traced with one signature would otherwise hand out stand-ins of the old shape. A loop's
    body reads its own outputs of the previous trip: repeated until nothing changes."""
    varies = set()

    def exact(shape):
        return shape is not None and None not in shape

    order = [n for n in tracegraph.topological() if n.kind is NodeKind.OP]
    while True:
        before = len(varies)
        for node in order:
            for slot in node.inputs:
                if slot.kind == "feed" and not exact(slot.shape) or slot.kind == "same" and any(
                        not exact(p.inputs[k].shape) for p, k in slot.alts):
                    varies.add(node)
                elif slot.kind == "node" and (
                        any(p in varies or not p.in_graph and not exact(p.out_relaxed[k])
                            for p, k in slot.alts) or
                        len({tuple(p.out_relaxed[k] or ()) for p, k in slot.alts}) > 1):
                    varies.add(node)
        if len(varies) == before:
            return varies


def _alts_of(step):
    """Every producer (node, out) that a graph input of ``step`` may read."""
    return [(slot, p) for slot in step.slots if slot.kind == "node" for p in slot.alts]


def _value_key(slot):
    """The key under which emission keeps the graph value a ``node``/``same`` slot reads."""
    if len(slot.alts) > 1:
        return ("phi", id(slot))
    node, out = slot.alts[0]
    return ("v" if slot.kind == "node" else "s", node, out)


def _spec(key, slots):
    """(dtype enum, shape) of an emission key's value, for a branch's placeholder."""
    if key[0] == "v":
        return key[1].out_specs[key[2]][1], key[1].out_relaxed[key[2]]
    if key[0] == "s":
        slot = key[1].inputs[key[2]]
        return slot.dtype, slot.shape
    specs = [_spec(("v" if slots[key[1]].kind == "node" else "s", *p), slots)
             for p in slots[key[1]].alts]
    shape = specs[0][1]
    for _, other in specs[1:]:
        shape = relax(shape, other)
    return specs[0][0], shape


def _exports(planned, steps):
    """Per switch-case: the emission keys its branches must return (read by a later one)."""
    sc_of = {}
    for j, (sc, _, _) in enumerate(planned):
        for case in sc.cases:
            for head in case.block:
                sc_of[head] = j
                for body_step in steps[head].body:
                    sc_of[body_step.node] = j
    exports = [dict() for _ in planned]  # ordered sets
    for node, step in steps.items():
        for slot in step.slots:
            if slot.kind not in ("node", "same"):
                continue
            key = _value_key(slot)
            for p, _ in slot.alts:
                if sc_of[p] != sc_of[node]:
                    exports[sc_of[p]][key] = None
    return [list(e) for e in exports]


class _NotSymbolic(Exception):
    """TF's symbolic gradient of a region does not stand for its tape's: emit its recorded
    backward ops instead."""

    def __init__(self, node):
        super().__init__(node)
        self.node = node


class _KeepUnrolled(Exception):
    """A loop's While, or TF's symbolic gradient through it, cannot be built: generate again
    with that loop unrolled."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key


def generate(tracegraph, xla=False, exact=True, recorded=frozenset(),
             unrolled=frozenset(), fold=frozenset()) -> SymbolicGraph:
    """Build the symbolic graph for every path of the TraceGraph (its compute ops compiled
    with XLA if ``xla``), its loops rolled into While ops (``terra.loops``). ``exact``: every
    op rounds as its eager kernel does (see _EXACT_OFF and _keep_eager_rounding). ``recorded``:
    gradient regions emitted as their recorded backward ops even where ``_symbolic`` would
    take TF's symbolic gradient (it failed for them), by node id (the same in every rolled
    copy); ``unrolled``: loops left unrolled (by their first trip's nodes: their While
    failed); ``fold``: gradient calls (by key) whose regions become one (``terra.regions``)."""
    graph_name = f"terra_step_{next(_names)}"
    original = tracegraph
    tracegraph, loops = roll(tracegraph, keep=unrolled)
    tracegraph = regions.fold(tracegraph, fold, keep=unrolled)
    start, steps = _plan(tracegraph)
    varying = _shapes_vary(tracegraph)
    for node in varying:
        steps[node].check_shapes = True
    planned, puts = _switch_cases(tracegraph)
    with ops.init_scope():
        conds = {loop: Channel(_INT32, ()) for loop in loops}  # Loop Cond: 1 go on, 0 stop
    _link(tracegraph, start, steps, puts, conds)
    exports = _exports(planned, steps)
    in_branch = {node for sc, channel, _ in planned if channel is not None
                 for case in sc.cases for head in case.block
                 for node in [head] + [b.node for b in steps[head].body]}
    symbolic = set()
    needed = _bodies_read_outside(steps)
    for node, step in steps.items():
        if node.id not in recorded and node not in needed and _symbolic(step, in_branch):
            symbolic.add(node)
        elif step.kind is NodeKind.GRAD and node.rolled:
            return generate(original, xla, exact, recorded, unrolled | {node.rolled}, fold)
    consumers_needing_value = set()  # (node, out) read by a Python-run op
    graph_consumed = set()  # (node, out) of Python-run ops read by graph ops
    phi_of = {}  # (node, out) or ("s", node, input) -> the phi slots it updates
    slots = {}  # id -> slot, for phi keys
    unseen = _unseen_by_python(steps)
    for step in steps.values():
        for slot in step.slots:
            if slot.kind in ("node", "same") and len(slot.alts) > 1:
                slots[id(slot)] = slot
                for p, k in slot.alts:
                    key = (p, k) if slot.kind == "node" else ("s", p, k)
                    phi_of.setdefault(key, []).append(id(slot))
        if step.kind is NodeKind.GRAD:  # a result whose shape varies is fetched for its shape
            consumers_needing_value.update(
                part for r in step.results for part in (r or ())[1:]
                if part is not None and len(part[0].sigs) > 1)
        for _, (p, k) in _alts_of(step):
            if step.python and p.in_graph:
                consumers_needing_value.add((p, k))
            elif not step.python and step.kind == NodeKind.OP and not p.in_graph:
                graph_consumed.add((p, k))

    with ops.init_scope():
        for step in steps.values():
            node = step.node
            if step.owner.node in symbolic:
                continue  # its backward ops are not emitted
            for i, slot in enumerate(step.slots):
                if slot.kind == "feed" and step.kind == NodeKind.OP and not step.python:
                    step.feed[i] = Channel(slot.dtype, slot.shape)
            for k, (_, dtype) in enumerate(step.out_specs):
                if step.python and (node, k) in graph_consumed:
                    step.out_feed[k] = Channel(dtype, node.out_relaxed[k])

    written = {}
    segments = itertools.count()  # XLA scopes: a new one after every fetch
    scope = [None]
    looping = [False]  # emitting a loop's body

    def body():
        top = ops.get_default_graph()
        outer = {}  # id -> the top graph's capture of an eager tensor (handles, variables)

        def captured(t):
            c = outer.get(t._id)
            if c is None:
                # TF captures a small tensor as a Const made in the *default* graph: inside a
                # switch-case's branch that is the branch's, and another branch reading the
                # cached capture fails generation ("accessed from branch 1")
                with top.as_default():
                    c = outer[t._id] = top.capture(t)
            return c

        def dequeue(channel, last_fetch):
            """The channel's next value, its relaxed shape stated by an ``EnsureShape`` op.

            ``set_shape`` informs only this Python graph: TF infers the instantiated
            function's shapes again from the ops' shape functions, and a dequeue's is unknown
            (the captured queue handle carries no shapes). Grappler may recover the rank from
            the consumers, but not where a switch-case's branches use one joined value as two
            shapes (each applies it to its own variable): a fused Conv2D reading the dequeue
            then recorded an unknown-rank input shape, which oneDNN's rewrite reads as rank 0,
            a CHECK failure that aborts the process. ``EnsureShape``'s own shape function gives
            the shape; at run time it checks what Python validated before feeding."""
            with ops.control_dependencies(last_fetch):
                op = ops.get_default_graph()._create_op_internal(
                    "QueueDequeueV2", [captured(channel.handle)],
                    attrs={"component_types": opdefs.attr_value("list(type)", [channel.dtype]),
                           "timeout_ms": opdefs.attr_value("int", -1)})
            t = op.outputs[0]
            if channel.shape is not None:
                t = array_ops.ensure_shape(t, channel.shape)
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
            scope[0] = None
            step.fetch[k] = channel
            step.has_fetch = True

        def define(env, key, t):
            env[key] = t
            for sid in phi_of.get(key[1:] if key[0] == "v" else key, ()):
                env[("phi", sid)] = t

        consts = {}  # one Const op per value per graph (and XLA scope)

        def constant(value, dtype):
            """A constant input: made once per value where the same graph reads it again (an
            optimizer's hyperparameters, once per variable). TF-Agents' DQN graph had 167
            constants among 589 ops, 34 after; generation makes each op in Python."""
            array = np.asarray(value)
            if array.dtype.hasobject:
                return constant_op.constant(value, dtype=dtype)
            key = (ops.get_default_graph(), scope[0], dtype, array.shape, array.dtype.str,
                   array.tobytes())
            t = consts.get(key)
            if t is None:
                t = consts[key] = constant_op.constant(value, dtype=dtype)
            return t

        def slot_tensor(step, i, slot, env, last_fetch):
            if slot.kind in ("node", "same"):
                return env[_value_key(slot)]
            if slot.kind in ("var", "capture"):
                t = captured(slot.tensor)
            elif slot.kind == "const":
                t = constant(slot.value, slot.dtype)
            else:
                t = dequeue(step.feed[i], last_fetch)
                if ops.get_default_graph() is not top:
                    # in a switch-case's branch: TF's gradient through the Case differentiates
                    # the branch with respect to all its inputs, the captured queue handle too,
                    # and a dequeue has no gradient. A value Python feeds has none either.
                    t = array_ops.stop_gradient(t)
            define(env, ("s", step.node, i), t)
            return t

        def for_xla(graph, n_ops):
            """Mark the compute ops created since ``n_ops`` for XLA (section 3.12)."""
            if scope[0] is None:
                scope[0] = f"{graph_name}_{next(segments)}".encode()
            for created in graph.get_operations()[n_ops:]:
                if not created.type.startswith("Queue") and not _draws_random(created) \
                        and created.type != "StatefulPartitionedCall":  # _call_function's
                    _compile_with_xla(created, scope[0])

        def emit(step, env, last_fetch):
            node = step.node
            graph = ops.get_default_graph()
            n_ops = len(graph.get_operations())
            if step.python:
                for k, channel in enumerate(step.out_feed):
                    if channel is not None:
                        define(env, ("v", node, k), dequeue(channel, last_fetch))
                return
            inputs = [slot_tensor(step, i, slot, env, last_fetch)
                      for i, slot in enumerate(step.slots)]
            if opdefs.info(node.op_type).op_def is None:  # a tf.function's forward or backward
                op = _call_function(graph, node, inputs)
            else:
                op = graph._create_op_internal(
                    node.op_type, inputs, attrs=opdefs.attr_protos(node.op_type, node.attrs))
            if exact:
                _keep_eager_rounding([op])
            if xla and not step.check_shapes and not looping[0]:  # a new shape would
                for_xla(graph, n_ops)  # recompile its cluster; a While is not clustered
            if node.in_graph and node.op_type not in _READ_ONLY_VAR_OPS:
                for slot in step.slots:
                    if slot.kind == "var":
                        written.setdefault(slot.tensor._id,
                                          (slot.tensor, _var_dtype(node, slot.tensor)))
            for k, t in enumerate(op.outputs):  # decided for all outputs before any is
                note_dynamic(step, k, t)  # emitted: a data-dependent op fetches every one
            for k, t in enumerate(op.outputs):
                output(step, k, t, env, last_fetch)

        def note_dynamic(step, k, t):
            """Whether output ``k`` of ``step`` (``t`` in the graph) has a shape its input
            shapes do not imply: the op's outputs are then fetched, not stood in for."""
            node = step.node
            if k in _SCRATCH_OUTPUTS.get(node.op_type, ()):
                return
            if not t.shape.is_fully_defined() and not step.check_shapes or node.data_dependent \
                    or step.check_shapes and k == 0 and not _shape_fn_decides(node):
                step.dynamic = True

        def output(step, k, t, env, last_fetch):
            """Output ``k`` of ``step`` is ``t``: what later ops read, and a fetch if Python
            reads it (or needs its data-dependent shape)."""
            node = step.node
            define(env, ("v", node, k), t)
            if t.dtype.as_datatype_enum != step.out_specs[k][1]:
                raise AssertionError(f"{node.format()}: graph dtype {t.dtype} differs")
            note_dynamic(step, k, t)
            wanted = (k in node.fetched or k in node.escaped
                      or (node, k) in consumers_needing_value)
            if wanted or step.dynamic and node not in unseen:
                value = tensor_util.constant_value(t) if wanted else None
                if value is not None:
                    with ops.init_scope():
                        step.static[k] = constant_op.constant(value)
                else:
                    enqueue(step, k, t, last_fetch)

        def emit_gradient(step, env, last_fetch):
            """A region whose backward ops read values that change with shapes: TF's symbolic
            gradient of the graph's forward ops, whose gradient functions compute those
            values from the shapes at run time (see _symbolic)."""
            node = step.node
            graph = ops.get_default_graph()
            n_ops = len(graph.get_operations())
            _, n_target, n_sources, no_output_gradients, unconnected = node.attrs
            tensors = [slot_tensor(step, i, slot, env, last_fetch)
                       for i, slot in enumerate(step.slots)]
            try:
                grads = gradients_impl.gradients(
                    tensors[:n_target], tensors[n_target:n_target + n_sources],
                    None if no_output_gradients else tensors[n_target + n_sources:],
                    unconnected_gradients=UnconnectedGradients[unconnected.split(".")[-1]])
            except (LookupError, ValueError, TypeError) as e:  # e.g. an op with no gradient
                raise _NotSymbolic(node) from e
            if exact:
                _keep_eager_rounding(graph.get_operations()[n_ops:])
            if xla and not any(steps[p].check_shapes for _, p, _ in node.cone.values()):
                for_xla(graph, n_ops)
            for result, g in zip(node.results, grads, strict=True):
                parts = (None,) if g is None else (
                    (g.values, g.indices, g.dense_shape) if hasattr(g, "indices") else (g,))
                if result is None and g is None:
                    continue
                if result is None or len(result) - 1 != len(parts) or any(
                        (p is None) != (t is None) for p, t in zip(result[1:], parts)):
                    raise _NotSymbolic(node)  # structured unlike the tape's gradient
                for p, t in zip(result[1:], parts, strict=True):
                    if p is not None:
                        output(steps[p[0]], p[1], t, env, last_fetch)

        def emit_loop(step, env, last_fetch):
            """A loop node: a While whose Loop Cond the PythonRunner feeds after each trip
            (and before the first rolled one). The loop variables are a token, which orders
            a trip's dequeues after the previous trip's fetches (Fig. 3.4 across trips), and
            the body's values read by the next trip or after the loop, starting from the
            last peeled trip's."""
            node = step.node
            carried = node.carried
            with ops.control_dependencies(last_fetch):
                token = array_ops.identity(constant_op.constant(0))
            start_values = [env[_value_key(slot)] for slot in node.inputs]
            invariants = [tensor_shape.TensorShape([])] + [
                tensor_shape.TensorShape(relax(b.out_relaxed[k], slot.alts[0][0].out_relaxed[k]))
                .most_specific_compatible_shape(t.shape)
                for (b, k), slot, t in zip(carried, node.inputs, start_values, strict=True)]
            fetched = []

            def go_on(token, *_):
                return math_ops.not_equal(dequeue(conds[node], [token]), 0)

            def trip(token, *values):
                local = collections.ChainMap({}, env)
                for (b, k), v in zip(carried, values, strict=True):
                    for sid in phi_of.get((b, k), ()):
                        local[("phi", sid)] = v
                trip_fetch = [token]
                for body_step in step.body:
                    emit(body_step, local, trip_fetch)
                fetched.append(trip_fetch[0] is not token)
                with ops.control_dependencies(trip_fetch):
                    token = array_ops.identity(token)
                return [token] + [local[("v", b, k)] for b, k in carried]

            looping[0] = True
            try:
                outs = while_loop.while_loop(
                    go_on, trip, [token] + start_values, shape_invariants=invariants,
                    parallel_iterations=1, return_same_structure=True)
            except (ValueError, TypeError) as e:  # a value whose shape the body changes
                raise _KeepUnrolled(loops[node]) from e
            finally:
                looping[0] = False
            for (b, k), t in zip(carried, outs[1:], strict=True):
                define(env, ("v", b, k), t)
            if any(fetched):
                last_fetch[:] = [outs[0].op]

        def emit_block(block, env, last_fetch):
            for head in block:
                step = steps[head]
                if step.kind is NodeKind.LOOP:
                    emit_loop(step, env, last_fetch)
                    continue
                if step.kind is NodeKind.OP:
                    emit(step, env, last_fetch)
                elif head in symbolic:
                    emit_gradient(step, env, last_fetch)
                    continue
                for body_step in step.body:  # GRAD: the backward ops Python skips
                    emit(body_step, env, last_fetch)

        def branch(block, keys, env, fetched):
            """One case: its block, returning ``keys`` (placeholders where it has none)."""

            def fn():
                local = collections.ChainMap({}, env)
                last_fetch = []
                emit_block(block, local, last_fetch)
                fetched.append(bool(last_fetch))
                return [local[k] if k in local else _placeholder(*_spec(k, slots)) for k in keys]

            return fn

        env = {}  # emission key -> graph tensor (see _value_key)
        last_fetch = []  # the fetches every later dequeue waits for (Fig. 3.4)
        for (sc, channel, skip), keys in zip(planned, exports):
            if channel is None:
                emit_block(sc.cases[0].block, env, last_fetch)
                continue
            index = dequeue(channel, last_fetch)
            fetched = []
            branches = [branch(case.block, keys, env, fetched) for case in sc.cases]
            if skip is not None:
                branches.append(branch((), keys, env, fetched))
            graph = ops.get_default_graph()
            n_ops = len(graph.get_operations())
            with ops.control_dependencies(last_fetch):
                outs = control_flow_switch_case.switch_case(index, branches)
            for key, t in zip(keys, outs or ()):
                if key[0] == "v":  # only its producer's branch gives a value that is read
                    t.set_shape(key[1].out_relaxed[key[2]])
                env[key] = t
            if any(fetched):
                last_fetch[:] = [op for op in graph.get_operations()[n_ops:]
                                 if op.type in ("Case", "StatelessCase")]

    body.__name__ = graph_name
    function = def_function.function(body, autograph=False)
    try:
        function = function.get_concrete_function()
    except _NotSymbolic as e:
        if e.node.rolled:
            return generate(original, xla, exact, recorded, unrolled | {e.node.rolled}, fold)
        return generate(original, xla, exact, recorded | {e.node.id}, unrolled, fold)
    except _KeepUnrolled as e:
        return generate(original, xla, exact, recorded, unrolled | {e.key}, fold)
    fetched_shapes = {n for n, step in steps.items() if step.dynamic and n not in unseen}
    for node in _downstream(tracegraph, fetched_shapes):
        steps[node].check_shapes = True
    for node, step in steps.items():
        if step.kind is NodeKind.GRAD and node not in symbolic:
            shaped = any(p in steps and steps[p].check_shapes for _, p, _ in node.cone.values())
            step.backward_feeds = _backward_feeds(step, fetched_shapes, shaped)
    off = ["constant_folding"] if varying or fetched_shapes else []
    if xla:
        off += ["arithmetic_optimization", "remapping"]
    if exact:
        off = sorted(set(off) | _EXACT_OFF)
    return SymbolicGraph(start, steps, [(sc, c) for sc, c, _ in planned], function,
                         list(written.values()), rewriters_off=off, loops=list(loops))


def _downstream(tracegraph, sources):
    """Ops that read, directly or not, an output of ``sources``: a data-dependent shape
    reaches them, so the PythonRunner looks their output shapes up by input shapes (repeated
    until nothing changes, for the values a loop's body carries to its next trip)."""
    reached = set(sources)
    order = [n for n in tracegraph.topological() if n.kind is NodeKind.OP]
    while True:
        before = len(reached)
        for node in order:
            if node not in reached and any(p in reached for slot in node.inputs
                                           if slot.kind == "node" for p, _ in slot.alts):
                reached.add(node)
        if len(reached) == before:
            return reached - set(sources)


_ONEDNN = _pywrap_util_port.IsMklEnabled()

# Grappler's rewrites that change how a value is rounded, off for an exact graph: constant
# folding turns ``x / c`` into ``x * (1 / c)`` (a hard-swish's ``/ 6`` drifted MobileNetV3 off
# eager), the arithmetic optimizer regroups sums and products and rewrites ``log(1 + x)`` as
# ``log1p(x)``, and the remapper fuses patterns into oneDNN kernels (layer norm, GELU,
# batch norm + activation) that compute them in another order.
_EXACT_OFF = frozenset({"constant_folding", "arithmetic_optimization", "remapping"})


def _keep_eager_rounding(created):
    """Keep oneDNN's graph rewrite from merging what eager runs apart, in the ``created``
    graph ops.

    With oneDNN on (TF's CPU default), the layout pass that runs on every function graph
    merges a ``BiasAddGrad`` with the ``Conv2DBackpropFilter`` reading the same gradient into
    one kernel, which sums the bias gradient in another order than eager's ``BiasAddGrad``:
    a few ulps apart on strided convolutions, which momentum then grows (a Sonnet ConvNet
    ended 1e-4 off eager after 40 steps). The pass merges only when both read the same
    tensor, so the bias gradient reads a ``Snapshot`` of it (a copy Grappler keeps; an
    ``Identity`` it would remove)."""
    if not _ONEDNN:
        return
    for op in created:
        if op.type == "BiasAddGrad":
            op._update_input(0, gen_array_ops.snapshot(op.inputs[0]))


def _call_function(graph, node, inputs):
    """The call of library function ``node.op_type`` as eager made it: a
    ``StatefulPartitionedCall`` of a copy marked ``_noinline``, with eager's call config. TF
    then instantiates and optimizes the body on its own, as for the eager call, and its
    numbers are eager's to the bit; inlined into the exact graph, the body's ops would round
    as separate eager ops do, not as the function did (Grappler rewrites a ``tf.function``'s
    body: ``x / 6`` is ``x * (1/6)`` there, 358 of 1000 values differed in the last bit)."""
    attrs = dict(node.attrs)
    out_types = [dtype for _, dtype in node.out_specs]

    def types(values):
        return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=values))

    op = graph._create_op_internal(
        "StatefulPartitionedCall", inputs, dtypes=out_types, attrs={
            "Tin": types([t.dtype.as_datatype_enum for t in inputs]), "Tout": types(out_types),
            "f": attr_value_pb2.AttrValue(
                func=attr_value_pb2.NameAttrList(name=_noinline_copy(node.op_type))),
            "config_proto": attr_value_pb2.AttrValue(
                s=compat.as_bytes(attrs.get("config_proto") or b"")),
            "executor_type": attr_value_pb2.AttrValue(
                s=compat.as_bytes(attrs.get("executor_type") or b""))})
    for t, shape in zip(op.outputs, node.out_relaxed, strict=True):
        t.set_shape(shape)
    return op


@functools.cache
def _noinline_copy(name):
    """A copy of library function ``name`` that TF's inliners leave alone."""
    ctx = context.context()
    fdef = function_pb2.FunctionDef()
    fdef.CopyFrom(ctx.get_function_def(name))
    fdef.signature.name = copy = f"{name}_terra_call"
    fdef.attr["_noinline"].b = True
    ctx.add_function_def(fdef)
    return copy


def _draws_random(op):
    return any(word in op.type for word in ("Random", "TruncatedNormal", "Multinomial"))


def _compile_with_xla(op, scope):
    """Mark ``op`` for XLA in cluster scope ``scope``: what ``jit_scope`` does to the ops
    created under it (one scope per segment between fetches cannot be a ``with`` block here:
    a segment starts and ends in the middle of emitting a node)."""
    op._set_attr("_XlaCompile", attr_value_pb2.AttrValue(b=True))
    op._set_attr("_XlaScope", attr_value_pb2.AttrValue(s=scope))
    op._set_attr("_XlaSeparateCompiledGradients", attr_value_pb2.AttrValue(b=False))


def _value_shaped(node):
    """Whether ``node``'s output shapes follow the values of small integers fed from Python
    that took several values: its shape function, given only their shapes, leaves an output
    dimension unknown (a resize's size does; the labels of a loss do not)."""
    varying = [i for i, slot in enumerate(node.inputs)
               if _small_int_feed(slot) and slot.values_vary]
    if node.kind is not NodeKind.OP or not varying or not node.sigs:
        return False
    shapes = next(iter(node.sigs))
    inputs = [_scratch_input(node, i, shape) for i, shape in enumerate(shapes)]
    for i in varying:
        inputs[i] = ("shape", None, dtypes.as_dtype(node.inputs[i].dtype), shapes[i])
    try:
        outputs = opdefs.scratch_output_shapes(node.op_type, node.attrs, inputs)
    except (ValueError, TypeError, errors.OpError):
        return True
    return not all(shape.is_fully_defined() for shape in outputs)


def _shape_fn_decides(node):
    """Whether the op's shape function gives its output shapes from what the PythonRunner
    knows (input shapes, and the values of small inputs Python computes), as it infers them
    for shapes no trace had; not for ``NonMaxSuppression``, ``Where``, ``Unique``: their
    outputs are fetched wherever shapes vary."""
    if node.kind is not NodeKind.OP or not node.sigs:
        return True
    shapes = next(iter(node.sigs))
    try:
        outputs = opdefs.scratch_output_shapes(node.op_type, node.attrs, [
            _scratch_input(node, i, shape) for i, shape in enumerate(shapes)])
    except (ValueError, TypeError, errors.OpError):
        return True  # the runner's inference fails alike: a new shape falls back, as before
    return all(shape.is_fully_defined() for shape in outputs)


def _scratch_input(node, i, shape):
    """Input ``i`` of ``node`` for ``opdefs.scratch_output_shapes``, as the PythonRunner
    knows it."""
    slot = node.inputs[i]
    if slot.kind in ("const", "feed") and slot.value is not None:
        return ("value", slot.value, dtypes.as_dtype(slot.dtype), None)
    if slot.kind == "node":
        producer, out = slot.alts[0]
        dtype = producer.out_specs[out][1]
    elif slot.kind == "same":
        producer, k = slot.alts[0]
        dtype = producer.inputs[k].dtype
    elif slot.kind == "var":  # the variable's shape rides on its handle
        return ("handle", slot.tensor, None, None)
    else:
        dtype = dtypes.resource if slot.kind == "resource" else slot.dtype
    return ("shape", None, dtypes.as_dtype(dtype), shape)


def _placeholder(dtype, shape):
    """A value a branch returns for what it does not compute (never read)."""
    dt = dtypes.as_dtype(dtype)
    if dt in (dtypes.resource, dtypes.variant):
        raise NotImplementedError(f"a {dt.name} value leaves a branch of a switch-case")
    if shape is None:
        return array_ops.zeros((), dt)
    return array_ops.zeros([0 if d is None else d for d in shape], dt)
