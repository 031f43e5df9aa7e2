"""The new graph is instantiated in the background while the loop runs one iteration eagerly,
and co-executes from the next, whenever TF finishes (``terra.background``, Terra's default;
the rest of the suite turns it off to pin the first co-executed step)."""

import random
import threading
import time

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tensorflow.python.eager import cancellation, context, execute
from tensorflow.python.ops import gen_data_flow_ops
from test_graph_builder import feed_and_fetch, graph_of, trace
from tiny_models import batch, classification_data, mlp_loop, sparse_xent, state

import terra
from terra import background, runtime
from terra.config import config


@pytest.fixture(autouse=True)
def in_background(monkeypatch):
    monkeypatch.setattr(config, "background", True)


def test_instantiating_runs_none_of_the_graphs_ops():
    """The cancelled call instantiates the function but runs no op: the fed value is still
    queued and nothing is fetched; the real call afterwards runs it all."""
    g, graph = graph_of(trace(5, "Abs", value=0.0), trace(5, "Abs", value=1.0))
    _, feed, fetch = feed_and_fetch(g, graph)

    def sizes():
        return [int(gen_data_flow_ops.queue_size_v2(c.handle)) for c in (feed, fetch)]

    x = np.full((4, 3), 0.5, np.float32)
    feed.put(tf.constant(x))
    background.instantiate(graph)
    assert sizes() == [1, 0]
    execute.execute_with_cancellation(graph.fn_name, 0, graph.captures, graph.call_attrs,
                                      context.context(), cancellation.CancellationManager())
    assert sizes() == [0, 1]
    np.testing.assert_allclose(fetch.get(), np.exp(np.abs(-x)), rtol=1e-6)


def noisy_batchnorm_program(detour_at=None, settle_from=None):
    """BatchNorm, Dropout, ``tf.random.normal`` drawn from the global seed, Python's
    ``random`` in the loss; at ``detour_at`` the loss takes one more op (a new path). From
    step ``settle_from`` on, each step first waits (Python only) for an instantiation under
    way to end, so a test of what follows it does not depend on the machine's speed."""

    def program(tape_cls, steps):
        tf.keras.utils.set_random_seed(0)
        rng = random.Random(0)
        data = classification_data(steps * 16, 12, 4)
        model = tf.keras.Sequential([
            tf.keras.Input((12,)), tf.keras.layers.Dense(16),
            tf.keras.layers.BatchNormalization(), tf.keras.layers.Dropout(0.2),
            tf.keras.layers.Dense(4)])
        optimizer = tf.keras.optimizers.Adam(1e-2)
        loss_fn = sparse_xent()
        losses = []
        for step in range(steps):
            if settle_from is not None and step >= settle_from:
                await_instantiation()
            x, y = batch(data, step, 16)
            with tape_cls() as tape:
                noisy = x + tf.random.normal(tf.shape(x), stddev=0.01)
                loss = loss_fn(y, model(noisy, training=True)) * (1.0 + rng.random() / 100)
                if step == detour_at:
                    loss = tf.abs(loss)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(float(loss))
        return {"losses": losses, **state(model, optimizer)}

    return program


def await_instantiation(timeout=60.0):
    pending = runtime.get().lifecycle._pending
    assert pending is None or pending.wait(timeout), "the graph still instantiating after 60 s"


def test_iterations_run_while_the_graph_is_instantiated_keep_eagers_numbers():
    outcome = assert_same_as_eager(noisy_batchnorm_program(), 16)
    assert "graph instantiated: in the background" in outcome.explain, outcome.report()
    assert outcome.stats.graph_generations == 1, outcome.report()


def test_a_graph_built_again_after_a_fallback_is_instantiated_in_the_background_too():
    outcome = assert_same_as_eager(noisy_batchnorm_program(detour_at=14, settle_from=20), 24,
                                   expect_fallbacks=(0, 1), max_traces=4)
    if outcome.stats.fallbacks:
        assert outcome.explain.count("graph instantiated: in the background") == 2, \
            outcome.report()


def test_a_failed_instantiation_leaves_it_to_the_first_call(monkeypatch):
    def failing(graph):
        raise RuntimeError("injected into instantiate")

    monkeypatch.setattr(background, "instantiate", failing)
    outcome = assert_same_as_eager(mlp_loop, 12)
    assert "instantiating the graph" in outcome.explain and "injected" in outcome.explain, \
        outcome.report()


def test_reset_waits_for_an_instantiation_under_way(monkeypatch):
    """The loop ends while the graph is being instantiated: ``terra.reset()`` leaves no
    thread of Terra's behind."""
    original = background.instantiate

    def slow(graph):
        time.sleep(0.5)
        original(graph)

    monkeypatch.setattr(background, "instantiate", slow)
    terra.reset()
    try:  # warm-up, two traces, and the iteration that generates the graph
        mlp_loop(terra.TerraGradientTape, 4)
        assert runtime.get().phase == "instantiating", terra.explain()
    finally:
        terra.reset()
    assert not [t for t in threading.enumerate() if t.name == "terra-instantiate"]


def test_coexecution_starts_at_the_same_iteration_however_long_tf_takes(monkeypatch):
    """Iteration 4 generates the graph and runs eagerly while TF instantiates it; iteration 5
    waits for TF and co-executes, whether TF took no time or half a second."""
    original = background.instantiate
    phases = {}
    for delay in (0.0, 0.5):
        def slow(graph, delay=delay):
            time.sleep(delay)
            original(graph)

        monkeypatch.setattr(background, "instantiate", slow)
        terra.reset()
        try:
            mlp_loop(terra.TerraGradientTape, 6)
            stats = terra.stats()
            phases[delay] = (stats.graph_generations, stats.coexecuted, stats.phase)
        finally:
            terra.reset()
    # iteration 5 co-executed and closed, iteration 6 co-executes and is still open
    assert phases[0.0] == phases[0.5] == (1, 1, "coexecution"), phases


def test_an_instantiation_past_the_timeout_runs_eagerly(monkeypatch):
    """TF never finishing (an instantiation stuck for longer than ``config.timeout``): the
    iteration that would co-execute stops waiting, and Terra runs eagerly for the rest of the
    run, with eager's numbers, saying why."""
    original, release = background.instantiate, threading.Event()

    def stuck(graph):
        release.wait(60)
        original(graph)

    monkeypatch.setattr(background, "instantiate", stuck)
    before = config.timeout

    def program(tape_cls, steps):
        if tape_cls is not terra.TerraGradientTape:
            return mlp_loop(tape_cls, steps)
        terra.configure(timeout=0.5)
        try:
            return mlp_loop(tape_cls, steps)
        finally:
            terra.configure(timeout=before)
            release.set()

    outcome = assert_same_as_eager(program, 8, min_coexecuted=0)
    assert outcome.stats.phase == "eager" and outcome.stats.coexecuted == 0, outcome.report()
    assert "did not finish instantiating the graph" in outcome.explain, outcome.report()
