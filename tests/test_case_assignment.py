"""Case assignment (Algorithm 1, §3.2.2) on the paper's Figure 3.6, on small shapes, and on
thousands of random DAGs against Theorem 1: every start-to-end trace runs as a sequence of
case selections."""

import random

import pytest

from terra.case_assignment import Case, SwitchCase, assign_cases, format_switch_cases

S, E = "s", "e"  # start and end

# Figure 3.6(a), rebuilt from the text of §3.2.2 (the figure itself is an image). The text fixes
# a = s->1; b, c, d = 1->2, 1->4, 1->6 (edge c selects case 2 of the first Switch-Case, so the
# cases follow b, c, d); blocks {2,3}, {4,5}, {6}; edges g, h and i are processed together and
# node 8 waits because of edge j; the last block is {8,9}. That leaves node 7 with g = 3->7 and
# h = 5->7 (one predecessor would have chained 7 into {2,3}) and j = 7->8, i = 6->8, 9->e.
FIGURE_3_6 = {S: [1], 1: [2, 4, 6], 2: [3], 3: [7], 4: [5], 5: [7], 6: [8], 7: [8], 8: [9],
              9: [E]}


def summary(switch_cases):
    """(blocks in case order, control edges as sets, exits): control-edge order is immaterial."""
    return [([c.block for c in s.cases], [set(c.control_edges) for c in s.cases], set(s.exits))
            for s in switch_cases]


def test_figure_3_6_gives_the_switch_cases_of_the_text():
    got = assign_cases(S, E, FIGURE_3_6)
    assert summary(got) == [
        ([(1,)], [{(S, 1)}], set()),  # node 1 alone: out-degree 3 ends the chain
        ([(2, 3), (4, 5), (6,)], [{(1, 2)}, {(1, 4)}, {(1, 6)}], set()),
        ([(7,), ()], [{(3, 7), (5, 7)}, {(6, 8)}], set()),  # X: node 8 waits for edge j
        ([(8, 9)], [{(7, 8), (6, 8)}], {(9, E)}),  # edge i carried over next to j
    ], format_switch_cases(got)
    assert [s.is_switch for s in got] == [False, True, True, False]
    assert got[1].select((1, 4)) == 1  # edge c: case 2 of the first Switch-Case (1-based)
    assert got[2].select((6, 8)) == 1 and got[3].select((6, 8)) == 0
    assert got[1].select((3, 7)) is None
    assert format_switch_cases(got) == "\n".join([
        "1: {1} via s->1",
        "2: {2,3} via 1->2 | {4,5} via 1->4 | {6} via 1->6",
        "3: {7} via 3->7, 5->7 | X via 6->8",
        "4: {8,9} via 7->8, 6->8; end via 9->e",
    ])
    assert repr(got[2]) == "SwitchCase({7} via 3->7, 5->7 | X via 6->8)"


def test_successors_as_a_function_give_the_same_result():
    assert assign_cases(S, E, lambda n: FIGURE_3_6.get(n, [])) == assign_cases(S, E, FIGURE_3_6)


def test_a_straight_line_is_one_plain_block():
    got = assign_cases(S, E, {S: [1], 1: [2], 2: [3], 3: [E]})
    assert got == [SwitchCase((Case((1, 2, 3), ((S, 1),)),), ((3, E),))]
    assert not got[0].is_switch


def test_the_empty_trace_needs_no_switch_case():
    assert assign_cases(S, E, {S: [E]}) == []


def test_a_diamond():
    got = assign_cases(S, E, {S: [1], 1: [2, 3], 2: [4], 3: [4], 4: [E]})
    assert summary(got) == [
        ([(1,)], [{(S, 1)}], set()),
        ([(2,), (3,)], [{(1, 2)}, {(1, 3)}], set()),
        ([(4,)], [{(2, 4), (3, 4)}], {(4, E)}),
    ], format_switch_cases(got)


def test_nested_diamonds_carry_a_waiting_edge_over_two_switch_cases():
    # 1 branches to an inner diamond 2 -> {3, 4} -> 5 -> 6 and to 7; both branches meet at 8.
    graph = {S: [1], 1: [2, 7], 2: [3, 4], 3: [5], 4: [5], 5: [6], 6: [8], 7: [8], 8: [E]}
    got = assign_cases(S, E, graph)
    assert summary(got) == [
        ([(1,)], [{(S, 1)}], set()),
        ([(2,), (7,)], [{(1, 2)}, {(1, 7)}], set()),
        ([(3,), (4,), ()], [{(2, 3)}, {(2, 4)}, {(7, 8)}], set()),
        ([(5, 6), ()], [{(3, 5), (4, 5)}, {(7, 8)}], set()),
        ([(8,)], [{(6, 8), (7, 8)}], {(8, E)}),
    ], format_switch_cases(got)


def test_a_trace_that_ends_early_leaves_by_an_exit():
    got = assign_cases(S, E, {S: [1, E], 1: [2, E], 2: [E]})
    assert summary(got) == [([(1,)], [{(S, 1)}], {(1, E)}), ([(2,)], [{(1, 2)}], {(2, E)})]
    for path in ([S, E], [S, 1, E], [S, 1, 2, E]):
        check_trace(got, path, E)


def test_duplicate_successors_are_one_edge():
    assert assign_cases(S, E, {S: [1, 1], 1: [2, 2], 2: [E]}) == \
        assign_cases(S, E, {S: [1], 1: [2], 2: [E]})


