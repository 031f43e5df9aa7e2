"""The TraceGraph: every collected trace merged into one DAG (paper §3.2.2).

Nodes are matched on (kind, op type, attributes) among the children of the latest matched
node, *and* on where each input comes from: the same producer node and output, the same
variable, or an external value. A miss starts a new branch. Only this module's methods add
nodes or edges.

External inputs are classified over all observations, so the graph can treat them cheaply and
the PythonRunner can validate them soundly:

- ``const``: a small tensor with the same value every time -> a graph constant, validated
  by value;
- ``capture``: the very same tensor object every time (checked over >= 2 traces) -> captured
  by identity like a variable;
- a value seen in one trace only is a ``const`` if it is tiny (``ONCE_CONST``), else a ``feed``;
- ``feed``: anything else -> an Input Feeding queue; its dtype is validated and its shape
  is validated against the shapes seen (a varying dimension is relaxed in the graph).
"""

import copy
import enum
import itertools

import numpy as np
from tensorflow.python.framework import dtypes

from terra import opdefs
from terra.trace import OpRecord

SMALL_CONST = 64  # elements; larger external tensors are always fed
# A value seen once cannot be told constant from varying. Guess by size: up to this many
# elements (scalars, shapes, strides, axes) it is taken for a constant, anything larger (a
# label batch) is fed. A wrong guess costs a fallback, or a feed of a value that never changes.
ONCE_CONST = 8


def relax(shape, new):
    """The most specific shape (None: unknown dim or rank) that both shapes satisfy."""
    if shape == new:
        return shape
    if shape is None or len(shape) != len(new):
        return None
    return tuple(a if a == b else None for a, b in zip(shape, new))


class NodeKind(enum.Enum):
    START = "start"
    END = "end"
    OP = "op"  # a TF op; ``in_graph`` says whether the graph or the PythonRunner runs it
    MARK = "mark"  # tape enter / exit / watch
    GRAD = "grad"  # head of a gradient region: the next ``body_len`` nodes are its ops
    # a loop node (terra.loops, only in a rolled copy): the next ``body_len`` nodes are one
    # trip of a Python loop, emitted as a tf.while_loop
    LOOP = "loop"


class Slot:
    """Where one input of a node comes from."""

    __slots__ = ("kind", "alts", "tensor", "value", "value_bytes",
                 "dtype", "shape", "ids", "values_vary", "seen")

    def __init__(self, kind, node=None, out=0, tensor=None):
        self.kind = kind  # "node" | "var" | "resource" | "const" | "capture" | "feed" | "same"
        # "resource": any resource handle, for ops run in Python (the iterator of an epoch)
        # "same": the value of input ``out`` of ``node`` (an external value read again)
        # node / same: the producers this input may come from, ``(node, out)`` each. More
        # than one where paths join (the paper's Figure 3.2: x2 comes from either branch):
        # the input is then the one of them that ran last, in eager as in the graph.
        self.alts = [(node, out)] if node is not None else []
        self.tensor = tensor
        self.value = self.value_bytes = None
        self.dtype = self.shape = None
        self.ids = set()
        self.values_vary = False
        self.seen = 0  # observations (external slots)

    @classmethod
    def external(cls, t):
        """An external input first seen as ``t``; the merge observes ``t`` (once: a value seen
        in one trace is not yet known to be constant, nor the same tensor every time)."""
        slot = cls("feed")
        slot.dtype, slot.shape = t._datatype_enum(), t._shape_tuple()
        return slot

    def observe(self, t):
        """Fold one more observation of an external input into the classification."""
        self.seen += 1
        self.shape = relax(self.shape, t._shape_tuple())
        self.ids.add(t._id)
        if not self.values_vary and t._num_elements() <= SMALL_CONST and \
                t.dtype != dtypes.string and t.dtype != dtypes.variant:
            value = t._numpy_internal()  # bypasses the materialization hook
            if self.value is None:
                self.value = np.array(value)
                self.value_bytes = self.value.tobytes()
            elif value.shape != self.value.shape or value.tobytes() != self.value_bytes:
                self.values_vary = True  # by bytes, as the PythonRunner validates
        else:
            self.values_vary = True
        if self.value is not None and not self.values_vary and \
                (self.seen > 1 or self.value.size <= ONCE_CONST):
            self.kind, self.tensor = "const", None
        elif self.seen > 1 and len(self.ids) == 1:
            self.kind, self.tensor = "capture", t  # the very same tensor every time
        else:
            self.kind, self.tensor = "feed", None

    def matches(self, ref, trace, join=False):
        """Whether the input ``ref`` of a record of ``trace`` (a :class:`_Matched`) fits.
        With ``join`` a new producer fits too if it ran after the others (merging back)."""
        kind = ref[0]
        if kind == "op" or kind == "same":
            if self.kind != ("node" if kind == "op" else "same"):
                return False
            p = (trace.nodes[ref[1]], ref[2])
            if p not in self.alts:
                return join and trace.ran_last(p[0], self.alts, ref[1])
            return len(self.alts) == 1 or trace.ran_last(p[0], self.alts, ref[1])
        if kind == "var":
            return self.kind == "resource" or \
                self.kind == "var" and self.tensor._id == ref[1]._id
        return self.kind in ("const", "capture", "feed") and \
            self.dtype == ref[1]._datatype_enum()

    def join(self, ref, trace):
        """Add the producer of ``ref`` to the alternatives (it ``matches`` with ``join``)."""
        if ref[0] in ("op", "same"):
            p = (trace.nodes[ref[1]], ref[2])
            if p not in self.alts:
                self.alts.append(p)

    def __str__(self):
        if self.kind in ("node", "same"):
            alts = "|".join(f"%{n.id}" + (f".in{k}" if self.kind == "same" else
                                          f".{k}" if k else "") for n, k in self.alts)
            return alts if len(self.alts) == 1 else f"phi({alts})"
        if self.kind in ("var", "resource"):
            return self.kind
        if self.kind == "const":
            return f"const({np.array2string(self.value, threshold=4)})"
        shape = "?" if self.shape is None else "x".join("?" if d is None else str(d)
                                                         for d in self.shape)
        return f"{self.kind}[{dtypes.as_dtype(self.dtype).name} {shape}]"


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


