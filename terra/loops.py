"""Loop nodes: the unrolled trips of a Python loop rolled into one body (paper §3.2.2).

The TraceGraph keeps a loop unrolled, one node per trip (merging needs the executed location,
and a trip's ops differ from the next trip's only by their occurrence). When traces took
different trip counts, the GraphGenerator needs one body it can run any number of times: a
``tf.while_loop`` whose Loop Cond the PythonRunner feeds. :func:`roll` makes that out of a
copy of the TraceGraph; the TraceGraph itself stays unrolled for later merges.

A loop seen with trip counts ``n1 < n2 < ...`` (``TraceGraph.trips`` holds its trips' nodes):

- the first ``p = n1`` trips stay as they are (peeled): every trace ran them;
- the trips from ``p`` on are rolled into a LOOP node ``L`` followed by one body ``B``
  (the chain ``L -> B[0] -> ... -> B[m-1]``), and ``B[m-1]`` leads wherever any trip left
  the loop. Case assignment sees ``L`` and its body as one unit, like a gradient region;
- each input of ``B[j]`` is classified over the rolled trips: an output of the same trip,
  one of the previous trip (carried: ``phi(peeled | B)``, the value that ran last, as a
  phi always is), a value from before the loop (invariant), a variable, a constant, or a
  per-trip feed (a constant that differs between trips, ``x[:, t]``'s begin index);
- a value read after the loop from the rolled trips reads ``B`` (whichever trip ran last);
- gradient regions whose forward pass went through the loop (one per trip count: their
  cones differ) are merged into one, emitted as TF's symbolic gradient through the While.

A loop that does not fit (a trip that branches or breaks in the middle, a value read from
two trips back, a gradient region or tape mark inside a trip, gradient regions that differ
otherwise) is left unrolled: every trip count a trace took still runs in the graph, and a
new one falls back, as before.
"""

import copy

from terra.nodes import (
    NodeKind,
    Slot,
    SlotKind,
    function_mark,
    region_body,
    relax,
    result_map,
    result_structure,
)
from terra.regions import remap
from terra.tracegraph import TraceGraph


class _NotRollable(Exception):
    """This loop cannot be rolled (the message says why); it stays unrolled."""


def roll(tracegraph: TraceGraph, keep=frozenset()):
    """A copy of ``tracegraph`` with its loops rolled, or ``tracegraph`` itself if none is.
    ``keep``: loops (by their first trip's nodes, as in ``TraceGraph.trips``) left unrolled.
    Returns ``(graph, {LOOP node: its first trip's nodes})``."""
    graph, clone = _without_function_marks(tracegraph, keep)
    loops = {}
    for first, trips in tracegraph.trips.items():
        if first in keep:
            continue
        chains = {t: tuple(clone.get(n, n) for n in chain if not function_mark(n))
                  for t, chain in trips.items()}
        present = set(graph.nodes)
        if any(n not in present for chain in chains.values() for n in chain):
            continue  # some of its nodes were rolled into another loop
        try:
            rolled = _Rolling(graph, chains, first)
            graph, step = rolled.copy()
        except _NotRollable:
            continue
        clone = {n: step.get(clone.get(n, n), clone.get(n, n)) for n in tracegraph.nodes}
        loops = {step.get(k, k): v for k, v in loops.items()}
        loops[rolled.head] = first
    return graph, loops


def _without_function_marks(graph, keep):
    """A copy of ``graph`` without the marks of TF functions' regions
    (``terra.function_regions``) in the trips of loops that may roll (their trip counts
    differ; not in ``keep``), and the old node -> copy map; ``graph`` itself and an empty map
    if there are none. Marks would keep a loop from rolling (a While's body is ops); without
    them the calls run op by op in the loop, ``x[:, t]``'s ``t`` a per-trip feed
    (``function_regions.marked_here``)."""
    marks = set()
    for first, trips in graph.trips.items():
        c = _contiguous(trips)
        if first not in keep and _peeled(c) < len(c):
            marks.update(n for chain in c for n in chain if function_mark(n))
    if not marks:
        return graph, {}
    new, clone = graph.copy_without(marks)
    new.start, new.end = clone[graph.start], clone[graph.end]
    for old, node in clone.items():
        remap(old, node, clone, lambda n, out: (clone[n], out))
        if node.kind is NodeKind.GRAD:  # backward values by what was fed before the call
            node.observations = [
                ([(clone[n], k, part) for n, k, part in before if n in clone],
                 {(clone[n], k): v for (n, k), v in body.items()})
                for before, body in old.observations]

    def targets(s):  # where an edge into ``s`` leads once the marks are gone
        return [clone[s]] if s not in marks else [t for x in s.succs for t in targets(x)]

    for old in graph.nodes:
        if old not in marks:
            for s in old.succs:
                for t in targets(s):
                    TraceGraph.link(clone[old], t)
    new.set_nodes([clone[n] for n in graph.nodes if n in clone])
    return new, clone