def test_a_cycle_is_rejected():
    with pytest.raises(ValueError, match="not a DAG: nodes 2"):
        assign_cases(S, E, {S: [1], 1: [2], 2: [3], 3: [2, E]})


# --- Theorem 1 on random DAGs -------------------------------------------------------------


def random_dag(rng):
    """A DAG of 2-30 nodes with a single source S and sink E and every node on an S-E path:
    each inner node gets a predecessor earlier and a successor later in a hidden topological
    order, plus random extra edges. Labels and successor order are shuffled, so nothing can
    lean on them."""
    inner = rng.sample(range(1000), rng.randint(0, 28))
    order = [S, *inner, E]
    chainy, density = rng.random(), rng.choice((0.0, 0.05, 0.15, 0.4))
    edges = set()
    for i in range(1, len(order) - 1):
        pred = i - 1 if rng.random() < chainy else rng.randrange(i)
        edges.add((order[pred], order[i]))
        edges.add((order[i], order[rng.randrange(i + 1, len(order))]))
    for i in range(len(order) - 1):
        for j in range(i + 1, len(order)):
            if rng.random() < density:
                edges.add((order[i], order[j]))
    if not inner:
        edges.add((S, E))
    edges = list(edges)
    rng.shuffle(edges)
    succs = {n: [] for n in order}
    for u, v in edges:
        succs[u].append(v)
    return succs, order


def traces(succs, order, rng, limit=40):
    """Every S-E path if there are at most ``limit``, else ``limit`` random ones."""
    count = {E: 1}
    for n in reversed(order[:-1]):
        count[n] = sum(count[v] for v in succs[n])
    if count[S] > limit:
        for _ in range(limit):
            path = [S]
            while path[-1] != E:
                path.append(rng.choice(succs[path[-1]]))
            yield path
        return
    stack = [[S]]
    while stack:
        path = stack.pop()
        if path[-1] == E:
            yield path
        else:
            stack.extend(path + [v] for v in succs[path[-1]])


def check_trace(switch_cases, path, end):
    """Run ``path`` through the switch-cases as the two runners would (Definition 5): in each
    switch-case exactly one path edge is a control edge, and it selects the block that runs the
    path's next nodes; after an exit into ``end`` no later switch-case has a path edge."""
    path_edges = set(zip(path, path[1:]))
    pos, ended = 1, path[1] == end
    for i, s in enumerate(switch_cases):
        taken = {e for c in s.cases for e in c.control_edges} & path_edges
        where = f"switch-case {i + 1} on trace {path}"
        if ended:
            assert not taken, where
            continue
        edge = (path[pos - 1], path[pos])
        assert taken == {edge}, where
        block = s.cases[s.select(edge)].block
        assert list(block) == path[pos:pos + len(block)], where
        pos += len(block)
        if block and path[pos] == end:
            assert (path[pos - 1], end) in s.exits, where
            ended = True
    assert ended and pos == len(path) - 1, f"trace {path} not run to the end"


def check_structure(switch_cases, succs, order):
    """Definitions 2 and 3, maximal chains, every node in exactly one block, and every edge
    accounted for: each in-chain edge and each exit once, control edges (repeated while their
    node waits) and the edge S->E."""
    preds = {n: [u for u in order if n in succs[u]] for n in order}
    blocks = [c.block for s in switch_cases for c in s.cases if c.block]
    assert sorted(n for b in blocks for n in b) == sorted(order[1:-1])
    control, once = set(), [(S, E)] if E in succs[S] else []
    for s in switch_cases:
        edges = [e for c in s.cases for e in c.control_edges]
        assert len(edges) == len(set(edges)), "cases of a switch-case share a control edge"
        control.update(edges)
        once += s.exits
        for c in s.cases:
            target = c.block[0] if c.block else c.control_edges[0][1]
            assert c.control_edges and all(v == target for _, v in c.control_edges)
    for b in blocks:
        for u, v in zip(b, b[1:]):
            assert succs[u] == [v] and preds[v] == [u], f"block {b} is not a linear chain"
            once.append((u, v))
        nxt = succs[b[-1]]
        assert len(nxt) != 1 or nxt[0] == E or len(preds[nxt[0]]) > 1, f"{b} could grow"
        prv = preds[b[0]]
        assert len(prv) != 1 or prv[0] == S or len(succs[prv[0]]) > 1, f"{b} could grow back"
    assert len(once) == len(set(once)) and not control & set(once)
    assert control | set(once) == {(u, v) for u in order for v in succs[u]}


def test_theorem_1_on_random_dags():
    rng = random.Random(20240521)
    shapes = {"switch": 0, "waiting": 0, "early exit": 0}
    for _ in range(2000):
        succs, order = random_dag(rng)
        got = assign_cases(S, E, succs)
        try:
            check_structure(got, succs, order)
            for path in traces(succs, order, rng):
                check_trace(got, path, E)
        except AssertionError as err:
            raise AssertionError(f"{err}\ngraph {succs}\n{format_switch_cases(got)}") from None
        shapes["switch"] += any(s.is_switch for s in got)
        shapes["waiting"] += any(not c.block for s in got for c in s.cases)
        shapes["early exit"] += len([s for s in got if s.exits]) > 1
    assert min(shapes.values()) > 200, shapes  # the generator reaches every interesting shape
