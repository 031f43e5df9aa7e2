"""``terra.regions.fold`` on hand-written traces: the gradient regions one call got for each
forward path become one region, on a copy; the TraceGraph keeps them apart."""

import numpy as np
from test_tracegraph import at, ext, grad_head, op_at

from terra import regions
from terra.nodes import NodeKind, OpRef
from terra.trace import OpRecord
from terra.tracegraph import TraceGraph


def trace(branch_line, op_type, taped=True):
    """``with tape: h = <op_type>(x)`` (at ``branch_line``); ``loss = Square(h)``;
    ``g = tape.gradient(loss, ...)`` (its backward op: ``Neg``); ``Mul(g, g)`` after it."""
    enter = OpRecord(NodeKind.MARK, "enter", (), [], (), at(1)[0])
    enter.site = at(1)[1]
    recs = [enter] if taped else []
    first = len(recs)
    recs += [op_at(at(branch_line), op_type, ext(np.ones((4, 3)))),
             op_at(at(10), "Square", OpRef(first, 0))]
    head = grad_head(1, OpRef(first + 1, 0))
    head.location, head.site = at(11)
    body = op_at(at(11), "Neg", OpRef(first + 1, 0))
    head.results = [("t", OpRef(first + 3, 0))]
    recs += [head, body, op_at(at(12), "Mul", OpRef(first + 3, 0), OpRef(first + 3, 0))]
    return recs


def merged(*traces):
    g = TraceGraph()
    for t in traces:
        g.merge(t)
    g.lint()
    return g


def grads(g):
    return [n for n in g.nodes if n.kind is NodeKind.GRAD]


def test_the_regions_of_one_call_become_one_on_a_copy():
    g = merged(trace(5, "Tanh"), trace(7, "Sigmoid"), trace(5, "Tanh"), trace(7, "Sigmoid"))
    assert len(grads(g)) == 2, str(g)
    assert regions.fold(g, calls=set()) is g  # only calls that keep falling back fold
    folded = regions.fold(g, {grads(g)[0].key})
    folded.lint()
    [head] = grads(folded)
    assert regions.folded(head), head.format()
    assert head.observations == []  # TF's symbolic gradient: nothing fed to the backward ops
    [mul] = [n for n in folded.nodes if n.op_type == "Mul"]
    [neg] = [n for n in folded.nodes if n.op_type == "Neg"]
    assert head.results == [("t", (neg, 0))], head.results
    # the op after the call reads the one region's result, and follows it
    assert mul.inputs[0].alts == [(neg, 0)] and mul.preds == [neg], str(folded)
    assert head.preds == [n for n in folded.nodes if n.op_type == "Square"], str(folded)
    # the call reads either path's loss; the TraceGraph itself is unchanged
    assert len(head.inputs[0].alts) == 1 and head.inputs[0].alts[0][0].op_type == "Square"
    assert len(grads(g)) == 2 and not any(regions.folded(n) for n in grads(g)), str(g)


def test_regions_kept_apart_when_asked_or_not_taped():
    g = merged(trace(5, "Tanh"), trace(7, "Sigmoid"))
    [first, _] = grads(g)
    assert regions.fold(g, {first.key}, keep={("fold", first.id)}) is g
    untaped = merged(trace(5, "Tanh", taped=False), trace(7, "Sigmoid", taped=False))
    assert regions.fold(untaped, {grads(untaped)[0].key}) is untaped


def test_a_backward_op_read_after_the_call_keeps_the_regions_apart():
    """Only results map from a dropped region to the kept one: a backward op that something
    else reads (no result) has no counterpart, so nothing is folded."""
    def leaky(branch_line, op_type):
        recs = trace(branch_line, op_type)
        recs[-1] = op_at(at(12), "Mul", OpRef(4, 0), OpRef(4, 0))
        recs[3].results = [None]  # the Neg is not the call's result
        return recs

    g = merged(leaky(5, "Tanh"), leaky(7, "Sigmoid"))
    assert regions.fold(g, {grads(g)[0].key}) is g


def two_point_trace(sides):
    """Two branch points (lines 5/7 and 12/14) with an op between them where the paths merge
    back, ``loss = Square(h)`` and a gradient call whose region differs per combination."""
    enter = OpRecord(NodeKind.MARK, "enter", (), [], (), at(1)[0])
    enter.site = at(1)[1]
    first = {"a": (5, "Tanh"), "b": (7, "Sigmoid")}[sides[0]]
    second = {"a": (12, "Relu"), "b": (14, "Softplus")}[sides[1]]
    recs = [enter, op_at(at(first[0]), first[1], ext(np.ones((4, 3)))),
            op_at(at(10), "Neg", OpRef(1, 0)),
            op_at(at(second[0]), second[1], OpRef(2, 0)),
            op_at(at(16), "Square", OpRef(3, 0))]
    head = grad_head(1, OpRef(4, 0))
    head.location, head.site = at(17)
    head.results = [("t", OpRef(6, 0))]
    return recs + [head, op_at(at(17), "Exp", OpRef(4, 0)),
                   op_at(at(18), "Mul", OpRef(6, 0), OpRef(6, 0))]


def test_a_new_combination_of_known_branches_is_covered_once_the_call_folds():
    g = merged(*[two_point_trace(s) for s in ("aa", "bb", "aa", "bb")])
    [call] = {n.key for n in grads(g)}
    covered, _ = g.merge(two_point_trace("ab"))  # only the gradient region is new
    assert not covered
    g = merged(*[two_point_trace(s) for s in ("aa", "bb", "aa", "bb")])
    covered, _ = g.merge(two_point_trace("ab"), any_path={call})
    assert covered and len(grads(g)) == 3, str(g)  # the region is added all the same
    covered, _ = g.merge(two_point_trace("ba"), any_path={call})
    assert covered, str(g)
    g.lint()
