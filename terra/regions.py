"""Gradient regions folded across forward paths: one region for every path the forward took.

A gradient region (a ``tape.gradient`` call and its recorded backward ops) is valid only for
the forward pass it was recorded after: its cone (``TraceNode.cone``). When the forward pass
branches, the same call gets one region per combination of branches traced, and the
PythonRunner falls back at the call whenever this iteration took a combination no trace had:
two random choices per step need four regions, a block drawn at random in each of four layers
sixteen, and every new one costs a fallback, a trace and a new graph.

TF's symbolic gradient of the graph's forward ops (``tf.gradients`` through the
``tf.switch_case`` ops the branches are emitted as) differentiates whichever branches ran.
For a call that keeps falling back that way (``Config.fold_after``), :func:`fold` makes, on a
copy of the TraceGraph, one region out of the call's regions (same key: same call site) and
marks it for that gradient (``TraceNode.rolled``, as the regions merged through a rolled loop
are): it then serves every combination, traced or not. Only such calls: where a value has
three or more consumers, TF's gradient may sum their contributions in another order than the
tape, a last-bit difference that a recorded region does not have.

Only regions whose tape recorded every forward op they differentiate (``TraceNode.taped``)
and whose results have one structure are folded. The PythonRunner checks that each iteration
reaches the sources the folded region has results for (TF's gradient gives zeros where the
tape gives None). Where TF's gradient cannot be built, or does
not give the tape's structure, the GraphGenerator generates again without that fold
(``keep``), and the regions stay one per traced path, as before.
"""

import copy

from terra.nodes import NodeKind, SlotKind, region_body, result_map, result_structure
from terra.tracegraph import TraceGraph


def folded(node) -> bool:
    """Whether ``node`` is the region :func:`fold` made of several."""
    return isinstance(node.rolled, tuple) and node.rolled[:1] == ("fold",)


def fold(tracegraph: TraceGraph, calls, keep=frozenset()):
    """A copy of ``tracegraph`` with the regions of each gradient call in ``calls`` (by key)
    folded into one, or ``tracegraph`` itself if no call's regions can be. ``keep``: groups
    (by the fold key, ``("fold", head id)`` of the region kept) that stay apart."""
    groups = [g for g in _groups(tracegraph, calls) if ("fold", g[0].id) not in keep]
    if not groups:
        return tracegraph
    try:
        new = _copy(tracegraph, groups)
    except KeyError:  # something reads a backward op of a region that is no result
        return tracegraph
    if len(new.topological()) != len(new.nodes):  # joining two calls closed a cycle
        return tracegraph
    return new


def _groups(tracegraph, calls):
    """The regions of each call in ``calls`` that can be one, in graph order (a call with one
    region too: it becomes TF's gradient, which serves the shapes no trace had as well)."""
    by_key = {}
    for node in tracegraph.nodes:
        if node.kind is NodeKind.GRAD and not node.in_body and node.rolled is None and \
                node.key in calls:
            by_key.setdefault(node.key, []).append(node)
    groups = []
    for nodes in by_key.values():
        if not all(g.taped for g in nodes):
            continue
        if len({_structure(g) for g in nodes}) == 1:
            groups.append(nodes)
    return groups


def _structure(g):
    """What folded regions must share: their results' structure and their inputs' kinds."""
    return result_structure(g), tuple(s.kind for s in g.inputs)


def _copy(graph, groups):
    merged = {}  # (node, out) of a dropped region's result -> the kept region's
    stands_for = {}  # a dropped region's head and last op -> the kept region's
    dropped = set()
    for nodes in groups:
        keep, keep_body = nodes[0], region_body(nodes[0])
        for g in nodes[1:]:
            body = region_body(g)
            dropped.add(g)
            dropped.update(body)
            stands_for[g] = keep
            stands_for[body[-1] if body else g] = keep_body[-1] if keep_body else keep
            merged.update(result_map(g, keep))
    new, clone = graph.copy_without(dropped)
    new.start, new.end = clone[graph.start], clone[graph.end]

    def out_of(node, out):
        node, out = merged.get((node, out), (node, out))
        return clone[node], out

    for old, node in clone.items():
        remap(old, node, clone, out_of)
    for nodes in groups:
        head = clone[nodes[0]]
        head.rolled = ("fold", nodes[0].id)
        head.observations = []  # TF's symbolic gradient needs no backward feeds
        for g in nodes[1:]:
            for slot, other in zip(head.inputs, g.inputs, strict=True):
                slot.alts = list(dict.fromkeys(slot.alts + [out_of(n, o) for n, o in other.alts]))

    def end_of(old):
        if old in stands_for:
            return clone[stands_for[old]]
        return None if old in dropped else clone[old]

    for old in graph.nodes:
        for s in old.succs:
            a, b = end_of(old), end_of(s)
            if a is not None and b is not None and a is not b:
                TraceGraph.link(a, b)
    new.set_nodes([clone[n] for n in graph.nodes if n in clone])
    return new


def remap(old, node, clone, out_of):
    """``node``, the copy of ``old`` in a transformed copy of a graph (``clone``: old node ->
    copy), reads where ``out_of(node, out)`` says: its inputs, and a gradient region's results
    and cone."""
    node.inputs = [_mapped(slot, out_of) for slot in old.inputs]
    if node.kind is NodeKind.GRAD:
        node.results = [None if r is None else (r[0],) + tuple(
            None if q is None else out_of(*q) for q in r[1:]) for r in old.results]
        node.cone = {(None if n is None else clone[n], k): (kind, *out_of(p, out))
                     for (n, k), (kind, p, out) in old.cone.items()}


def _mapped(slot, out_of):
    new = copy.copy(slot)
    if slot.kind in (SlotKind.NODE, SlotKind.SAME):
        new.alts = list(dict.fromkeys(out_of(n, out) for n, out in slot.alts))
    return new
