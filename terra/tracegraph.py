"""The TraceGraph: every collected trace merged into one DAG (paper §3.2.2).

Nodes (``terra.nodes``) are matched on (kind, op type, attributes, executed location) among
the children of the latest matched node, *and* on where each input comes from: the same
producer node and output, the same variable, or an external value. A miss merges back into a
node elsewhere that fits, or starts a new branch. Only this module's methods add nodes or
edges. External inputs are classified over all observations (``Slot.observe``), never matched
on their values: new values widen the class.
"""

import copy
import itertools

from terra.nodes import (
    ExtRef,
    NodeKind,
    OpRef,
    SameRef,
    Slot,
    SlotKind,
    TraceNode,
    VarRef,
    function_mark,
    match_key,
    relax,
)
from terra.trace import OpRecord
from terra.trace_queries import (
    cone_of,
    in_shapes,
    observation_of,
    periodic_runs,
    resolve_result,
    taped,
)


class _Matched:
    """The part of a trace merged so far: the node of each record, and when each node ran.
    A gradient region runs as one step (its ops in TF's order, which varies), so every
    record of a region counts at its head's index, as the PythonRunner counts it."""

    __slots__ = ("nodes", "heads", "last")

    def __init__(self):
        self.nodes: list[TraceNode] = []  # record index -> node
        self.heads: list[int] = []  # record index -> index of its unit's head
        self.last: dict[TraceNode, int] = {}  # node -> head index of its latest run

    def add(self, node, head):
        self.nodes.append(node)
        self.heads.append(head)
        self.last[node] = head

    def ran_last(self, node, alts, index):
        """Whether ``node`` (record ``index``) ran after every other producer in ``alts``
        that ran in this trace: the input of a phi is the producer that ran last."""
        mine = self.heads[index]
        return all(self.last.get(n, -1) < mine for n, _ in alts if n is not node)

    def extended(self, nodes, head):
        """A copy with ``nodes`` appended as one unit (matching a region tentatively)."""
        other = _Matched()
        other.nodes, other.heads, other.last = list(self.nodes), list(self.heads), \
            dict(self.last)
        for node in nodes:
            other.add(node, head)
        return other