class TraceNode:
    """A node of the TraceGraph. ``repr`` is ``%id``; :meth:`format` is one full line."""

    def __init__(self, node_id, kind, rec: OpRecord | None = None):
        self.id = node_id
        self.kind = kind
        self.succs: list[TraceNode] = []
        self.preds: list[TraceNode] = []
        self.op_type = rec.op_type if rec else kind.value
        self.attrs = rec.attrs if rec else ()
        self.location = rec.location if rec else None
        self.site = rec.site if rec else None
        self.in_body = False  # an op of a gradient region (only its head is ever a target)
        self.in_graph = rec.in_graph if rec else False
        self.inputs: list[Slot] = []
        self.out_specs = rec.out_specs if rec else ()
        self.sigs: dict[tuple, tuple] = {}  # input shapes -> output specs
        self.out_relaxed = None  # per output: the shape over every observation (relax())
        self.data_dependent = False  # output shapes seen to differ for equal input shapes
        self.body_len = rec.body_len if rec else 0
        self.results = None  # GRAD: per source leaf None | ("t", (node, out)) | ("is", ...)
        # GRAD: where every input in the cone of its target came from when it was recorded
        # (see _cone); a region is only valid where the forward pass was the same
        self.cone = None
        # GRAD: per trace through it, (what came before the call: (node, input, signature
        # part) per external input and (node, None, output shapes) per op, {(body node,
        # input): value} of the body's external inputs): backward ops compute shape-derived
        # values in Python; Terra feeds them by the iteration's signature
        self.observations = []
        # GRAD: in every trace, the forward ops its sources reach its target through were
        # recorded by its tape (see _taped): TF's symbolic gradient of the graph then
        # differentiates what the tape did
        self.taped = True
        self.fetched: set[int] = set()
        self.escaped: set[int] = set()
        self.seen = 0  # traces that went through this node
        self.loop = None  # in a rolled copy (terra.loops): the LOOP node whose body it is
        # GRAD, in a rolled copy: the regions of every trip count through a loop, merged;
        # emitted as TF's symbolic gradient through the While. The loop's first trip's nodes
        # (its key in ``TraceGraph.trips``), else None
        self.rolled = None
        # what a node of the same op, issued from the same call stack, shares with it in
        # every trip of a loop (its key but the occurrence)
        self.stack_key = (kind, self.op_type, opdefs.key_attrs(self.attrs),
                          self.site[0] if self.site else None)

    @property
    def key(self):
        return _key(self)

    def __repr__(self):
        return f"%{self.id}"

    def format(self) -> str:
        attrs = ", ".join(f"{k}={_short(v)}" for k, v in self.attrs if k not in ("T", "dtype")) \
            if self.kind == NodeKind.OP else ""
        args = ", ".join(str(s) for s in self.inputs)
        extra = []
        if not self.in_graph and self.kind == NodeKind.OP:
            extra.append("python")
        if self.fetched:
            extra.append(f"fetch={sorted(self.fetched)}")
        if self.escaped:
            extra.append(f"escape={sorted(self.escaped)}")
        if self.kind in (NodeKind.GRAD, NodeKind.LOOP):
            extra.append(f"body={self.body_len}")
        if self.kind == NodeKind.LOOP:  # its inputs: the values its first rolled trip reads
            extra.append(f"trips={'|'.join(map(str, self.counts))} peeled={self.peeled}")
        where = f"  # {_where(self.location)}" if self.location else ""
        succ = " -> " + ", ".join(repr(s) for s in self.succs) if len(self.succs) > 1 else ""
        tags = f" [{' '.join(extra)}]" if extra else ""
        head = f"{self.op_type}[{attrs}]" if attrs else self.op_type
        return f"%{self.id} = {head}({args}){tags}{succ}{where}"