def _ends(c):
    """The trip counts the traces took, of contiguous trip chains ``c``."""
    return [t + 1 for t in range(len(c))
            if any(t + 1 == len(c) or s is not c[t + 1][0] for s in c[t][-1].succs)]


def _peeled(c):
    """How many trips every trace ran (the first trip count), of trip chains ``c``."""
    ends = _ends(c)
    return ends[0] if ends else len(c)


def _contiguous(trips):
    chains = []
    while len(chains) in trips:
        chains.append(trips[len(chains)])
    return chains


class _Rolling:
    """The plan for rolling one loop of ``graph``; :meth:`copy` carries it out."""

    def __init__(self, graph, trips, key):
        self.graph, self.key = graph, key
        c = self.c = _contiguous(trips)
        m = len(c[0])
        ends = _ends(c)
        p = self.p = _peeled(c)
        if p >= len(c):
            raise _NotRollable("every trace ran the same trips")  # unrolled (the paper too)
        if any(n.kind is not NodeKind.OP for n in c[p]):
            raise _NotRollable("a trip holds a tape mark or a gradient call")
        for t in range(p - 1, len(c)):
            for j in range(m - 1):
                if c[t][j].succs != [c[t][j + 1]] or c[t][j + 1].preds != [c[t][j]]:
                    raise _NotRollable("a trip branches or leaves the loop in its middle")
            if t >= p and c[t][0].preds != [c[t - 1][-1]]:
                raise _NotRollable("a trip is entered from elsewhere")
        # trip index and position of the nodes from the last peeled trip on
        self.pos = {n: (t, j) for t in range(p - 1, len(c)) for j, n in enumerate(c[t])}
        self.rolled = {n for n, (t, _) in self.pos.items() if t >= p}
        self.head = graph.fresh_node(NodeKind.LOOP)
        self.head.body_len = m
        self.head.location = c[p][0].location
        self.head.counts, self.head.peeled = tuple(ends), p
        self.body = [self._body_node(j) for j in range(m)]
        self.grads = self._gradient_groups()

    # -- the body -----------------------------------------------------------------------
    def _body_node(self, j):
        c, p = self.c, self.p
        trips = [c[t][j] for t in range(p, len(c))]
        node = copy.copy(trips[0])
        node.succs, node.preds, node.loop = [], [], self.head
        node.sigs = {}
        for other in trips:
            for sig, specs in other.sigs.items():
                if node.sigs.setdefault(sig, specs) != specs:
                    node.data_dependent = True
        node.data_dependent |= any(n.data_dependent for n in trips)
        node.out_relaxed = list(trips[0].out_relaxed)
        for other in trips[1:]:
            node.out_relaxed = [relax(a, b) for a, b in zip(node.out_relaxed, other.out_relaxed)]
        node.fetched = set().union(*(n.fetched for n in trips))
        node.escaped = set().union(*(n.escaped for n in trips))
        node.inputs = [self._body_slot(j, i) for i in range(len(node.inputs))]
        return node

    def _body_slot(self, j, i):
        """What input ``i`` of the body's node ``j`` reads, from its reads in every rolled
        trip (and the last peeled one, for constants)."""
        c, p = self.c, self.p
        slots = [c[t][j].inputs[i] for t in range(p, len(c))]
        kinds = {s.kind for s in slots}
        if kinds <= {SlotKind.CONST, SlotKind.CAPTURE, SlotKind.FEED}:
            return self._external(slots, c[p - 1][j].inputs[i])
        if len(kinds) > 1 or any(len(s.alts) > 1 for s in slots):
            raise _NotRollable("an input of a trip joins paths")
        kind = slots[0].kind
        if kind in (SlotKind.VAR, SlotKind.RESOURCE):
            peeled = c[p - 1][j].inputs[i]
            if kind is SlotKind.VAR and (peeled.kind is not SlotKind.VAR or
                                  len({s.tensor._id for s in slots + [peeled]}) > 1):
                raise _NotRollable("trips read different variables")
            return copy.copy(slots[0])
        choices = None  # the readings consistent with every rolled trip so far
        for t, slot in enumerate(slots, p):
            n, out = slot.alts[0]
            where = self.pos.get(n)
            fits = set()
            if where is None or where[0] == p - 1:
                fits.add(("before", n, out))  # from before the rolled trips: invariant
            if where is not None and where[0] == t and where[1] < j:
                fits.add(("trip", where[1], out))
            if kind is SlotKind.NODE and where is not None and where[0] == t - 1 and where[1] >= j:
                fits.add(("carried", where[1], out))
            choices = fits if choices is None else choices & fits
        if not choices:
            raise _NotRollable("a trip reads a value of another trip than the previous one")
        how, a, out = max(choices, key=lambda f: f[0] == "carried")  # ambiguous: carried
        if how == "before":
            return Slot(kind, a, out)
        if how == "trip":
            return Slot(kind, _Pending(a), out)
        slot = Slot(SlotKind.NODE, c[p - 1][a], out)
        slot.alts.append((_Pending(a), out))
        return slot

    @staticmethod
    def _external(slots, peeled):
        """A constant if every rolled trip and the last peeled one read the same one, a
        captured tensor if every rolled trip read that one, else a value fed at every trip."""
        first = slots[0]
        same = slots + ([peeled] if peeled.kind is SlotKind.CONST else [])
        if all(s.kind is SlotKind.CONST for s in slots) and all(
                s.value.shape == first.value.shape and s.value_bytes == first.value_bytes
                for s in same):
            return copy.copy(first)
        if all(s.kind is SlotKind.CAPTURE and s.tensor is first.tensor for s in slots):
            return copy.copy(first)
        if peeled.kind in (SlotKind.CONST, SlotKind.CAPTURE, SlotKind.FEED):
            slots = slots + [peeled]
        if len({s.dtype for s in slots}) > 1:
            raise _NotRollable("trips feed values of different dtypes")
        feed = Slot(SlotKind.FEED)
        feed.dtype, feed.values_vary = first.dtype, True
        shapes = [tuple(s.value.shape) if s.kind is SlotKind.CONST else s.shape for s in slots]
        feed.shape = shapes[0]
        for shape in shapes[1:]:
            feed.shape = relax(feed.shape, shape)
        return feed

    # -- gradient regions through the loop ----------------------------------------------
    def _gradient_groups(self):
        """Gradient regions whose forward pass reached the loop, grouped by key: each group
        becomes one region, emitted as TF's symbolic gradient (``TraceNode.rolled``)."""
        touched = set(self.pos)
        groups = {}
        for node in self.graph.nodes:
            if node.kind is NodeKind.GRAD and any(
                    p in touched or n in touched for (n, _), (_, p, _) in node.cone.items()):
                groups.setdefault(node.key, []).append(node)
        for nodes in groups.values():
            if not all(g.taped for g in nodes):
                raise _NotRollable("a gradient through the loop differentiates ops its tape "
                                   "did not record")
            if len({result_structure(g) for g in nodes}) > 1:
                raise _NotRollable("gradients through the loop differ in their results")
        return list(groups.values())

    # -- the copy -----------------------------------------------------------------------
    def copy(self):
        """The rolled copy of the graph, and the old node -> copy map of the nodes kept."""
        graph, rolled, p, c = self.graph, self.rolled, self.p, self.c
        merged = {}  # a gradient region merged into another: head and results -> the kept one
        dropped = set(rolled)
        for nodes in self.grads:
            keep = nodes[0]
            for g in nodes[1:]:
                merged[g] = keep
                dropped.add(g)
                body = region_body(g)
                dropped.update(body)
                merged.update(result_map(g, keep))
                merged[body[-1]] = region_body(keep)[-1]  # where the region is left
        new, clone = graph.copy_without(dropped)
        for j, n in enumerate(c[p]):
            clone[n] = self.body[j]  # edges into the first rolled trip reach the body
        new.start, new.end = clone[graph.start], clone[graph.end]

        def out_of(node, out):
            """Where a read of output ``out`` of ``node`` reads in the copy."""
            if node in rolled:
                return self.body[self.pos[node][1]], out
            if (node, out) in merged:
                node, out = merged[(node, out)]
            return clone[node], out

        region_of_merged = {n for g in self.grads for n in (g[0], *region_body(g[0]))}
        try:
            for old, node in clone.items():
                if old in rolled:
                    continue
                node.inputs = [self._read(slot, out_of, old in region_of_merged)
                               for slot in old.inputs]
                if node.kind is NodeKind.GRAD:
                    self._grad_copy(old, node, out_of)
        except KeyError:  # something reads a backward op of a merged region that is no result
            raise _NotRollable(
                "a value inside a gradient region through the loop is read") from None
        for body in self.body:
            for slot in body.inputs:
                slot.alts = [(self.body[n.j], out) if isinstance(n, _Pending) else
                             out_of(n, out) for n, out in slot.alts]
        head = self.head
        head.inputs, head.carried = [], []
        later = self._read_later(clone, {clone[n] for n in region_of_merged})
        for j, body in enumerate(self.body):  # loop variables: carried or read after the loop
            for out in range(len(body.out_specs)):
                if (body, out) in later:
                    head.inputs.append(Slot(SlotKind.NODE, clone[c[p - 1][j]], out))
                    head.carried.append((body, out))
        self._edges(clone, merged, dropped)
        new.set_nodes([n for n in [clone.get(n) for n in graph.nodes] if n is not None]
                      + [head])
        return new, {old: n for old, n in clone.items() if old not in rolled}

    def _read(self, slot, out_of, in_merged_region):
        """A copy of ``slot`` of a node outside the rolled trips, its producers mapped."""
        new = copy.copy(slot)
        if slot.kind not in (SlotKind.NODE, SlotKind.SAME):
            return new
        from_loop = [(n, out) for n, out in slot.alts if n in self.rolled]
        if from_loop and not in_merged_region:
            if slot.kind is SlotKind.SAME:
                raise _NotRollable("a value first read in a rolled trip is read after it")
            js = {(self.pos[n][1], out) for n, out in from_loop}
            peeled = [(n, out) for n, out in slot.alts if self.pos.get(n, (-1,))[0] == self.p - 1]
            if len(js) > 1 or any((self.pos[n][1], out) not in js for n, out in peeled):
                raise _NotRollable("values of different trips are read after the loop")
        new.alts = list(dict.fromkeys(out_of(n, out) for n, out in slot.alts))
        return new

    def _read_later(self, clone, symbolic):
        """The outputs ``(body node, out)`` that must leave a trip: read by the next trip (a
        phi in the body) or after the loop (not by the backward ops of a merged gradient
        region: TF's symbolic gradient replaces them)."""
        later = {alt for b in self.body for s in b.inputs if len(s.alts) > 1 for alt in s.alts}
        later.update(alt for n in clone.values() if n.loop is None and n not in symbolic
                     for s in n.inputs if s.kind is SlotKind.NODE for alt in s.alts)
        return later

    def _grad_copy(self, old, node, out_of):
        """A gradient region's head in the copy: results, cone and observations mapped; the
        head kept for a group of regions through the loop reads what any of them read."""
        node.results = [None if r is None else (r[0],) + tuple(
            None if q is None else out_of(*q) for q in r[1:]) for r in old.results]
        group = next((g for g in self.grads if g[0] is old), None)
        node.cone = {}
        for g in group or [old]:
            for (n, k), (kind, producer, out) in g.cone.items():
                key = (None if n is None else out_of(n, 0)[0], k)
                node.cone[key] = (kind, *out_of(producer, out))
        if group is not None:
            node.rolled = self.key
            node.observations = []  # TF's symbolic gradient needs no backward feeds
            for g in group[1:]:
                if len(g.inputs) != len(node.inputs) or any(
                        a.kind is not b.kind for a, b in zip(g.inputs, node.inputs)):
                    raise _NotRollable("gradients through the loop differ in their inputs")
                for slot, other in zip(node.inputs, g.inputs):
                    slot.alts = list(dict.fromkeys(
                        slot.alts + [out_of(n, out) for n, out in other.alts]))
            return
        node.observations = []  # used only for backward feeds (graph_builder._backward_feeds)
        if any(s.kind is SlotKind.FEED for b in region_body(old) for s in b.inputs):
            # backward values are looked up by what was fed before the call: in the copy a
            # rolled trip's ops stand for every trip, so only regions before the loop keep
            # their table
            node.observations = [
                ([(out_of(n, 0)[0], k, part) for n, k, part in before],
                 {(out_of(n, 0)[0], k): v for (n, k), v in body.items()})
                for before, body in old.observations]
            if any(n in self.rolled for before, _ in old.observations for n, _, _ in before):
                raise _NotRollable("a gradient after the loop is fed backward values")

    def _edges(self, clone, merged, dropped):
        """The copy's edges: a trip's ops become the body's, the edge into the first rolled
        trip enters the loop node, every edge out of a trip's last op leaves the body, edges
        between rolled trips go (the While goes round), merged gradient regions become one."""
        c, p, pos, head, body = self.c, self.p, self.pos, self.head, self.body
        ends = {c[t][-1] for t in range(p - 1, len(c))}

        def end_of(old):
            if old in self.rolled:
                return body[pos[old][1]]
            if old in dropped:  # a merged region: its head and last op stand for the kept one
                return clone[merged[old]] if old in merged else None
            return clone[old]

        for old in self.graph.nodes:
            for s in old.succs:
                if old in ends and s in pos:  # into the next trip
                    if pos[old][0] == p - 1:
                        TraceGraph.link(clone[old], head)
                    continue
                a = body[-1] if old in ends else end_of(old)
                b = end_of(s)
                if a is not None and b is not None and a is not b:
                    TraceGraph.link(a, b)
        TraceGraph.link(head, body[0])


class _Pending:
    """The body's node ``j``, before the body exists (its inputs are classified first)."""

    __slots__ = ("j",)

    def __init__(self, j):
        self.j = j
