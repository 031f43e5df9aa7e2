"""``terra.census``: the chance of a new path, from the paths hand-written traces took; a
program that draws its path at random gets one graph that serves all of them; and a path the
graph of such a program lacks is a detour under the budget, not a free rebuild."""

import random

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager
from test_loops import loop_trace
from test_tracegraph import at, ext, op_at
from tiny_models import batch, mlp_task, state

import terra
from terra.census import PathCensus
from terra.nodes import OpRef
from terra.tracegraph import TraceGraph


def branch_trace(op_type):
    """``h = Neg(x)``; ``h = <op_type>(h)`` (one line, another op per path); ``Exp(h)``."""
    return [op_at(at(1), "Neg", ext(np.ones((4, 3)))),
            op_at(at(2), op_type, OpRef(0, 0)),
            op_at(at(3), "Exp", OpRef(1, 0))]


def chances(traces):
    """The chance of a new path after each of ``traces`` is merged."""
    graph, census, out = TraceGraph(), PathCensus(), []
    for trace in traces:
        _, path = graph.merge(trace)
        census.add(path)
        out.append(census.new_path_chance(graph.trips))
    return out


def test_the_chance_of_a_new_path_is_the_share_of_traces_no_other_trace_covers():
    a, b, c = "Tanh", "Sigmoid", "Relu"
    got = chances([branch_trace(t) for t in (a, a, b, a, b, c, c, a, b, a)])
    assert got == [1.0, 0.0, 1 / 3, 1 / 4, 0.0, 1 / 6, 0.0, 0.0, 0.0, 0.0]


def two_branches_trace(first, second):
    """Two branch points with a common op between them: ``first`` then ``second``."""
    return [op_at(at(1), "Neg", ext(np.ones((4, 3)))),
            op_at(at(2), first, OpRef(0, 0)),
            op_at(at(3), "Exp", OpRef(1, 0)),
            op_at(at(4), second, OpRef(2, 0)),
            op_at(at(5), "Abs", OpRef(3, 0))]


def test_a_new_combination_of_branches_taken_before_is_no_new_path():
    # the graph's switch-cases serve "Tanh then Relu" once each was taken (a new edge would
    # be new; a new set of edges taken before is not)
    got = chances([two_branches_trace(*p) for p in [("Tanh", "Tanh"), ("Relu", "Relu"),
                                                    ("Tanh", "Tanh"), ("Relu", "Relu"),
                                                    ("Tanh", "Relu")]])
    assert got == [1.0, 1.0, 1 / 3, 0.0, 0.0]


def test_another_trip_count_of_a_loop_is_not_another_path():
    # three trip counts, one loop: the generator rolls them into one body
    assert chances([loop_trace(n) for n in (2, 3, 4)]) == [1.0, 0.0, 0.0]


def test_iterations_a_graph_served_make_a_path_met_once_a_rare_one():
    graph, census = TraceGraph(), PathCensus()
    for op_type in ("Tanh", "Tanh", "Sigmoid"):  # the last: a fallback's trace, say
        census.add(graph.merge(branch_trace(op_type))[1])
    assert census.new_path_chance(graph.trips) == 1 / 3
    assert census.new_path_chance(graph.trips, served=17) == 1 / 20


def test_traces_before_a_restart_are_no_samples():
    # a trace recorded while a region was on (turned off at its end) never recurs
    graph, census = TraceGraph(), PathCensus()
    census.add(graph.merge(branch_trace("Sigmoid"))[1])
    census.restart()
    for _ in range(2):
        census.add(graph.merge(branch_trace("Tanh"))[1])
    assert len(census) == 2 and census.new_path_chance(graph.trips) == 0.0


def test_the_census_counts_the_last_traces_only():
    graph, census = TraceGraph(), PathCensus(window=4)
    for op_type in ("Tanh", "Sigmoid", "Tanh", "Tanh", "Tanh", "Tanh"):
        census.add(graph.merge(branch_trace(op_type))[1])
    assert len(census) == 4 and census.new_path_chance(graph.trips) == 0.0


STEPS = 48
ACTIVATIONS = (tf.nn.relu, tf.nn.tanh, tf.nn.sigmoid, tf.nn.elu)


def random_path_program(tape_cls, steps, seed=6):
    """Each step draws, with Python's ``random``, one of four activations for the hidden
    layer, as SDPoint draws its down-sampling point: four paths, one at random."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    draw = random.Random(seed)
    dense, head = model.layers
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        act = draw.choice(ACTIVATIONS)
        with tape_cls() as tape:
            loss = loss_fn(y, head(act(tf.matmul(x, dense.kernel) + dense.bias)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}


def test_a_program_that_draws_its_path_gets_one_graph_for_every_path():
    outcome = assert_same_as_eager(random_path_program, STEPS, max_traces=20,
                                   min_coexecuted=STEPS // 2)
    s = outcome.stats
    assert (s.graph_generations, s.fallbacks) == (1, 0), outcome.report()


def test_without_the_census_the_graph_is_built_before_the_paths_are_known():
    # the test above fails the same way when the first covered trace builds the graph
    risk = terra.config.config.new_path_risk
    terra.configure(new_path_risk=1.0)
    try:
        outcome = assert_same_as_eager(random_path_program, STEPS, max_traces=20,
                                       expect_fallbacks=(1, None))
    finally:
        terra.configure(new_path_risk=risk)
    assert outcome.stats.graph_generations > 1, outcome.report()


def drawn_paths_on_a_budget(tape_cls, steps):
    """``random_path_program`` drawing a sequence whose traces see three of the four paths
    before the census is content, under Terra's default budget (in a child process)."""
    if tape_cls is terra.TerraGradientTape:
        terra.configure(budget=0.05, min_saving=float("-inf"))  # the first graph: built
    return random_path_program(tape_cls, steps, seed=0)


def test_a_path_a_graph_of_drawn_paths_lacks_is_a_detour_not_a_free_rebuild():
    # the program draws its paths: a rebuild for the fourth must be afforded (a short run
    # never does), so its iterations run eagerly from the divergence, the rest co-execute
    # (until the ledger judges them, after five: on a loaded machine a step this small may
    # not beat eager, and Terra then stops, which is the budget's business, not this test's)
    outcome = assert_same_as_eager(drawn_paths_on_a_budget, STEPS, max_traces=20,
                                   expect_fallbacks=(1, None), min_coexecuted=5, env={})
    # the first fallback keeps the graph (a later rebuild is the ledger's, once afforded:
    # it depends on how fast this machine ran the iterations)
    events = [line.split(" ")[0] for line in outcome.explain.splitlines()
              if line.startswith(("fallback [", "detour at"))]
    assert events[:2] == ["fallback", "detour"], outcome.report()