def _short(v):
    s = repr(v)
    return s if len(s) <= 24 else s[:21] + "..."


def _where(loc):
    return f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}"


def _in_shapes(rec, records):
    shapes = []
    for ref in rec.inputs:
        if ref[0] == "same":
            ref = records[ref[1]].inputs[ref[2]]
        if ref[0] == "op":
            shapes.append(records[ref[1]].out_specs[ref[2]][0])
        else:
            shapes.append(ref[1]._shape_tuple())
    return tuple(shapes)


def _key(n):
    """What a node and a record must share to match (paper §3.2.2): type, attributes and
    executed location."""
    return (n.kind if isinstance(n.kind, NodeKind) else NodeKind(n.kind), n.op_type,
            opdefs.key_attrs(n.attrs), n.site)


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

    def _count_repeats(self, records):
        """Note, per user line, how many times the ops issued there ran in this trace: the
        largest occurrence of any call stack at that line (gradient bodies aside: they share
        their call's site)."""
        trips = {}
        i = 0
        while i < len(records):
            rec = records[i]
            if rec.kind == "op" and rec.site is not None and rec.location is not None:
                trips[rec.location] = max(trips.get(rec.location, 0), rec.site[1] + 1)
            i += 1 + (rec.body_len if rec.kind == "grad" else 0)
        for location in self.repeats.keys() | trips.keys():
            self.repeats.setdefault(location, set()).add(trips.get(location, 0))

    def _note_trips(self, path):
        """Find the loops in one trace's path: runs of ops whose call stacks and types repeat
        with a period (:func:`periodic_runs`); note the nodes of each trip."""
        keys = [n.stack_key if n.kind is NodeKind.OP and not n.in_body and n.site else object()
                for n in path]
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
        if node.key != _key(rec) or len(node.inputs) != len(rec.inputs):
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
                folded = records[i].kind == "grad" and _key(records[i]) in any_path
                # back from a fresh region, or along a known edge reading what one computed
                joins_fresh = unit is not None and (cur in fresh or unit[0][0] in cur.succs and any(
                    ref[0] in ("op", "same") and trace.nodes[ref[1]] in fresh
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
            if rec.kind == "grad":
                node.results = [_resolve_result(r, rec_nodes) for r in rec.results]
                node.observations.append(_observation(records, i, rec_nodes))
                node.taped = node.taped and _taped(records, i)
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
        if rec.kind != "grad":
            return [node], [node]
        if node.cone != _cone(records, i, trace.nodes):
            return None
        body = self._match_body(node, records, i, trace)
        return None if body is None else ([node] + body[0], [node] + body[1])

    def _merge_back(self, cur, records, i, trace):
        """A node that is not a successor of ``cur`` but fits records ``i...`` (joining
        inputs where the new producer ran last), and from which ``cur`` is not reachable."""
        for node in self._by_key.get(_key(records[i]), ()):
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
        for j in range(i, i + 1 + (rec.body_len if rec.kind == "grad" else 0)):
            node = self._add(records[j], mapped)
            node.in_body = j > i
            if unit:
                self.link(unit[-1], node)
            unit.append(node)
            mapped.append(node)
        if rec.kind == "grad":
            unit[0].cone = _cone(records, i, trace.nodes)
        self._by_key.setdefault(unit[0].key, []).append(unit[0])
        return unit, unit

    def _add(self, rec, rec_nodes):
        node = self._new_node(NodeKind(rec.kind), rec)
        # An op run in Python for real may take any handle: its outputs are fed to the graph
        # and validated there, and a fresh tf.data iterator per epoch must not split it.
        handle = "resource" if rec.kind == "op" and not rec.in_graph else "var"
        for ref in rec.inputs:
            if ref[0] == "op":
                node.inputs.append(Slot("node", rec_nodes[ref[1]], ref[2]))
            elif ref[0] == "var":
                node.inputs.append(Slot(handle, tensor=ref[1]))
            elif ref[0] == "same":
                node.inputs.append(Slot("same", rec_nodes[ref[1]], ref[2]))
            else:
                node.inputs.append(Slot.external(ref[1]))
        return node

    @staticmethod
    def _observe(node, rec):
        """Fold the external values of one more observation into the slots' classes."""
        for slot, ref in zip(node.inputs, rec.inputs):
            if ref[0] == "ext":
                slot.observe(ref[1])

    @staticmethod
    def _absorb(node, rec, records):
        """Fold what one observation of ``node`` adds: shapes, fetches, escapes."""
        sig = _in_shapes(rec, records)
        if node.sigs.setdefault(sig, rec.out_specs) != rec.out_specs:
            node.sigs[sig] = rec.out_specs
            node.data_dependent = True  # same input shapes, new output shapes
        node.out_specs = rec.out_specs
        relaxed = node.out_relaxed
        node.out_relaxed = [spec[0] for spec in rec.out_specs] if relaxed is None else \
            [relax(a, spec[0]) for a, spec in zip(relaxed, rec.out_specs)]
        node.fetched |= rec.fetched
        node.escaped |= rec.escaped
        if rec.kind == "grad":
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


def region_body(head):
    """The backward ops of the gradient region ``head`` (a loop node's body), in the graph's
    order: the chain of ``body_len`` nodes after it."""
    body, n = [], head
    for _ in range(head.body_len):
        n = n.succs[0]
        body.append(n)
    return body


def result_structure(region):
    """What regions of one call made one must share: per source, None, or the result's kind
    and which of its parts are None."""
    return tuple(None if r is None else (r[0], tuple(q is None for q in r[1:]))
                 for r in region.results)


def result_map(region, kept):
    """``(node, out)`` of each result of the gradient region ``region`` -> the same result of
    ``kept``, for regions of one call made one."""
    return {part: part_kept for r, r_kept in zip(region.results, kept.results, strict=True)
            for part, part_kept in zip((r or ())[1:], (r_kept or ())[1:]) if part is not None}


def periodic_runs(keys):
    """The loops in a sequence of keys: ``[(start, period, count)]`` for each maximal run
    ``keys[start:start + count * period]`` made of ``count >= 2`` repeats of its first
    ``period`` keys, where ``period`` is the distance to the next occurrence of
    ``keys[start]``. A key is an op's type, attributes and call stack: the same key again
    means the same code issued again, which only a loop does. Runs do not overlap; an outer
    loop whose inner loop ran the same trips each time is found whole, otherwise its inner
    loops are."""
    following = [None] * len(keys)
    last = {}
    for i in range(len(keys) - 1, -1, -1):
        following[i] = last.get(keys[i])
        last[keys[i]] = i
    runs = []
    i = 0
    while i < len(keys):
        j = following[i]
        if j is None:
            i += 1
            continue
        period, count = j - i, 1
        pattern = keys[i:j]
        while keys[i + count * period:i + (count + 1) * period] == pattern:
            count += 1
        if count >= 2:
            runs.append((i, period, count))
            i += count * period
        else:
            i += 1
    return runs


# (op type, input index) of inputs that are data to every gradient function of the op's
# type: none computes a value from them in Python (a ``Shape`` reads only the shape). A tiny
# batch's labels (eight int32s) are such a value; were its values part of the signature,
# every batch would be a new one.
DATA_INPUTS = frozenset({
    ("Shape", 0), ("Size", 0), ("Rank", 0),
    ("SparseSoftmaxCrossEntropyWithLogits", 1), ("Cast", 0), ("OneHot", 0),
    ("GatherV2", 1), ("ResourceGather", 1), ("Equal", 0), ("Equal", 1), ("NotEqual", 0),
    ("NotEqual", 1), ("Less", 0), ("Less", 1), ("Greater", 0), ("Greater", 1),
})


def signature_part(t, op_type=None, index=None):
    """What an external input (input ``index`` of an ``op_type``) contributes to an
    iteration's signature: its shape, and its value if it is a tiny integer (a size, an
    index) that a gradient function may compute from, as bytes. Shapes are integers: a float
    fed every step (a noise scale, a loss read back) does not make every signature new."""
    if t._num_elements() <= ONCE_CONST and (t.dtype.is_integer or t.dtype == dtypes.bool) \
            and (op_type, index) not in DATA_INPUTS:
        return t._shape_tuple(), t._numpy_internal().tobytes()
    return t._shape_tuple(), None


def _observation(records, i, nodes):
    """See ``TraceNode.observations``: what the gradient call at record ``i`` saw."""
    before = []
    for j in range(i):
        before += [(nodes[j], k, signature_part(ref[1], records[j].op_type, k))
                   for k, ref in enumerate(records[j].inputs) if ref[0] == "ext"]
        before.append((nodes[j], None, tuple(spec[0] for spec in records[j].out_specs)))
    body = {}
    for j in range(i + 1, i + 1 + records[i].body_len):
        for k, ref in enumerate(records[j].inputs):
            if ref[0] == "ext" and ref[1]._num_elements() <= SMALL_CONST:
                body[(nodes[j], k)] = np.array(ref[1]._numpy_internal())
    return before, body


def _cone(records, i, nodes):
    """The forward pass a gradient region differentiates: for the gradient call (record
    ``i``) and every op its target was computed from, where each input came from, as
    ``{(node or None for the call, input index): (ref kind, producer node, out)}``.

    The PythonRunner skips a region's ops, so it cannot see that they read what this
    iteration computed. Two iterations whose forward passes join before the gradient call
    (an if/else) reach one call node with the same inputs, but need different regions: a
    region matches only where its cone is the same, and the PythonRunner checks the cone's
    joined (phi) inputs took the recorded producer."""
    cone = {}
    seen = set()
    stack = [(None, records[i])]
    while stack:
        node, rec = stack.pop()
        for k, ref in enumerate(rec.inputs):
            if ref[0] in ("op", "same"):
                cone[(node, k)] = (ref[0], nodes[ref[1]], ref[2])
                if ref[0] == "op" and ref[1] not in seen:
                    seen.add(ref[1])
                    stack.append((nodes[ref[1]], records[ref[1]]))
    return cone


def _taped(records, i):
    """Whether every forward op that links a source of the gradient call at record ``i`` to
    its target ran while the call's tape was recording: not before it was entered, not in
    another gradient region (a gradient of gradients), not after the tape exited; and no
    custom gradient (``tf.custom_gradient``) was put on the tapes before the call."""
    rec = records[i]
    if rec.after_custom:  # the tape holds a backward function the graph's ops do not have
        return False
    n_target, n_sources = rec.attrs[1], rec.attrs[2]
    sources = rec.inputs[n_target:n_target + n_sources]
    handles = {id(r[1]) for r in sources if r[0] == "var"}
    source_ops = {r[1] for r in sources if r[0] == "op"}
    enter = max((j for j in range(i) if records[j].kind == "mark" and
                 records[j].op_type == "enter" and records[j].attrs == rec.attrs[0]),
                default=None)
    if enter is None:
        return False
    window_end = next((j for j in range(enter, i) if records[j].kind == "mark" and
                       records[j].op_type == "exit" and records[j].attrs == rec.attrs[0]), i)
    in_body = set()
    for j in range(i):
        if records[j].kind == "grad":
            in_body.update(range(j + 1, j + 1 + records[j].body_len))
    reached = []  # per record before the call: whether a source reaches it
    for j in range(i):
        reached.append(j in source_ops or any(
            r[0] == "var" and id(r[1]) in handles or r[0] == "op" and reached[r[1]]
            for r in records[j].inputs))
    stack, seen = [r[1] for r in rec.inputs[:n_target] if r[0] == "op"], set()
    while stack:
        j = stack.pop()
        if j in seen or j in source_ops:
            continue
        seen.add(j)
        if reached[j] and (j < enter or j > window_end or j in in_body):
            return False
        stack.extend(r[1] for r in records[j].inputs if r[0] == "op")
    return True


def _resolve_result(r, rec_nodes):
    if r is None:
        return None
    return (r[0],) + tuple(None if ref is None else (rec_nodes[ref[1]], ref[2]) for ref in r[1:])


