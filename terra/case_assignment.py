"""Case assignment: a TraceGraph cut into an ordered list of switch-cases (paper §3.2.2,
Algorithm 1, Theorem 1, Figures 3.6-3.7).

The GraphGenerator emits one Switch-Case operation per switch-case (a plain sequence when it has
a single case) and the PythonRunner tells the graph which case to run by the control edge it
took. This module is the pure graph part: it knows nothing of TensorFlow nor of the TraceGraph
class. A graph is a start node, an end node and the successors of each node; nodes are any
hashable objects (a loop node is just a node: it becomes one While operation) and an edge is a
``(u, v)`` pair. For a TraceGraph, ``assign_cases(g.start, g.end, lambda n: n.succs)``. The
TraceGraph of Figure 3.6(a) (``s`` = start, ``e`` = end) gives, by ``format_switch_cases``::

    1: {1} via s->1
    2: {2,3} via 1->2 | {4,5} via 1->4 | {6} via 1->6
    3: {7} via 3->7, 5->7 | X via 6->8
    4: {8,9} via 7->8, 6->8; end via 9->e

How a trace runs (Definition 5 and Theorem 1): it walks the switch-cases in order. At each one
exactly one of its edges is a control edge; that edge selects the case whose block it runs next
(an empty block ``X`` runs nothing, and the same edge then selects again in a later
switch-case). When the trace leaves a block by an edge into ``end``, that edge is one of the
switch-case's ``exits`` and the trace skips every later switch-case.

``exits`` is our addition. The paper's algorithm drops the edges into ``end`` and its
Definition 5 asks every trace to select a case in every switch-case, which a trace that ends
early cannot do (say ``if step % 100 == 0: log()`` as the last statement: the trace without the
log ends where the other continues). Whoever builds the graph needs to know where a trace may
stop, or it would run a later single-case "plain sequence" that the trace never reached. The
only edge into ``end`` that is in no ``exits`` is ``(start, end)``, the empty trace.
"""

from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass

Node = Hashable
Edge = tuple[Node, Node]


@dataclass(frozen=True, repr=False)
class Case:
    """One case of a switch-case (Definition 3).

    ``block`` is a linear chain (Definition 2) that runs as a whole: each node but the last
    has one successor, each but the first one predecessor, and it cannot be extended either
    way. It is empty (the ``X`` of Figure 3.7) when its node still waits for an edge from a node
    not placed yet; the case then only carries ``control_edges`` over to a later switch-case.
    ``control_edges`` are the edges into the block's first node (or into the waiting node) by
    which a trace selects this case."""

    block: tuple[Node, ...]
    control_edges: tuple[Edge, ...]

    def __repr__(self):
        block = "{" + ",".join(str(n) for n in self.block) + "}" if self.block else "X"
        return f"{block} via {_edges(self.control_edges)}"


@dataclass(frozen=True, repr=False)
class SwitchCase:
    """Mutually exclusive cases (Definition 3: blocks and control edges pairwise disjoint),
    and the ``exits``: edges into ``end`` from the last node of one of its blocks."""

    cases: tuple[Case, ...]
    exits: tuple[Edge, ...] = ()

    @property
    def is_switch(self) -> bool:
        """Whether a Switch-Case operation is needed; one case is a plain sequence (§3.2.2)."""
        return len(self.cases) > 1

    def select(self, edge: Edge) -> int | None:
        """The index (from 0, as ``tf.switch_case``) of the case ``edge`` selects, or None
        when ``edge`` is no control edge here."""
        for i, case in enumerate(self.cases):
            if edge in case.control_edges:
                return i
        return None

    def __str__(self):
        cases = " | ".join(repr(c) for c in self.cases)
        return f"{cases}; end via {_edges(self.exits)}" if self.exits else cases

    def __repr__(self):
        return f"SwitchCase({self})"


def assign_cases(start: Node, end: Node,
                 successors: Callable[[Node], Iterable[Node]] | Mapping[Node, Iterable[Node]]
                 ) -> list[SwitchCase]:
    """Algorithm 1: the ordered switch-cases that cover every start-to-end trace (Theorem 1).

    ``successors`` maps a node to its successors, as a function or a mapping (a node missing
    from the mapping has none). Nodes not reachable from ``start`` are not part of the graph.
    The result is deterministic: cases follow the successor order, so the same graph always
    gives the same case indices.

    Each round takes the edges leaving the nodes placed so far (``next_edges``: the proof of
    Theorem 1 shows it is the cut between placed and unplaced nodes), groups them by target
    and makes one case per target. If every edge into the target is in the cut, the target
    starts a block grown along the longest linear chain; otherwise an unplaced node still leads
    to it, so the case is empty and its edges stay in the cut for the next round. In a DAG some
    target is always ready; a round that places nothing means a cycle: ValueError."""
    succs = _successor_lists(start, end, successors)
    indegree = Counter(v for vs in succs.values() for v in vs)
    switch_cases = []
    next_edges = [(start, v) for v in succs[start] if v != end]
    while next_edges:
        control_edges: dict[Node, list[Edge]] = {}
        for edge in next_edges:
            control_edges.setdefault(edge[1], []).append(edge)
        cases, exits, next_edges = [], [], []
        for v, edges in control_edges.items():
            if indegree[v] > len(edges):
                cases.append(Case((), tuple(edges)))
                next_edges += edges
                continue
            block = [v]
            while len(succs[v]) == 1 and (w := succs[v][0]) != end and indegree[w] == 1:
                block.append(w)
                v = w
            cases.append(Case(tuple(block), tuple(edges)))
            next_edges += [(v, w) for w in succs[v] if w != end]
            exits += [(v, end)] if end in succs[v] else []
        if not any(c.block for c in cases):
            waiting = ", ".join(str(c.control_edges[0][1]) for c in cases)
            raise ValueError(f"not a DAG: nodes {waiting} wait for each other (a cycle)")
        switch_cases.append(SwitchCase(tuple(cases), tuple(exits)))
    return switch_cases


def format_switch_cases(switch_cases: list[SwitchCase]) -> str:
    """One line per switch-case, numbered from 1 as in Figure 3.6(b)."""
    return "\n".join(f"{i}: {s}" for i, s in enumerate(switch_cases, 1))


def _edges(edges):
    return ", ".join(f"{u}->{v}" for u, v in edges)


def _successor_lists(start, end, successors):
    """Successors of every node reachable from ``start``, duplicates dropped (E is a set of
    edges, Definition 1) so that in-degrees count edges. ``end`` is a sink by definition."""
    if isinstance(successors, Mapping):
        mapping = successors
        successors = lambda n: mapping.get(n, ())
    succs: dict[Node, tuple[Node, ...]] = {}
    stack = [start]
    while stack:
        n = stack.pop()
        if n in succs:
            continue
        succs[n] = () if n == end else tuple(dict.fromkeys(successors(n)))
        stack.extend(succs[n])
    return succs
