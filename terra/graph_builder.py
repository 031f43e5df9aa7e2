"""GraphGenerator: one symbolic graph from the whole TraceGraph (paper §3.2.2).

Generation is a sequence of named passes, each a function of what the ones before it made,
run by :func:`generate`:

1. ``roll_loops`` (``terra.loops.roll``): a Python loop's trips taken several trip counts
   become one loop node, emitted as a ``tf.while_loop``;
2. ``fold_regions`` (``terra.regions.fold``): a gradient call that kept missing its regions
   gets one region for every forward path;
3. ``plan_steps`` (``terra.plan``): one :class:`~terra.plan.Step` per node, the
   PythonRunner's instructions; :func:`mark_varying_shapes` flags the steps whose input
   shapes vary;
4. ``assign_cases`` (``terra.case_assignment``, Algorithm 1, in
   ``plan.switch_case_channels``) and ``link``: the switch-cases, the Case Select channels
   and what each edge Python takes feeds them. A switch-case with several cases becomes a
   ``tf.switch_case``; one with a single case is emitted inline. Once some path can have
   ended, every later switch-case gets one more, empty, case that a finished path selects;
5. :func:`gradient_regions`: which regions are emitted as TF's symbolic gradient rather
   than their recorded backward ops;
6. :func:`feeds_and_fetches`: the Input Feeding channels and the values Python needs;
7. ``emit`` (``terra.emitter.Emitter``): the ConcreteFunction, and the fetch channels;
8. :func:`finish_plan`: shape lookups downstream of fetched shapes, the backward feeds of
   recorded regions, Grappler's passes to turn off;
9. with ``xla``, ``compile_segments`` (``terra.xla``): each segment's compute ops become one
   XLA-compiled function the graph calls.

A pass that finds the plan cannot be emitted as it stands (TF's symbolic gradient of a region
does not stand for its tape's; a loop's While cannot be built) raises, and the driver runs the
passes again with that region recorded or that loop unrolled.

With ``xla``, emission marks the compute ops of each segment between fetches, and
``compile_segments`` moves each segment's marked ops into one function with
``_XlaMustCompile`` (``tf.function(jit_compile=True)``'s attribute), which the graph calls:
independent ops of a segment (every variable's optimizer update) compile together, where TF's
auto-clustering made one cluster per connected group, each with a launch cost. A segment
ends at every fetch, so Python does not wait for a whole step to read one value (the paper
saw XLA delay Output Fetching on YOLOv3). Queues, ``tf.switch_case`` and Python-run values
stay TF ops; so do random ops (XLA draws other numbers than TF's kernels for the same seed,
and Terra must compute what eager computes) and ops whose shapes vary between iterations or
differed between traces (XLA compiles once per shape: recompiling made GPT2 and SDPoint 3-5x
slower than without XLA). XLA compiles each function at the graph's first call.
"""

import itertools

from tensorflow.python.eager import def_function
from tensorflow.python.framework import constant_op, ops

from terra import commit, path, regions
from terra.config import config
from terra.emitter import Emitter
from terra.graph_ops import EXACT_OFF
from terra.keys import exports_of, producer_key
from terra.loop_emission import KeepUnrolled
from terra.loops import roll
from terra.nodes import NodeKind, SlotKind
from terra.plan import (
    INT32,
    SymbolicGraph,
    link,
    plan_steps,
    switch_case_channels,
)
from terra.precompile import argument_spec
from terra.queues import Channel
from terra.region_emission import NotSymbolic
from terra.xla import compile_segments

_names = itertools.count()


