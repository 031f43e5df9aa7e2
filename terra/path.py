"""Following the plan's path where it branches: which successor of a branch point an op
takes (section 3.11), whether a loop's trip count is why an iteration left the path, which
library regions the runner may skip whole (section 3.15), and whether the rest of a path has
no effects, so an iteration may end before it (section 4).

The PythonRunner follows a path of single successors itself; these are the rarer choices,
pure functions of the successors, the op being matched, the iteration's log of matched
steps and the executed location (``terra.location.Sites``) of the op being issued.
"""

from terra import folding, opdefs
from terra.divergence import OffPath, PathEnded
from terra.nodes import NodeKind, SlotKind
from terra.plan import shape_fn_decides


def branch(successors, kind, op_type, fits, twin, sites, log):
    """The successor (index, step) an event of ``kind`` and ``op_type`` takes at a branch
    point: of the candidates of its kind and type, the ones it fits (``fits(step)``), then
    the one recorded at its executed location. ``twin``: another op type the step may have
    (a ``tf.function``'s forward call, for its inference call), if the graph runs it."""
    found = [(i, s) for i, s in enumerate(successors)
             if s is not None and s.kind is kind and (
                 s.op_type == op_type or s.op_type == twin and not s.python)]
    if len(found) > 1:
        found = [(i, s) for i, s in found if fits(s)] or found[:1]
    if len(found) > 1:
        found = _by_site(found, sites, log)
    if not found:
        if None in successors:
            raise PathEnded(f"{op_type} after the end of a recorded iteration")
        raise OffPath(f"new branch: {op_type} where the recorded iterations had "
                         + ", ".join(sorted({s.op_type for s in successors if s is not None})))
    return found[0]


def _by_site(found, sites, log):
    """Successors that fit alike (one helper called from two lines): the one recorded
    at the executed location of the op being issued, if any."""
    sid = sites.stack()
    n = _issued_from(log, sid)
    return [f for f in found if f[1].node.site == (sid, n) or
            f[1].looped and f[1].node.site[0] == sid] or found[:1]


def _issued_from(log, sid):
    """How many steps of the iteration's ``log`` were matched at call stack ``sid``: the
    occurrence of the next one there (``terra.location.Sites``)."""
    return sum(1 for logged in log if logged.step.node.site[0] == sid)


def loop_trips_differ(steps, cur, log, sid):
    """Why the iteration leaves the path at ``cur``, if a loop is the cause: the op being
    issued from call stack ``sid`` repeats it more often than any trace did (more trips), or
    the recorded path goes on with another trip where this iteration issued something else
    or ended (``sid`` None: nothing is being issued; fewer trips). None otherwise. ``steps``:
    the plan's steps. A loop rolled into a While runs any number of trips from its peeled
    ones on."""
    n = _issued_from(log, sid)
    here = [s for s in steps if s.node.site is not None and s.node.site[0] == sid]
    seen = {s.node.site[1] for s in here}
    if n and seen and n not in seen and not any(s.looped for s in here):
        return f"a loop ran {n + 1} trips, more than any trace"
    if (n in seen or sid is None) and any(
            s is not None and not s.looped and s.node.site[1] > 0 and s.node.site[0] != sid
            for s in cur.next):
        return "a loop ran fewer trips than the traces that went on here"
    return None


def skippable(call):
    """The steps from a library call's ``call`` mark to its ``return`` mark, if Python may
    skip them all (``terra.library_regions``): one path (no branch point, no loop), graph ops
    only (nothing run in Python, nothing fetched but for shapes: Python never looks at a value,
    so it cannot branch on one), every input one the graph has (nothing fed here); output
    shapes that vary with the input or the data are the graph's business, Python takes no
    stand-in. None otherwise."""
    found = None if call.looped else _to_return(call, lambda s: (
        s.has_fetch and not _shape_only(s) or any(not _settled(slot) for slot in s.slots)))
    return None if found is None else found[0] + [found[1]]


