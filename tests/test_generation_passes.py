"""Generation's named passes one at a time, on hand-written traces (``terra.graph_builder``):
each is a function of what the passes before it made, so each is run alone here."""

import numpy as np
import pytest
from test_graph_builder import graph_of, trace
from test_tracegraph import at, ext, op_at

from terra import graph_builder
from terra.emitter import EmissionError
from terra.nodes import ExtRef, NodeKind, OpRef
from terra.plan import link, plan_steps, switch_case_channels
from terra.trace import OpRecord
from terra.tracegraph import TraceGraph


def merged(*traces):
    g = TraceGraph()
    for t in traces:
        g.merge(t)
    return g


def planned(g):
    """The passes up to ``link``: the plan's steps, wired."""
    start, steps = plan_steps(g)
    cases, puts = switch_case_channels(g)
    link(g, start, steps, puts, conds={})
    return start, steps, cases


def by_type(steps):
    return {node.op_type: step for node, step in steps.items()}


def test_plan_steps_makes_a_step_per_node_and_link_wires_the_branch():
    g = merged(trace(5, "Abs"), trace(7, "Square"))
    start, steps, cases = planned(g)
    s = by_type(steps)
    assert set(s) == {"Neg", "Abs", "Square", "Exp"}
    assert [n.node.op_type for n in start.next] == ["Neg"]
    assert {n.node.op_type for n in s["Neg"].next} == {"Abs", "Square"}
    # both branches go on to the one Exp, and the edge out of Neg selects the case
    assert s["Abs"].next == s["Square"].next == [s["Exp"]]
    assert sorted(k for puts in s["Neg"].puts for _, k in puts) == [0, 1]
    assert sum(channel is not None for _, channel, _ in cases) == 1


def test_mark_varying_shapes_flags_what_a_varying_feed_reaches():
    g = merged(trace(5, "Abs", rows=4), trace(5, "Abs", rows=6))
    _, steps = plan_steps(g)
    varying = graph_builder.mark_varying_shapes(g, steps)
    assert {n.op_type for n in varying} == {"Neg", "Abs", "Exp"}
    assert all(step.check_shapes for step in steps.values())
    g = merged(trace(5, "Abs"), trace(5, "Abs"))
    _, steps = plan_steps(g)
    assert not graph_builder.mark_varying_shapes(g, steps)


def test_feeds_and_fetches_gives_each_fed_input_a_channel():
    g = merged(trace(5, "Abs", value=1.0), trace(5, "Abs", value=2.0))
    _, steps, _ = planned(g)
    wanted, phi_of, slots, unseen = graph_builder.feeds_and_fetches(steps, symbolic=set())
    s = by_type(steps)
    assert [c is not None for c in s["Neg"].feed] == [True]  # x changes: fed
    assert all(c is None for step in (s["Abs"], s["Exp"]) for c in step.feed)
    assert not wanted and not phi_of and not slots and not unseen
    assert all(c is None for step in steps.values() for c in step.fetch)  # emission's part


def test_gradient_regions_keeps_a_region_recorded_where_nothing_is_fed():
    from test_tracegraph import grad_head, op

    x = ext(np.ones((4, 3)))
    recs = [op("Square", x), grad_head(1, OpRef(0, 0), x), op("Mul", OpRef(0, 0), x)]
    g = merged(recs, recs)
    _, steps, cases = planned(g)
    assert graph_builder.gradient_regions(steps, cases, frozenset(), varying=set()) == set()


def test_gradient_regions_are_symbolic_where_the_forward_shapes_may_be_new():
    """The recorded backward ops read values the traces agreed on; where the forward op may
    take shapes no trace had, TF's gradient computes them at run time instead."""
    from test_tracegraph import HERE, grad_head, op

    x = ext(np.ones((4, 3)))
    head = grad_head(1, OpRef(1, 0), x)
    head.results = [("t", OpRef(3, 0))]
    recs = [OpRecord(NodeKind.MARK, "enter", (), [], (), HERE), op("Square", x), head,
            op("Mul", OpRef(1, 0), x)]
    g = merged(recs, recs)
    _, steps, cases = planned(g)
    square = next(node for node in steps if node.op_type == "Square")
    grad = next(node for node in steps if node.kind is NodeKind.GRAD)
    assert graph_builder.gradient_regions(steps, cases, frozenset(), varying=set()) == set()
    assert graph_builder.gradient_regions(steps, cases, frozenset(), varying={square}) == {grad}


def test_an_error_while_emitting_names_the_node_and_the_users_line():
    import tensorflow as tf

    x = ExtRef(tf.constant(np.ones((4, 3), np.int32)))
    bad = [op_at(at(11), "Neg", x)]  # recorded as giving float32: the graph's op gives int32
    bad[0].fetched.add(0)
    g = merged(bad, bad)
    with pytest.raises(EmissionError) as raised:
        graph_builder.generate(g)
    message = str(raised.value)
    assert message.startswith("while emitting %") and "= Neg(" in message, message
    assert "# fig32.py:11: AssertionError" in message, message


def test_a_built_plan_refuses_writes_under_terra_check(monkeypatch):
    """The plan is a contract the PythonRunner only reads; with ``TERRA_CHECK`` (on in the
    suite, so every co-executed test runs against frozen steps) a write raises."""
    from terra.config import config

    monkeypatch.setattr(config, "check", True)
    _, graph = graph_of(trace(5, "Abs"), trace(5, "Abs"))
    step = next(iter(graph.steps.values()))
    with pytest.raises(AttributeError, match="read-only"):
        step.check_shapes = True
    monkeypatch.setattr(config, "check", False)
    _, graph = graph_of(trace(5, "Abs"), trace(5, "Abs"))
    next(iter(graph.steps.values())).check_shapes = True  # not frozen: no cost without it


def test_emission_places_each_op_on_the_device_it_ran_on():
    """A MirroredStrategy's replica runs its step under its device's scope: the graph keeps
    the device each op was recorded on, and leaves the others to TF's placer."""
    recs = trace(5, "Abs")
    recs[1].device = "/job:localhost/replica:0/task:0/device:CPU:1"
    _, graph = graph_of(recs, recs)
    devices = {op.type: op.device for op in graph.function.graph.get_operations()}
    assert devices["Abs"] == "/job:localhost/replica:0/task:0/device:CPU:1", devices
    assert devices["Neg"] == devices["Exp"] == "", devices