def generate(tracegraph, xla=False, exact=True, fold=frozenset()) -> SymbolicGraph:
    """Build the symbolic graph for every path of the TraceGraph (its compute ops compiled
    with XLA if ``xla``), its loops rolled into While ops (``terra.loops``). ``exact``: every
    op rounds as its eager kernel does (``graph_ops.EXACT_OFF``, ``keep_eager_rounding``).
    ``fold``: gradient calls (by key) whose regions become one (``terra.regions``)."""
    recorded, unrolled = set(), set()  # regions kept recorded (by node id), loops unrolled
    while True:
        try:
            return _passes(tracegraph, xla, exact, fold, frozenset(recorded),
                           frozenset(unrolled))
        except NotSymbolic as e:
            retry = (unrolled, e.node.rolled) if e.node.rolled else (recorded, e.node.id)
        except KeepUnrolled as e:
            retry = (unrolled, e.key)
        done, key = retry
        if key in done:  # the same failure again: nothing left to try
            raise RuntimeError(f"graph generation keeps failing at {key}")
        done.add(key)


def _passes(tracegraph, xla, exact, fold, recorded, unrolled):
    """One run of the passes: ``recorded`` regions keep their recorded backward ops (their
    symbolic gradient failed), ``unrolled`` loops (by their first trip's nodes) stay
    unrolled (their While failed)."""
    tracegraph, loops = roll(tracegraph, keep=unrolled)
    _check(tracegraph)
    tracegraph = regions.fold(tracegraph, fold, keep=unrolled)
    _check(tracegraph)
    start, steps = plan_steps(tracegraph)
    varying = mark_varying_shapes(tracegraph, steps)
    planned, puts = switch_case_channels(tracegraph)
    with ops.init_scope():
        conds = {loop: Channel(INT32, ()) for loop in loops}  # Loop Cond: 1 go on, 0 stop
    link(tracegraph, start, steps, puts, conds)
    symbolic = gradient_regions(steps, planned, recorded, varying)
    wanted, phi_of, slots, unseen = feeds_and_fetches(steps, symbolic)
    name = f"terra_step_{next(_names)}"
    emitter = Emitter(name, steps, planned, exports_of(planned, steps), loops, conds,
                      symbolic, wanted, unseen, phi_of, slots, xla, exact)

    gated = []

    def body():
        emitter()
        if emitter.first_write is not None and config.commit:
            gated[:] = commit.gate(ops.get_default_graph(), emitter.first_write,
                                   emitter.enqueued)

    body.__name__ = name
    function = def_function.function(body, autograph=False).get_concrete_function()
    off = finish_plan(tracegraph, steps, symbolic, unseen, varying, exact)
    fn_name, segments = compile_segments(function, argument_spec(function)) if xla else \
        (None, ())
    graph = SymbolicGraph(start, steps, [(sc, c) for sc, c, _ in planned], function,
                          list(emitter.written.values()), rewriters_off=off, loops=list(loops),
                          commit=gated or commit.NO_GATE, fn_name=fn_name,
                          xla_segments=segments)
    if config.check:
        graph.freeze()
    return graph


def _check(tracegraph):
    """``TraceGraph.lint()`` after each pass that transforms the TraceGraph
    (``TERRA_CHECK``, on in the tests)."""
    if config.check:
        tracegraph.lint()


def mark_varying_shapes(tracegraph, steps):
    """Flag the steps whose input shapes may differ from every recorded signature
    (``check_shapes``); returns their nodes."""
    varying = _shapes_vary(tracegraph)
    for node in varying:
        steps[node].check_shapes = True
    return varying


def gradient_regions(steps, planned, recorded, varying):
    """The gradient heads emitted as TF's symbolic gradient (see ``_symbolic``; ``varying``:
    the nodes whose input shapes may be new). A region merged over a loop's trip counts that
    cannot be symbolic keeps its loop unrolled."""
    in_branch = {node for sc, channel, _ in planned if channel is not None
                 for case in sc.cases for head in case.block
                 for node in [head] + [b.node for b in steps[head].body]}
    symbolic = set()
    needed = _bodies_read_outside(steps)
    for node, step in steps.items():
        if node.id not in recorded and node not in needed and \
                _symbolic(step, in_branch, varying):
            symbolic.add(node)
        elif step.kind is NodeKind.GRAD and node.rolled:
            raise KeepUnrolled(node.rolled)
    return symbolic