def skippable_layer(call):
    """The steps from a layer call's ``call`` mark to its ``return`` mark, if Python may skip
    them all and take stand-ins for what the call returned (``terra.layer_regions``,
    ``terra.function_regions``): as for :func:`skippable`, but the region's ops may read the
    call's tensor arguments, which Python feeds (``feeds``: (op index, input, argument) from
    the call mark's attrs), and other values Python feeds (the sizes Keras computes from
    static shapes: fed as a call with the same input shapes fed them,
    ``skips.Skip.learned``); the graph may fetch what the call returned (Python reads it
    after the call) and, for their shapes alone, the outputs of ops whose shapes depend on
    data, but nothing else. What it returned of such shapes (:func:`data_shaped_returns`)
    must be fetched: Python takes its value; the other stand-ins' shapes are the recorded
    ones, or those a call with the same input shapes returned (``skips.Skip.fixed``). None
    otherwise."""
    template, feeds = call.attrs[-2:]
    if call.looped or template is None:
        return None
    found = _to_return(call, lambda s: False)
    if found is None:
        return None
    steps, s = found
    region = {step.node for step in steps}
    returned = {returned_by(slot, region) for slot in s.slots}
    if None in returned:
        return None
    for step in steps:
        if any(channel is not None and (step.node, k) not in returned and
               not _shape_only(step) for k, channel in enumerate(step.fetch)):
            return None
        if any(slot.kind is SlotKind.RESOURCE for slot in step.slots):
            return None
    step_of = {step.node: step for step in steps}
    tainted = data_tainted(call, steps)
    # a local step's value is Python's to compute (``folding``): only the per-op path does
    if any(step_of[node].local is not None or node in tainted and step_of[node].fetch[k] is None
           for node, k in returned):
        return None
    return steps + [s]


def data_shaped_returns(call):
    """The outputs ``(node, out)`` a layer or function call's region returned (its ``call``
    mark: six attrs, the template and feeds last) whose shapes depend on data within it: of
    an op whose shape function cannot give them (a ``Where``) or seen to vary with equal
    input shapes, or read from such an op inside the region (a ``tf.boolean_mask``'s
    ``Gather``). The graph fetches them (``graph_builder.feeds_and_fetches``; after emission
    the steps it found dynamic count too: a skip then needs their fetch as well)."""
    if len(call.attrs) != 6 or call.attrs[-2] is None or call.looped:
        return []
    found = _to_return(call, lambda s: False)
    if found is None:
        return []
    steps, end = found
    tainted = data_tainted(call, steps)
    region = {step.node for step in steps}
    return [r for r in (returned_by(slot, region) for slot in end.slots)
            if r is not None and r[0] in tainted]


_ARGUMENT = ("argument",)  # the producers data_tainted gives an argument read


def argument_reads(call):
    """The (op index, input) pairs of a layer or function call's region that read one of
    the call's tensor arguments (its ``call`` mark: six attrs, the argument reads last;
    ``region_values.argument_reads``); none for a library call's."""
    return {(j, k) for j, k, _ in call.attrs[-1]} if len(call.attrs) == 6 else set()


def data_tainted(call, steps):
    """The nodes of the region's ``steps`` (after ``call``, its mark) whose output shapes
    depend on data: see :func:`data_shaped_returns`. An op whose shape function leaves a
    dimension unknown taints unless what it lacks is the value of integer inputs that are
    constants, values Python feeds, or shape arithmetic inside the region (a ``Tile``'s
    multiples computed from shapes, as Keras' upsampling does): a ``Where`` always taints,
    a ``Range`` to a count read from data does, and so does a value read from one of the
    call's tensor arguments that the traces saw vary (``x[:, :k]`` with ``k`` a tensor: its
    value is data; one value in every trace is a constant the skip checks)."""
    reads = argument_reads(call)
    tainted, arithmetic = set(), set()
    for j, step in enumerate(steps):
        node = step.node
        # per input: its producers, None for another external value; an argument read is
        # produced by the caller's data (_ARGUMENT: never arithmetic, never tainted itself)
        inputs = [_ARGUMENT if (j, k) in reads and slot.kind is SlotKind.FEED else
                  [p for p, _ in slot.alts] if slot.kind in (SlotKind.NODE, SlotKind.SAME)
                  else None for k, slot in enumerate(step.slots)]
        if step.dynamic or node.data_dependent or \
                any(p in tainted for ps in inputs if ps for p in ps):
            tainted.add(node)
            continue
        if node.op_type in folding.SHAPE_OF or node.op_type in folding.FOLDABLE and all(
                ps is None or all(p in arithmetic for p in ps) for ps in inputs):
            arithmetic.add(node)  # integers from shapes and constants: no data in them
        if not shape_fn_decides(node) and not (
                node.op_type in folding.VALUE_SHAPED and
                all(inputs[i] is None or all(p in arithmetic for p in inputs[i])
                    for i in folding.VALUE_SHAPED[node.op_type] if i < len(inputs))):
            tainted.add(node)
    return tainted


