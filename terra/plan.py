"""The co-execution plan: what generation hands the PythonRunner besides the function.

One :class:`Step` per TraceGraph node holds everything the runner's hot path needs
precomputed: the node's slots, its successors and the Case Select values each edge feeds,
the channels it feeds and fetches, static output values. :class:`SymbolicGraph` is the plan
with its ConcreteFunction. The passes here build the plan's skeleton from a TraceGraph
(:func:`plan_steps`, :func:`switch_case_channels`, :func:`link`); emission
(``terra.emitter``) fills in the channels and the function; ``terra.graph_builder`` runs them.
"""

import itertools

from tensorflow.core.framework import function_pb2, types_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context, execute
from tensorflow.python.framework import dtypes, errors, ops

from terra import opdefs, queues, regions
from terra.case_assignment import assign_cases
from terra.nodes import NodeKind, SlotKind, TraceNode, small_int_feed
from terra.queues import Channel

INT32 = dtypes.int32.as_datatype_enum


class Step:
    """What the PythonRunner does at one node of the TraceGraph. Written by generation only:
    the runner keeps its own state per step (``PythonRunner.seqs``, ``visits`` and its
    memos); under ``TERRA_CHECK`` the steps of a built graph refuse writes
    (:meth:`SymbolicGraph.freeze`)."""

    __slots__ = ("node", "kind", "op_type", "attrs", "slots", "feed", "out_specs",
                 "check_shapes", "value_shaped", "fetch", "has_fetch", "static", "local",
                 "dynamic", "known_shape", "python", "out_feed", "body", "results", "next", "puts",
                 "owner", "cone_phis", "backward_feeds", "looped", "any_path")

    def __init__(self, node: TraceNode | None):
        self.node = node
        self.next = []  # successor steps, None for the end of the iteration
        # per successor: the Case Select values taking that edge feeds, ((channel, index),
        # ...); None when no edge out of this step feeds any
        self.puts = None
        self.has_fetch = False
        # whose pass counts for it (``PythonRunner.seqs``): a gradient op's is its region's head
        self.owner = self
        self.looped = node is not None and node.loop is not None  # passed once per trip
        self.body = []  # GRAD: the steps of its region, which Python skips; LOOP: its body
        # GRAD: the joined inputs of its cone, ((slot, input index of the call or None,
        # producer), ...): the producer each must have taken this iteration
        self.cone_phis = ()
        # GRAD: (channels of its backward ops' feed inputs, {iteration signature: values})
        self.backward_feeds = None
        if node is None:  # the start of the iteration (named so in waits and messages)
            self.kind, self.op_type = NodeKind.START, "the iteration's start"
            return
        self.kind = node.kind
        self.op_type = node.op_type
        self.attrs = node.attrs
        self.slots = [settled(slot) for slot in node.inputs]
        self.feed = [None] * len(node.inputs)  # slot index -> Channel for feed slots
        self.out_specs = node.out_specs
        # the output shape follows a small integer fed from Python that took several values
        # (a resize's size), whatever the input shapes: it is inferred every time
        self.value_shaped = _value_shaped(node)
        self.check_shapes = len(node.sigs) > 1 or self.value_shaped
        n_out = len(node.out_specs)
        self.fetch = [None] * n_out  # out -> Channel (graph enqueues, Python dequeues)
        self.static = [None] * n_out  # out -> value known when the graph was built (a tensor)
        # the attrs Python runs the op with itself, on its own inputs, where it reads values
        # that only depend on shapes it holds (terra.folding): no fetch
        self.local = None
        self.dynamic = False  # output shapes depend on data: fetch instead of a stand-in
        # out -> whether its shape is the recorded one whatever the op's input shapes (a
        # variable's gradient): stood in for, never fetched for its shape
        self.known_shape = [False] * n_out
        self.python = node.kind == NodeKind.OP and not node.in_graph
        self.out_feed = [None] * n_out  # python op outputs the graph consumes
        self.results = node.results
        # GRAD: one region for every forward path (terra.regions), whose gradient is None
        # where eager's is: the PythonRunner checks each iteration reaches its sources
        self.any_path = node.kind is NodeKind.GRAD and regions.folded(node) and \
            node.attrs[4].endswith("NONE")

    def __repr__(self):
        return "<start>" if self.node is None else f"<step {self.node!r} {self.op_type}>"