def feeds_and_fetches(steps, symbolic):
    """The Input Feeding channels of the plan's steps, and what emission needs to place the
    Output Fetching points: ``(wanted, phi_of, slots, unseen)``, the values Python needs
    besides those it reads (read by a Python-run op; a gradient result whose shape varies),
    the phi slots each value updates, those slots by id, and the backward ops Python never
    sees."""
    # (node, out) -> "value" (read by a Python-run op, or returned by a region with a shape
    # that depends on data), "shape" (its shape is needed) or "fixed" (its shape is known,
    # whatever its producer's shapes)
    wanted = {}
    graph_consumed = set()  # (node, out) of Python-run ops read by graph ops
    phi_of = {}  # emission key (Out or Read) -> the phi slots it updates
    slots = {}  # id -> slot, for phi keys
    for step in steps.values():
        for slot in step.slots:
            if slot.kind in (SlotKind.NODE, SlotKind.SAME) and len(slot.alts) > 1:
                slots[id(slot)] = slot
                for p, k in slot.alts:
                    phi_of.setdefault(producer_key(slot.kind, p, k), []).append(id(slot))
        if step.kind is NodeKind.GRAD:
            _result_shapes(step, wanted)
        elif step.kind is NodeKind.MARK and step.op_type == "call":
            for returned in path.data_shaped_returns(step):  # a region Python may skip
                wanted[returned] = "value"
        for _, (p, k) in _alts_of(step):
            if step.python and p.in_graph:
                wanted[(p, k)] = "value"
            elif not step.python and step.kind == NodeKind.OP and not p.in_graph:
                graph_consumed.add((p, k))
    with ops.init_scope():
        for step in steps.values():
            node = step.node
            if step.owner.node in symbolic:
                continue  # its backward ops are not emitted
            for i, slot in enumerate(step.slots):
                if slot.kind is SlotKind.FEED and step.kind == NodeKind.OP and not step.python:
                    step.feed[i] = Channel(slot.dtype, slot.shape)
            for k, (_, dtype) in enumerate(step.out_specs):
                if step.python and (node, k) in graph_consumed:
                    step.out_feed[k] = Channel(dtype, node.out_relaxed[k])
    return wanted, phi_of, slots, _unseen_by_python(steps)


def _result_shapes(step, wanted):
    """What Python needs of the results of gradient call ``step`` to stand in for them: a
    result whose shape varies is fetched for its shape; but a dense gradient of a variable
    has the variable's shape, however its backward op's shape varies or depends on data (a
    ``Reshape`` back to the kernel's shape): such a result is never fetched for its shape."""
    n_target = step.attrs[1]
    for i, r in enumerate(step.results):
        if r is None:
            continue
        source = step.slots[n_target + i]
        if r[0] == "t" and r[1] is not None and source.kind is SlotKind.VAR and \
                r[1][0].out_specs[r[1][1]][0] == _variable_shape(source.tensor):
            wanted.setdefault(r[1], "fixed")
            continue
        for part in r[1:]:
            if part is not None and len(part[0].sigs) > 1:
                wanted.setdefault(part, "shape")


def _variable_shape(handle):
    """The shape of the variable behind eager ``handle`` (its handle data), or None."""
    data = getattr(handle, "_handle_data", None)
    if data is None or not data.shape_and_type or data.shape_and_type[0].shape.unknown_rank:
        return None
    return tuple(d.size for d in data.shape_and_type[0].shape.dim)


