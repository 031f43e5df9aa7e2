"""Loop nodes on hand-written traces: how ``TraceGraph.merge`` finds a loop's trips, and how
``terra.loops.roll`` rolls the trips of one that ran a varying number of times into a loop
node (paper §3.2.2, Figure 3.2(c)), or leaves it unrolled."""

import numpy as np
import tensorflow as tf
from test_tracegraph import at, ext, figure_3_2_trace, op_at

from terra.case_assignment import assign_cases
from terra.loops import roll
from terra.nodes import FUNCTION_TOKEN, NodeKind, OpRef, SlotKind, VarRef
from terra.trace import OpRecord
from terra.trace_queries import periodic_runs
from terra.tracegraph import TraceGraph


def test_periodic_runs_are_the_repeats_of_a_key_until_the_pattern_breaks():
    assert periodic_runs(list("xabcabcabcy")) == [(1, 3, 3)]
    assert periodic_runs(list("xabababcdcdz")) == [(1, 2, 3), (7, 2, 2)]
    assert periodic_runs(list("aXbaYb")) == []  # "a" recurs, but the trip differs
    assert periodic_runs(list("abcd")) == []


def test_figure_3_2_the_loop_becomes_a_loop_node_after_its_first_trip():
    g = TraceGraph()
    for true_path, trips in [(True, 2), (False, 1), (True, 3)]:
        g.merge(figure_3_2_trace(true_path, trips))
    rolled, loops = roll(g)
    rolled.lint()
    [loop] = loops
    assert [n.kind for n in rolled.nodes].count(NodeKind.LOOP) == 1, str(rolled)
    assert (loop.counts, loop.peeled, loop.body_len) == ((1, 2, 3), 1, 1), loop.format()
    peeled, [body] = loop.preds, loop.succs
    assert [p.op_type for p in peeled] == ["Op4"] and peeled[0].succs == [loop], str(rolled)
    # the body reads the peeled trip's x3 first, then its own of the previous trip
    assert body.inputs[0].alts == [(peeled[0], 0), (body, 0)], str(rolled)
    assert body.loop is loop and body.succs == [rolled.end], str(rolled)
    assert loop.carried == [(body, 0)] and loop.inputs[0].alts == [(peeled[0], 0)]
    # the TraceGraph itself keeps a node per trip, for later merges
    assert len([n for n in g.nodes if n.op_type == "Op4"]) == 3, str(g)
    # case assignment takes the loop node and its body as one unit: one block, no branch
    # after the peeled trip
    exit_of = {loop: body}
    cases = assign_cases(rolled.start, rolled.end, lambda n: exit_of.get(n, n).succs)
    [block] = [case.block for sc in cases for case in sc.cases if loop in case.block]
    assert block[block.index(loop) - 1] is peeled[0], cases


def loop_trace(trips, per_trip=lambda t: ()):
    """``y = Neg(x)``; ``for t in range(trips): y = Op4(y, *per_trip(t))``; ``Exp(y)``."""
    recs = [op_at(at(1), "Neg", ext(np.ones((4, 3))))]
    for t in range(trips):
        recs.append(op_at(at(2, t), "Op4", OpRef(len(recs) - 1, 0), *per_trip(t)))
    recs.append(op_at(at(3), "Exp", OpRef(len(recs) - 1, 0)))
    return recs


def merged(*traces):
    g = TraceGraph()
    for trace in traces:
        g.merge(trace)
    return g


def test_the_same_trip_count_in_every_trace_stays_unrolled():
    g = merged(loop_trace(3), loop_trace(3))
    assert roll(g) == (g, {}), "unrolled, as the paper's optimization says"


def test_a_constant_that_changes_from_trip_to_trip_is_fed_at_every_trip():
    def per_trip(t):
        return [ext([float(t), 1.0]), ext([5.0, 5.0])]

    rolled, loops = roll(merged(loop_trace(2, per_trip), loop_trace(4, per_trip)))
    [loop] = loops
    [body] = loop.succs
    assert [s.kind for s in body.inputs] == [SlotKind.NODE, SlotKind.FEED, SlotKind.CONST], \
        str(rolled)
    assert body.inputs[1].shape == (2,) and body.inputs[1].dtype == tf.float32.as_datatype_enum
    exp = next(n for n in rolled.nodes if n.op_type == "Exp")
    # after the loop: whichever ran last of the last peeled trip and the body
    assert exp.inputs[0].alts == [(loop.preds[0], 0), (body, 0)], str(rolled)


def test_trips_that_read_different_variables_stay_unrolled():
    w = [tf.Variable(tf.ones((3, 3))) for _ in range(3)]

    def per_trip(t):
        return [VarRef(w[t].handle)]

    g = merged(loop_trace(2, per_trip), loop_trace(3, per_trip))
    assert g.trips, "the trips were found"
    assert roll(g) == (g, {})


def test_a_trip_reading_two_trips_back_stays_unrolled():
    def trace(trips):
        recs = loop_trace(trips)
        for t in range(2, trips):  # Op4 of trip t reads Op4 of trip t - 2
            recs[1 + t].inputs = [OpRef(t - 1, 0)]
        return recs

    g = merged(trace(2), trace(4))
    assert g.trips and roll(g) == (g, {})


def sliced_loop_trace(trips):
    """``y = Neg(x)``; ``for t in range(trips): y = Op4(y[t])``, the slice a TF function's
    region (``terra.function_regions``): a call mark (its integer ``t`` is no attr), the op, a
    return mark, numbered on one call stack as ``terra.location`` numbers them; ``Exp(y)``."""
    def mark(where, what, attrs, producer):
        rec = OpRecord(NodeKind.MARK, what, attrs, [OpRef(producer, 0)], (), None)
        rec.location, rec.site = where
        return rec

    call = ("Tensor.__getitem__", FUNCTION_TOKEN, (("tuple", ("t", "i")), ()), None,
            ("t",), ())
    recs = [op_at(at(1), "Neg", ext(np.ones((4, 3))))]
    last = 0
    for t in range(trips):
        recs.append(mark(at(2, 3 * t), "call", call, last))
        recs.append(op_at(at(2, 3 * t + 1), "Op4", OpRef(last, 0)))
        last = len(recs) - 1
        recs.append(mark(at(2, 3 * t + 2), "return", ("return", FUNCTION_TOKEN), last))
    recs.append(op_at(at(3), "Exp", OpRef(last, 0)))
    return recs


def test_a_loop_whose_trips_hold_function_marks_rolls_without_them():
    g = merged(sliced_loop_trace(2), sliced_loop_trace(4))
    rolled, loops = roll(g)
    rolled.lint()
    [loop] = loops
    assert loop.body_len == 1 and loop.peeled == 2, loop.format()
    # the While's body is the slice's op alone; the peeled trips lost their marks too
    assert not any(n.kind is NodeKind.MARK and n.op_type in ("call", "return")
                   for n in rolled.nodes), str(rolled)
    # the TraceGraph keeps them for later merges
    assert sum(n.op_type == "call" for n in g.nodes) == 4, str(g)
    # a loop that ran the same trips in every trace is not rolled and keeps its marks
    same = merged(sliced_loop_trace(3), sliced_loop_trace(3))
    assert roll(same) == (same, {})