def where(step):
    """The user's line that issued ``step``'s op, for messages."""
    loc = step.node.location if step.node is not None else None
    return f"{loc.file}:{loc.line}" if loc else "unknown location"


class FrozenStep(Step):
    """A :class:`Step` of a built graph under ``TERRA_CHECK``: a write is a bug."""

    __slots__ = ()

    def __setattr__(self, name, value):
        raise AttributeError(f"the plan is read-only once built: {self!r}.{name} was written")


class SymbolicGraph:
    """The generated function, its channels, and the PythonRunner's plan for it."""

    def __init__(self, start, steps, switch_cases, function, written, rewriters_off=(),
                 loops=(), commit=(None, None, frozenset(), frozenset()), fn_name=None,
                 xla_segments=()):
        self.start = start  # Step before the first op; ``start.next`` are the first steps
        self.steps = steps  # {TraceNode: Step}
        self.loops = loops  # the loop nodes (terra.loops), each a While
        self.switch_cases = switch_cases  # [(SwitchCase, Case Select channel or None)]
        self.function = function
        # the commit gate (terra.commit): its channel (None: every job snapshots first),
        # the channel saying every op before it ran, the ids of the fetch channels the
        # graph fills only after it, and the handles of the variables written before it
        self.commit, self.ready, self.late, early = commit
        # [(handle, dtype)] variables the graph writes, those written before the gate first
        written = [w for w in written if w[0]._id in early] + \
            [w for w in written if w[0]._id not in early]
        self.written = written
        self.n_early = sum(w[0]._id in early for w in written)
        # what the runner calls: the traced function, or its copy with compiled segments
        self.fn_name = fn_name or function._inference_function.name.decode()
        self.xla_segments = xla_segments  # its compiled functions (terra.precompile)
        self.captures = list(function.captured_inputs)
        attrs = context.context().function_call_options.as_attrs()
        if rewriters_off:
            attrs["config_proto"] = _with_rewriters_off(attrs["config_proto"], rewriters_off)
        self.call_attrs = tuple(itertools.chain(*attrs.items()))
        self.snapshot_fn = _snapshot_function(written)
        # what the GraphRunner reads before every job, and Python at the commit point
        self.early_fn = _snapshot_function(written[:self.n_early])
        self.gated_fn = _snapshot_function(written[self.n_early:])

    @property
    def gated(self):
        """The variables a snapshot taken at the commit point holds (all, without a gate)."""
        return self.written[self.n_early:]

    def freeze(self):
        """From here on a step refuses writes (the plan is a contract the runner only reads):
        used under ``TERRA_CHECK``, at no cost otherwise."""
        for step in self.steps.values():
            step.__class__ = FrozenStep

    def channels(self):
        """Every channel of the graph, as ``(reads, writes)``: those the graph dequeues from
        (Python's feeds, Case Selects, Loop Conds, the commit token) and those it fills
        (fetches, the commit gate's ready signal)."""
        reads = {id(c): c for _, c in self.switch_cases if c is not None}
        writes = {}
        if self.commit is not None:
            reads[id(self.commit)] = self.commit
            writes[id(self.ready)] = self.ready
        for step in self.steps.values():  # region and loop bodies among them
            found = [*step.feed, *step.out_feed]
            if step.backward_feeds:
                found += step.backward_feeds[0]
            for puts in step.puts or ():
                found += [c for c, _ in puts]
            reads.update((id(c), c) for c in found if c is not None)
            writes.update((id(c), c) for c in step.fetch if c is not None)
        return list(reads.values()), list(writes.values())

    def close_inputs(self):
        """Stop a job of this graph without cancelling it: close every channel it reads, so
        it ends with ``OutOfRange`` at the first value Python has not fed, which TF does
        not log (``terra.queues``). The values already fed still reach it. Call once Python
        feeds no more in this iteration; :meth:`rewind` opens them again."""
        queues.settle()  # a put still pending would fail on its closed queue
        queues.close_all(self.channels()[0])

    def rewind(self):
        """Make the graph ready for a new iteration after one was abandoned mid-way (a
        stopped job): its channels emptied and counted from zero (the runner resets its own
        visits), those closed to stop the job or end a wait opened again. A completed
        iteration leaves them so by itself (``PythonRunner.finish``)."""
        queues.settle()
        reads, writes = self.channels()
        for channel in reads + writes:
            if channel.closed:
                channel.reopen()
            else:
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

    The rewrites that round otherwise (``graph_ops.EXACT_OFF``), for an exact graph."""
    config = config_pb2.ConfigProto()
    config.ParseFromString(serialized)
    for name in names:
        setattr(config.graph_options.rewrite_options, name,
                rewriter_config_pb2.RewriterConfig.OFF)
    return config.SerializeToString()


_snapshots = {}  # handles -> function: the last graph's
_snapshot_names = itertools.count()


class Snapshot:
    """A function reading variables, called by name with their handles as arguments:
    ``snapshot()`` is the list of their values. Its FunctionDef is written here, a node a
    variable: a ``tf.function`` of the same reads costs a graph op, a captured placeholder
    and automatic control dependencies per variable, over a second of a generation for a
    few hundred variables, for a function that only reads."""

    def __init__(self, written):
        self.handles = [h for h, _ in written]
        fdef = function_pb2.FunctionDef()
        self.name = fdef.signature.name = f"terra_snapshot_{next(_snapshot_names)}"
        fdef.signature.is_stateful = True
        for i, (_, dtype) in enumerate(written):
            fdef.signature.input_arg.add(name=f"h{i}", type=types_pb2.DT_RESOURCE)
            enum = dtypes.as_dtype(dtype).as_datatype_enum
            fdef.signature.output_arg.add(name=f"v{i}", type=enum)
            read = fdef.node_def.add(name=f"r{i}", op="ReadVariableOp", input=[f"h{i}"])
            read.attr["dtype"].type = enum
            fdef.ret[f"v{i}"] = f"r{i}:value:0"
        context.context().add_function_def(fdef)

    def __call__(self):
        return list(execute.execute(self.name, len(self.handles), self.handles, (),
                                    context.context()))

    def __del__(self):
        try:  # the function is this object's: TF's own functions are removed the same way
            context.context().remove_function(self.name)
        except Exception:  # noqa: BLE001, S110 - at interpreter exit the context may be gone
            pass


def _snapshot_function(written):
    """The function reading the variables ``written`` (what a fallback restores). A graph
    built again for the same program writes the same variables: the last graph's functions
    are reused (handles keyed by ``_id``, which TF never gives twice); only the last few
    are kept, so no program's variables outlive them here for long."""
    if not written:
        return None
    key = tuple((h._id, dt) for h, dt in written)
    if key in _snapshots:
        return _snapshots[key]
    fn = Snapshot(written)
    if len(_snapshots) >= 3:  # a graph's three: all, before the gate, after it
        _snapshots.pop(next(iter(_snapshots)))
    _snapshots[key] = fn
    return fn