def finish_plan(tracegraph, steps, symbolic, unseen, varying, exact):
    """After emission: the steps downstream of fetched data-dependent shapes look their
    shapes up, recorded regions get their backward feeds; returns Grappler's rewriters to
    turn off for the function's calls."""
    fetched_shapes = {n for n, step in steps.items() if step.dynamic and n not in unseen}
    for node in _downstream(tracegraph, fetched_shapes):
        steps[node].check_shapes = True
    for node, step in steps.items():
        if step.kind is NodeKind.GRAD and node not in symbolic:
            shaped = any(p in steps and steps[p].check_shapes for _, p, _ in node.cone.values())
            step.backward_feeds = _backward_feeds(step, fetched_shapes, shaped)
    off = ["constant_folding"] if varying or fetched_shapes else []
    if exact:
        off = sorted(set(off) | EXACT_OFF)
    return off


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
             for i, slot in enumerate(body_step.slots) if slot.kind is SlotKind.FEED]
    if not feeds and not shaped:
        return None
    table = {}
    for before, body in step.node.observations:
        sig = tuple(part for n, k, part in before if (n in fetched_shapes if k is None else
                    n.inputs[k].kind is SlotKind.FEED and n.kind is NodeKind.OP and n.in_graph and
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


def _symbolic(step, in_branch, varying):
    """Whether a gradient region is emitted as TF's symbolic gradient of the graph's forward
    ops rather than as its recorded backward ops.

    The recorded ops read values that gradient functions computed in Python from shapes
    (``Tile`` multiples, the count a mean divides by, a ``Reshape`` target). Where those vary,
    ``_backward_feeds`` can only feed the values of signatures a trace had; a shape that keeps
    changing (a boolean mask's row count) would fall back at every new value. The symbolic
    gradient runs the same gradient functions in graph mode, which compute those values from
    the shapes at run time. So it is taken too where the forward pass may take shapes no
    trace had (an op of its cone is ``varying``), though the traces' values were equal (two
    image sizes of one area: a mean's count). It differentiates the graph rather than the
    tape, so it is taken only where both agree (``TraceNode.taped``: the tape recorded every
    forward op between the sources and the target) and the region and its forward ops are
    emitted outside any ``tf.switch_case`` (``in_branch``: a gradient through a switch-case's
    outputs would rewrite its branches, and inside a branch the sources would have to be
    mapped to the branch's captures, which is not built); and where Python feeds nothing the
    region reads (its inputs are validated, never fed). A region merged from the regions of
    every trip count through a loop (``rolled``) has no recorded ops for trip counts no trace
    took: it is symbolic, or its loop stays unrolled."""
    node = step.node
    if step.kind is not NodeKind.GRAD or not node.taped:
        return False
    if not node.rolled and not any(
            slot.kind is SlotKind.FEED for body_step in step.body for slot in body_step.slots) \
            and not any(producer in varying for _, producer, _ in node.cone.values()):
        return False
    if any(slot.kind is SlotKind.FEED for slot in step.slots):
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
            if slot.kind not in (SlotKind.NODE, SlotKind.SAME):
                continue
            for p, out in slot.alts:
                region = steps[p].owner if p in steps else None
                if region is None or region is steps[p] or region is owner:
                    continue
                results = {q for r in region.node.results or () if r for q in r[1:]}
                if slot.kind is SlotKind.SAME or (p, out) not in results:
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
                if slot.kind is SlotKind.FEED and not exact(slot.shape) or \
                        slot.kind is SlotKind.SAME and any(
                            not exact(p.inputs[k].shape) for p, k in slot.alts):
                    varies.add(node)
                elif slot.kind is SlotKind.NODE and (
                        any(p in varies or not p.in_graph and not exact(p.out_relaxed[k])
                            for p, k in slot.alts) or
                        len({tuple(p.out_relaxed[k] or ()) for p, k in slot.alts}) > 1):
                    varies.add(node)
        if len(varies) == before:
            return varies


def _alts_of(step):
    """Every producer (node, out) that a graph input of ``step`` may read."""
    return [(slot, p) for slot in step.slots if slot.kind is SlotKind.NODE for p in slot.alts]


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
                                           if slot.kind is SlotKind.NODE for p, _ in slot.alts):
                reached.add(node)
        if len(reached) == before:
            return reached - set(sources)
