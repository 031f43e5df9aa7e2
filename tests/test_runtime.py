"""Runtime properties that the differential tests cannot see: resources that must not grow."""

import gc
import threading
import types
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import gen_data_flow_ops
from tiny_models import batch, mlp_task

import terra
from terra import graph_runner, hooks, interception, runtime


def train(steps, optimizer, after_step, detour_at=None):
    """A small MLP trained under Terra; ``after_step(step, loss)`` runs after each update.
    At step ``detour_at`` the loss takes one extra op: a path the graph does not have."""
    data, model, optimizer, loss_fn = mlp_task(steps, optimizer)
    for step in range(steps):
        x, y = batch(data, step, 16)
        with terra.TerraGradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if step == detour_at:
                loss = loss * 1.0
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        after_step(step, loss)
        del loss, grads  # nothing outlives its iteration unless after_step keeps it


def test_fetched_values_python_stops_reading_do_not_pile_up():
    """The loss is a fetch point (read while tracing); later steps never read it. The graph
    still enqueues it every iteration, and the channel must be drained, not grow."""
    terra.reset()
    try:
        train(30, tf.keras.optimizers.Adam(1e-2), lambda step, loss: step < 5 and float(loss))
        rt = runtime.get()
        assert rt.stats.coexecuted >= 20, terra.explain()
        channels = [c for s in rt.runner.graph.steps.values() for c in s.fetch if c is not None]
        assert channels, "the loss should be a fetch point"
        sizes = [int(gen_data_flow_ops.queue_size_v2(c.handle)) for c in channels]
        assert max(sizes) <= 1, sizes
    finally:
        terra.reset()


def test_hook_table_forgets_tensors_python_drops_after_their_iteration():
    """Losses kept in a list outlive their iterations; once Python drops them, their hook
    entries (which once pinned the iteration's batches and variable snapshot) must go."""
    terra.reset()
    kept = []
    try:
        train(30, tf.keras.optimizers.SGD(0.1), lambda step, loss: kept.append(loss))
        assert runtime.get().stats.coexecuted >= 20, terra.explain()
        held = len(hooks.tensors)
        assert held >= 20  # the kept losses of the co-executed iterations
        values = [float(t) for t in kept]
        kept.clear()
        gc.collect()
        assert len(hooks.tensors) <= held - 20, (held, len(hooks.tensors))
        assert len(values) == 30
    finally:
        terra.reset()


def test_values_of_a_fallen_back_iteration_die_with_their_stand_ins():
    """A fallback replays the iteration eagerly and gives every stand-in its real value. The
    values Python no longer holds must be freed: kept alive (by the hook table or the replay
    log), the next trace takes each one for a value that outlives its iteration, and the
    graph returns all of them every iteration."""
    terra.reset()
    try:
        train(30, tf.keras.optimizers.Adam(1e-2), lambda step, loss: None, detour_at=12)
        rt = runtime.get()
        assert rt.stats.fallbacks >= 1 and rt.stats.coexecuted >= 10, terra.explain()
        escaping = [node for node in rt.lifecycle.tracegraph.nodes if node.escaped]
        assert not escaping, "\n".join(node.format() for node in escaping)
    finally:
        terra.reset()


def test_reset_stops_the_threads_of_its_runtime():
    terra.reset()
    train(12, tf.keras.optimizers.SGD(0.1), lambda step, loss: None)
    assert runtime.get().stats.coexecuted >= 1, terra.explain()
    ours = [t for t in threading.enumerate() if t.name.startswith("terra-")]
    assert {t.name for t in ours} == {"terra-graph-runner", "terra-watchdog"}
    terra.reset()
    for thread in ours:
        thread.join(timeout=10)
    assert not [t.name for t in ours if t.is_alive()]


def test_a_handlers_fast_entry_is_tfs_fast_path_but_in_paused_sections():
    """A handler's own ``fast_entry`` (the co-execution door's lanes) is TF's fast path while
    it is the handler; ``interception.paused()`` puts TF's own back for its section, so
    Terra's own eager work there never reaches the handler."""
    seen = []

    class Handler:
        def fast_entry(self, ctx, op_type, name, *args):
            seen.append(op_type)
            return interception.ORIGINAL_FAST(ctx, op_type, name, *args)

    terra.reset()
    interception.install()
    x = tf.ones((2, 2))
    interception.set_handler(Handler())
    try:
        tf.add(x, x)
        with interception.paused():
            tf.multiply(x, x)
        tf.subtract(x, x)
    finally:
        interception.set_handler(None)
    assert seen == ["AddV2", "Sub"]


def test_an_iterations_start_hands_the_graph_runner_the_interpreter(monkeypatch):
    """``GraphRunner.start`` returns once the runner's thread is in its job: the thread that
    submitted it runs Python without releasing the GIL (lanes make no eager op), so a job
    only submitted would wait for that thread's next eager op or the switch interval. The
    job's Python here records that it ran; ``start`` must not return before it did."""
    ran = []

    def run(self, job, ctx):
        ran.append(job)
        job.entered.set()

    monkeypatch.setattr(graph_runner.GraphRunner, "_run", run)
    runner = graph_runner.GraphRunner(on_error=lambda job: None)
    try:
        plain = types.SimpleNamespace(snapshot_fn=None, commit=None, early_fn=None)
        for step in range(20):
            job = graph_runner.Job(plain, step)
            runner.start(job, timeout=10.0)
            assert ran and ran[-1] is job, f"job {step} had not started when start returned"
            job.done.wait(10.0)
    finally:
        runner.stop()


def test_a_kept_loss_does_not_pin_its_iterations_batches():
    """A loss Python keeps outlives its iteration with its entry; an entry a lane made is
    also its op's log record, whose inputs lead back to the fed batch. Once the iteration
    is released the record's inputs must go, or every kept loss holds its batch."""
    terra.reset()
    w = tf.Variable(tf.fill((4, 2), 0.5))
    rng = np.random.default_rng(0)
    kept, batches = [], []
    try:
        for _ in range(30):
            x = tf.constant(rng.normal(size=(8, 4)).astype("float32"))
            batches.append(weakref.ref(x))
            with terra.TerraGradientTape() as tape:
                h = tf.matmul(x, w)
                loss = tf.reduce_mean(h * h)
            w.assign_sub(0.01 * tape.gradient(loss, w))
            kept.append(loss)
            del x, h, loss
        assert runtime.get().stats.coexecuted >= 20, terra.explain()
        gc.collect()
        alive = [i for i, batch in enumerate(batches) if batch() is not None]
        assert len(alive) <= 1, f"the batches of iterations {alive} are still alive"
        assert len([float(t) for t in kept]) == 30
    finally:
        terra.reset()