def plan_steps(tracegraph):
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
                and settled(slot) is slot)
    return start, steps


def unit_exit(node):
    """The node whose edges leave ``node``'s unit: the last op of a gradient region or of a
    loop's body."""
    for _ in range(node.body_len if node.kind in (NodeKind.GRAD, NodeKind.LOOP) else 0):
        node = node.succs[0]
    return node


def switch_case_channels(tracegraph):
    """Algorithm 1 over the units of the TraceGraph (a loop node and its body are one), and
    a Case Select channel for every switch-case the graph must branch at. Returns
    ``[(SwitchCase, channel or None, skip index or None)]`` and what taking each edge
    between units feeds: ``{(unit head, successor): [(channel, index)]}``."""
    switch_cases = assign_cases(tracegraph.start, tracegraph.end, lambda n: unit_exit(n).succs)
    puts = {}
    planned = []
    ended = []  # exits seen so far: a path may have ended before the switch-cases after them
    for sc in switch_cases:
        channel = skip = None
        if sc.is_switch or ended:
            with ops.init_scope():
                channel = Channel(INT32, ())
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


def link(tracegraph, start, steps, puts, conds):
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
        for s in unit_exit(node).succs:
            found += arrivals(s, puts_so_far + [stop] + puts.get((node, s), []))
        return found

    for node, step in [(tracegraph.start, start), *steps.items()]:
        if node.in_body or node.kind is NodeKind.LOOP:
            continue
        loop = node.loop
        if loop is not None and node is unit_exit(loop):  # round again, or out of the loop
            found = [(steps[loop.succs[0]], [(conds[loop], 1)])]
            for s in node.succs:
                found += arrivals(s, [(conds[loop], 0)] + puts.get((loop, s), []))
        elif loop is not None:
            found = [(steps[node.succs[0]], [])]
        else:
            found = [a for s in unit_exit(node).succs
                     for a in arrivals(s, list(puts.get((node, s), ())))]
        step.next = [target for target, _ in found]
        if any(p for _, p in found):
            step.puts = [tuple(p) for _, p in found]