def _to_return(call, refused):
    """``(ops, return mark)``: the single path of graph ops from the ``call`` mark to its
    ``return`` mark, none run in Python, in a loop or ``refused(step)``; None if there is no
    such path."""
    steps, s = [], call
    while True:
        if len(s.next) != 1 or s.next[0] is None:
            return None
        s = s.next[0]
        if s.kind is NodeKind.MARK:
            return (steps, s) if s.op_type == "return" else None
        if s.kind is not NodeKind.OP or s.python or s.looped or refused(s):
            return None
        steps.append(s)


def _shape_only(step):
    """Whether ``step`` is fetched only for the shapes of its outputs, which depend on data
    (a sparse gradient's deduplication): Python needs them for the stand-ins of what reads
    them, and no stand-in is made in a skipped region; its values were never read or kept."""
    return step.dynamic and not step.node.fetched and not step.node.escaped


def returned_by(slot, region):
    """The output of a node of ``region`` (a set of nodes) that ``slot``, an input of a layer
    call's ``return`` mark, reads, or None: the call returned a tensor it did not make. On
    one path the region's own producer is the one of a joined input's that ran."""
    if slot.kind is not SlotKind.NODE:
        return None
    found = [alt for alt in slot.alts if alt[0] in region]
    return found[0] if len(found) == 1 else None


def _settled(slot):
    """An input the graph has without Python: an output of a node (the one that ran last, if
    several can produce it: the graph selects it as the path did), a variable, a capture, a
    constant of the traces, or an external value fed earlier in the iteration; not one
    Python feeds here."""
    return slot.kind is not SlotKind.FEED and slot.kind is not SlotKind.RESOURCE


def rest_without_effects(cur):
    """The edges ``(step, successor index)`` from ``cur`` (the last matched step) to the
    path's end if the graph may end the iteration without the steps on them, None otherwise:
    ops that change nothing the next iteration sees and wait for nothing from Python.
    Those are ops Python runs itself (an iterator's ``get_next``) whose outputs the graph
    does not read, and graph ops that only compute or read variables (a counter read
    back for Python) with no fed input; past a branch point, Python-run ops alone (then
    whichever branch the graph is told to take runs none of the graph's ops).

    Then the state the graph leaves is eager's at this point, so an op that leaves the
    path here (Keras ending an epoch where the traces drew the next batch) may close
    the iteration instead of falling back (``Runtime.handle``): the values the graph
    computed ahead are dropped unread, and nothing is replayed or traced."""
    edges = []
    while None not in cur.next:
        if len(cur.next) > 1 and not all(_python_to_end(s) for s in cur.next):
            return None
        step = cur.next[0]
        if step.kind is not NodeKind.OP or step.looped or (
                any(channel is not None for channel in step.out_feed) if step.python else
                not opdefs.info(step.op_type).effect_free or
                any(channel is not None for channel in step.feed)):
            return None
        edges.append((cur, 0))
        cur = step
    edges.append((cur, cur.next.index(None)))
    return edges


def _python_to_end(step):
    """Whether every path from ``step`` to the iteration's end has only ops Python runs
    itself, none of whose outputs the graph reads (a branch point's successors that
    :func:`rest_without_effects` may pass)."""
    todo, seen = [step], set()
    while todo:
        s = todo.pop()
        if s is None or s in seen:
            continue
        seen.add(s)
        if s.kind is not NodeKind.OP or not s.python or s.looped or \
                any(channel is not None for channel in s.out_feed):
            return False
        todo.extend(s.next)
    return True