class TraceGraph:
    """A DAG of TraceNodes between a start and an end node.

    ``merge`` folds a trace in and says whether the trace was already covered; ``str`` prints
    one line per node in topological order, e.g.::

        %3 = MatMul[transpose_a=False, ...](feed[float32 64x784], %2)  # train.py:12
        %9 = Relu(phi(%5|%8))  # train.py:14

    ``phi(...)``: the input comes from whichever of those nodes ran last (paths joined).
    """

    def __init__(self):
        self._ids = itertools.count()
        self.start = TraceNode(next(self._ids), NodeKind.START)
        self.end = TraceNode(next(self._ids), NodeKind.END)
        self.nodes = [self.start, self.end]
        self._by_key: dict[tuple, list[TraceNode]] = {}  # merge-back candidates
        # user line -> how many times its ops ran per iteration, one entry per count seen:
        # loops are unrolled (one node per trip), this says which lines repeat and how often
        self.repeats: dict = {}
        # the trips of Python loops the traces went through: the nodes of a loop's first trip
        # -> {trip index: that trip's nodes}; terra.loops rolls them into loop nodes
        self.trips: dict[tuple, dict[int, tuple]] = {}
        # (line, op type, input index) of the external inputs seen to vary: they vary at
        # every node of that line (``Slot.vary``; a line: ``_line``)
        self.varying: set[tuple] = set()

    def _count_repeats(self, records):
        """Note, per user line, how many times the ops issued there ran in this trace: the
        largest count of ops of one call stack at that line (gradient bodies aside: they
        share their call's site; marks too: a function region's share its op's stack)."""
        per_stack = {}
        i = 0
        while i < len(records):
            rec = records[i]
            if rec.kind is NodeKind.OP and rec.site is not None and rec.location is not None:
                key = (rec.location, rec.site[0])
                per_stack[key] = per_stack.get(key, 0) + 1
            i += 1 + (rec.body_len if rec.kind is NodeKind.GRAD else 0)
        trips = {}
        for (location, _), n in per_stack.items():
            trips[location] = max(trips.get(location, 0), n)
        for location in self.repeats.keys() | trips.keys():
            self.repeats.setdefault(location, set()).add(trips.get(location, 0))

    def _note_trips(self, path):
        """Find the loops in one trace's path: runs of ops whose call stacks and types repeat
        with a period (:func:`periodic_runs`); note the nodes of each trip. A function
        region's marks repeat by the function alone (their arguments may differ per trip;
        ``loops`` drops the marks where it rolls the loop)."""
        keys = [n.stack_key if n.kind is NodeKind.OP and not n.in_body and n.site else
                ("fn", n.op_type, n.attrs[0]) if function_mark(n) else object() for n in path]
        for start, period, count in periodic_runs(keys):
            chains = [tuple(path[start + t * period:start + (t + 1) * period])
                      for t in range(count)]
            known = self.trips.setdefault(chains[0], {})
            for t, chain in enumerate(chains):
                known.setdefault(t, chain)

    def loops(self):
        """``[(location, sorted counts)]`` of the lines that ran more than once in some
        iteration: the bodies of Python loops, unrolled in the TraceGraph."""
        return sorted((loc, sorted(counts)) for loc, counts in self.repeats.items()
                      if max(counts) > 1)

    def _new_node(self, kind, rec):
        node = TraceNode(next(self._ids), kind, rec)
        self.nodes.append(node)
        return node

    @staticmethod
    def link(a, b):
        """Add the edge ``a -> b`` (once): for the merge, and for the transformations that
        link the nodes of a copy (``copy_without``)."""
        if b not in a.succs:
            a.succs.append(b)
            b.preds.append(a)

    @staticmethod
    def _fits(node, rec, trace, join=False):
        if node.key != match_key(rec) or len(node.inputs) != len(rec.inputs):
            return False
        return all(s.matches(r, trace, join) for s, r in zip(node.inputs, rec.inputs))

    def merge(self, records: list[OpRecord], any_path=frozenset()):
        """Merge one trace. Returns ``(covered, path)``: whether nothing had to be added and
        every node of the path has now been seen at least twice (a value seen once cannot be
        told constant from varying), and the nodes the trace went through, start and end
        excluded. ``any_path``: gradient calls (by key) whose regions the graph makes one
        (``terra.regions``): a region added for one of them, for a new forward path, and the
        edge back from it do not count as new.

        Each record is matched among the successors of the latest matched node; on a miss
        the trace merges back into a node elsewhere that fits (same key, inputs that fit or
        can join, not an ancestor: the graph stays acyclic) or branches with a new node.

        A gradient region (a ``grad`` head and the ``body_len`` backward ops after it) is
        one unit: TF's backward pass visits ready ops in an order that can differ between
        iterations, so a region matches as a whole, order aside (:meth:`_match_body`), and
        the path follows the existing nodes' order. Nothing merges into a region's body."""
        self._count_repeats(records)
        covered = True
        cur = self.start
        trace = _Matched()
        path: list[TraceNode] = []
        fresh = set()  # the nodes of regions added for calls in ``any_path``
        i = 0
        while i < len(records):
            unit = None
            for node in cur.succs:
                unit = self._match_unit(node, records, i, trace)
                if unit is not None:
                    break
            if unit is None:
                unit = self._merge_back(cur, records, i, trace)
                folded = records[i].kind is NodeKind.GRAD and match_key(records[i]) in any_path
                # back from a fresh region, or along a known edge reading what one computed
                joins_fresh = unit is not None and (cur in fresh or unit[0][0] in cur.succs and any(
                    type(ref) in (OpRef, SameRef) and trace.nodes[ref.index] in fresh
                    for ref in records[i].inputs))
                if not (folded or joins_fresh):
                    covered = False
                if unit is None:
                    unit = self._add_unit(records, i, trace)
                    if folded:
                        fresh.update(unit[0])
            in_graph_order, in_record_order = unit
            self.link(cur, in_graph_order[0])
            for j, node in enumerate(in_record_order, i):
                self._observe(node, records[j])
                self._absorb(node, records[j], records)
                trace.add(node, i)
            path.extend(in_graph_order)
            cur = in_graph_order[-1]
            i += len(in_record_order)
        rec_nodes = trace.nodes
        for i, (rec, node) in enumerate(zip(records, rec_nodes)):
            if rec.kind is NodeKind.GRAD:
                node.results = [resolve_result(r, rec_nodes) for r in rec.results]
                node.observations.append(observation_of(records, i, rec_nodes))
                node.taped = node.taped and taped(records, i)
                node.watched = _same_watched(node, rec.watched)
        if self.end not in cur.succs:
            covered = False
            self.link(cur, self.end)
        for node in path:
            node.seen += 1
        self._note_trips(path)
        return covered and all(node.seen > 1 or node in fresh for node in path), path

    def _match_unit(self, node, records, i, trace, join=False):
        """Whether records ``i...`` match starting at ``node``: None, or the matched nodes in
        the graph's order and in the records' order (they differ inside gradient regions)."""
        rec = records[i]
        if node.in_body or not self._fits(node, rec, trace, join):
            return None
        if rec.kind is not NodeKind.GRAD:
            return [node], [node]
        if node.cone != cone_of(records, i, trace.nodes):
            return None
        body = self._match_body(node, records, i, trace)
        return None if body is None else ([node] + body[0], [node] + body[1])

    def _merge_back(self, cur, records, i, trace):
        """A node that is not a successor of ``cur`` but fits records ``i...`` (joining
        inputs where the new producer ran last), and from which ``cur`` is not reachable."""
        for node in self._by_key.get(match_key(records[i]), ()):
            unit = self._match_unit(node, records, i, trace, join=True)
            if unit is not None and not self._reaches(node, cur):
                for slot, ref in zip(node.inputs, records[i].inputs):
                    slot.join(ref, trace)
                return unit
        return None

    @staticmethod
    def _reaches(a, b):
        seen, stack = {a}, [a]
        while stack:
            n = stack.pop()
            if n is b:
                return True
            for s in n.succs:
                if s not in seen:
                    seen.add(s)
                    stack.append(s)
        return False

    def _add_unit(self, records, i, trace):
        """New nodes for records ``i...`` (a gradient region: its head and body, chained)."""
        rec = records[i]
        mapped = list(trace.nodes)
        unit = []
        for j in range(i, i + 1 + (rec.body_len if rec.kind is NodeKind.GRAD else 0)):
            node = self._add(records[j], mapped)
            node.in_body = j > i
            if unit:
                self.link(unit[-1], node)
            unit.append(node)
            mapped.append(node)
        if rec.kind is NodeKind.GRAD:
            unit[0].cone = cone_of(records, i, trace.nodes)
        self._by_key.setdefault(unit[0].key, []).append(unit[0])
        return unit, unit

    def _add(self, rec, rec_nodes):
        node = self._new_node(rec.kind, rec)
        # An op run in Python for real may take any handle: its outputs are fed to the graph
        # and validated there, and a fresh tf.data iterator per epoch must not split it.
        handle = SlotKind.RESOURCE if rec.kind is NodeKind.OP and not rec.in_graph else SlotKind.VAR
        for ref in rec.inputs:
            kind = type(ref)
            if kind is OpRef:
                node.inputs.append(Slot(SlotKind.NODE, rec_nodes[ref.index], ref.out))
            elif kind is VarRef:
                node.inputs.append(Slot(handle, tensor=ref.handle))
            elif kind is SameRef:
                node.inputs.append(Slot(SlotKind.SAME, rec_nodes[ref.index], ref.k))
            else:
                node.inputs.append(Slot.external(ref.tensor))
        return node

    def _observe(self, node, rec):
        """Fold the external values of one more observation into the slots' classes. A
        value that varies makes its input vary at every node of that line (``varying``)."""
        for i, (slot, ref) in enumerate(zip(node.inputs, rec.inputs)):
            if type(ref) is not ExtRef:
                continue
            slot.observe(ref.tensor)
            line = (_line(node), node.op_type, i)
            if line in self.varying:
                slot.vary()
            elif slot.values_vary and slot.kind is SlotKind.FEED and line[0] is not None:
                self.varying.add(line)
                for other in self.nodes:
                    if (_line(other), other.op_type) == line[:2] and len(other.inputs) > i:
                        other.inputs[i].vary()

    @staticmethod
    def _absorb(node, rec, records):
        """Fold what one observation of ``node`` adds: shapes, fetches, escapes."""
        sig = in_shapes(rec, records)
        if node.sigs.setdefault(sig, rec.out_specs) != rec.out_specs:
            node.sigs[sig] = rec.out_specs
            node.data_dependent = True  # same input shapes, new output shapes
        node.out_specs = rec.out_specs
        relaxed = node.out_relaxed
        node.out_relaxed = [spec[0] for spec in rec.out_specs] if relaxed is None else \
            [relax(a, spec[0]) for a, spec in zip(relaxed, rec.out_specs)]
        node.fetched |= rec.fetched
        node.escaped |= rec.escaped
        if node.untaped != rec.untaped:
            node.untaped = None
        if rec.kind is NodeKind.GRAD:
            node.body_len = rec.body_len

    def _match_body(self, head, records, i, trace):
        """Match the gradient region of the head record ``i`` against the existing body
        that follows ``head``, in any order consistent with the data flow. Returns the
        body nodes in the graph's order and in the records' order, or None."""
        n = records[i].body_len
        first = i + 1
        if n != head.body_len or first + n > len(records):
            return None
        body, cur = [], head
        for _ in range(n):
            if len(cur.succs) != 1:
                return None
            cur = cur.succs[0]
            body.append(cur)
        free = list(body)
        mapped = trace.extended([head], i)
        for rec in records[first:first + n]:
            node = next((c for c in free if self._fits(c, rec, mapped)), None)
            if node is None:
                return None
            free.remove(node)
            mapped.add(node, i)
        return body, mapped.nodes[first:]

    def topological(self):
        indeg = {n: len(n.preds) for n in self.nodes}
        ready = [self.start]
        order = []
        while ready:
            n = ready.pop()
            order.append(n)
            for s in reversed(n.succs):
                indeg[s] -= 1
                if indeg[s] == 0:
                    ready.append(s)
        return order

    def lint(self):
        """Check the structural invariants; raises AssertionError naming the broken one."""
        order = self.topological()
        assert len(order) == len(self.nodes), "TraceGraph has a cycle"
        assert len({n.id for n in self.nodes}) == len(self.nodes), "duplicate node ids"
        assert not self.start.preds and not self.end.succs, "start/end are not source/sink"
        for n in self.nodes:
            for s in n.succs:
                assert n in s.preds, f"{n!r}->{s!r} missing its reverse edge"
            for slot in n.inputs:
                assert all(p in self.nodes for p, _ in slot.alts), f"{n!r} dangling input"

    def fresh_node(self, kind) -> TraceNode:
        """A node with an id no node of this graph has, not yet in any graph: a copy's new
        node (``terra.loops``' loop node), listed by :meth:`set_nodes`."""
        return TraceNode(next(self._ids), kind)

    def set_nodes(self, nodes):
        """The nodes of a copy (``copy_without``), in graph order, once they are linked."""
        self.nodes = list(dict.fromkeys(nodes))

    def copy_without(self, dropped):
        """A copy to transform (``terra.loops``, ``terra.regions``): every node but
        ``dropped``, copied without edges (the caller links them), and the old node -> copy
        map. Loop nodes and their bodies refer to each other's copies. The copy is generated
        from, never merged into: it has no merge state."""
        new = copy.copy(self)
        new.trips, new._by_key = {}, {}
        clone = {}
        for n in self.nodes:
            if n not in dropped:
                clone[n] = copy.copy(n)
                clone[n].succs, clone[n].preds = [], []
        for node in clone.values():  # an earlier loop's nodes refer to its copied head
            if node.loop is not None:
                node.loop = clone[node.loop]
            if node.kind is NodeKind.LOOP:
                node.carried = [(clone[b], out) for b, out in node.carried]
        return new, clone

    def regions(self) -> dict:
        """How many gradient regions each gradient call (by key) has: one per forward path
        it was recorded after."""
        counts = {}
        for n in self.nodes:
            if n.kind is NodeKind.GRAD:
                counts[n.key] = counts.get(n.key, 0) + 1
        return counts

    def region_location(self, key):
        """Where the gradient call ``key`` is in the user's code."""
        return next((n.location for n in self.nodes if n.kind is NodeKind.GRAD and n.key == key),
                    None)

    @property
    def branch_points(self):
        return [n for n in self.nodes if len(n.succs) > 1]

    def __str__(self):
        lines = []
        for n in self.topological():
            if n.kind in (NodeKind.START, NodeKind.END):
                continue
            lines.append(n.format())
        return "\n".join(lines)


def _same_watched(node, watched):
    """``TraceNode.watched`` once one more trace's gradient call ``node`` watched
    ``watched``: kept while every trace watched the same variables, else None."""
    if len(node.observations) == 1:
        return tuple(watched)
    if node.watched is None or {h._id for h in node.watched} != {h._id for h in watched}:
        return None
    return node.watched


def _line(node):
    """The line a node's op was issued from, for ``TraceGraph.varying``: its call stack (the
    site without the occurrence: a loop's trips and the paths through one helper share
    it), not the user's ``file:line``, which is one for every op a library issues from one
    call of the user's (every op of a Keras ``fit``: a step counter's varying constant made
    every constant of its op type anywhere in ``fit`` a feed, 2.3x -> 1.6x over eager)."""
    return node.site[0] if node.site is not None else node.location