def settled(slot):
    """A ``same`` input (an external value an earlier op of the iteration read first) whose
    first readers all read one captured tensor, or one constant: that capture or constant
    itself. Which op reads such a value first depends on the path (a mask read on both sides
    of two random choices); as a ``same`` input, a combination of branches no trace took
    would find its first reader had not run, and fall back."""
    if slot.kind is not SlotKind.SAME:
        return slot
    firsts = [node.inputs[k] for node, k in slot.alts]
    one_capture = all(f.kind is SlotKind.CAPTURE for f in firsts) and \
        len({f.tensor._id for f in firsts}) == 1
    one_const = all(f.kind is SlotKind.CONST for f in firsts) and \
        len({(f.value.shape, f.value_bytes) for f in firsts}) == 1
    if one_capture or one_const:
        return firsts[0]
    return slot


def _value_shaped(node):
    """Whether ``node``'s output shapes follow the values of small integers fed from Python
    that took several values: its shape function, given only their shapes, leaves an output
    dimension unknown (a resize's size does; the labels of a loss do not)."""
    varying = [i for i, slot in enumerate(node.inputs)
               if small_int_feed(slot) and slot.values_vary]
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


def shape_fn_decides(node):
    """Whether the op's shape function gives its output shapes from what the PythonRunner
    knows (input shapes, and the values of small inputs Python computes), as it infers them
    for shapes no trace had; not for ``NonMaxSuppression``, ``Where``, ``Unique``: their
    outputs are fetched wherever shapes vary."""
    if node.kind is not NodeKind.OP or not node.sigs or node.op_type in opdefs.SAME_SHAPE or \
            node.op_type in opdefs.BROADCAST:  # elementwise: the inputs' shapes or broadcast
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
    if slot.kind in (SlotKind.CONST, SlotKind.FEED) and slot.value is not None:
        return ("value", slot.value, dtypes.as_dtype(slot.dtype), None)
    if slot.kind is SlotKind.NODE:
        producer, out = slot.alts[0]
        dtype = producer.out_specs[out][1]
    elif slot.kind is SlotKind.SAME:
        producer, k = slot.alts[0]
        dtype = producer.inputs[k].dtype
    elif slot.kind is SlotKind.VAR:  # the variable's shape rides on its handle
        return ("handle", slot.tensor, None, None)
    else:
        dtype = dtypes.resource if slot.kind is SlotKind.RESOURCE else slot.dtype
    return ("shape", None, dtypes.as_dtype(dtype), shape)
