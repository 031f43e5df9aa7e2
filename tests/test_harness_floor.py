"""The harness's floor mode (``benchmarks/floor.py``): replayed steps execute no kernel, a step
that leaves the recorded op path is detected and counted, and the report shows the floor.

Kernels are counted with TensorFlow's own op callbacks, which both op doors run after an op
executed (the fast path in C++, ``execute_with_callbacks`` in Python): an op the floor answers
never reaches them. No timing is asserted (speed is measured by the harness).
"""

import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

from benchmarks import harness, report
from benchmarks.floor import Floor, FloorTape, FloorUnavailable
from benchmarks.programs import load, run
from benchmarks.programs.base import keras
from benchmarks.worker import run_one


@contextlib.contextmanager
def kernels():
    """The op types executed for real inside the block."""
    executed = []

    def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
        executed.append(op_type)

    op_callbacks.add_op_callback(callback)
    try:
        yield executed
    finally:
        op_callbacks.remove_op_callback(callback)


def test_replayed_steps_execute_no_kernel():
    """The MLP (Keras layers, a tape, Adam): its recorded step's ops run, its replayed steps'
    do not, the variables keep the recorded step's values and the loss is the recorded one."""
    prog = load("mlp")("quick", 0, tape=FloorTape)
    step = Floor(prog.train_step, record_at=2)
    with kernels() as executed:
        recorded = run(prog, 2, step)
    assert len(executed) >= len(step.ops) > 20, (len(executed), len(step.ops))
    assert step.stats()["whole_calls_per_step"] == 2  # tape.gradient, Adam's update
    weights = [v.numpy() for v in prog.model.trainable_variables]
    with kernels() as executed:
        replayed = run(prog, 3, step)
    assert executed == []
    assert step.stats() == dict(ops_per_step=len(step.ops), whole_calls_per_step=2,
                                replayed_steps=3, diverged_steps=0, real_ops=0)
    assert replayed == [recorded[-1]] * 3
    for before, v in zip(weights, prog.model.trainable_variables, strict=True):
        np.testing.assert_array_equal(before, v.numpy())


def test_a_users_optimizer_is_answered_op_by_op():
    """A user's subclass of Adam is the user's code: its update's Python runs, its ops are
    answered one by one (only ``tape.gradient`` is answered whole)."""

    class UsersAdam(keras.optimizers.Adam):
        pass

    prog = load("mlp")("quick", 0, tape=FloorTape)
    prog.optimizer = UsersAdam(1e-3)
    step = Floor(prog.train_step, record_at=2)
    run(prog, 2, step)
    assert step.stats()["whole_calls_per_step"] == 1
    assert len(step.ops) > 100  # Adam's update: a dozen ops per variable
    with kernels() as executed:
        run(prog, 2, step)
    assert executed == []
    assert step.stats()["diverged_steps"] == 0


class Branchy:
    """A step whose op path depends on a Python counter: odd calls take an extra ``Abs``
    (``where="middle"``), end with one (``where="end"``) or ask the tape for one more
    gradient, which runs no op in a replayed step (``where="gradient"``)."""

    def __init__(self, where):
        self.where = where
        self.calls = 0
        self.v = tf.Variable([1.0, -2.0])

    def step(self, x):
        self.calls += 1
        with FloorTape(persistent=True) as tape:
            y = x * self.v
            if self.calls % 2 and self.where == "middle":
                y = tf.abs(y)
            loss = tf.reduce_sum(y)
        if self.calls % 2 and self.where == "gradient":
            tape.gradient(loss, self.v)
        grad = tape.gradient(loss, self.v)
        self.v.assign_sub(0.1 * grad)
        if self.calls % 2 and self.where == "end":
            tf.abs(loss)
        return loss


@pytest.mark.parametrize("where", ["middle", "end", "gradient"])
def test_divergence_is_counted(where):
    """Recorded at an odd call: the even calls diverge (in the middle, the ops from the
    mismatch on run for real; otherwise the step simply has fewer ops or whole calls), the odd
    ones not."""
    prog = Branchy(where)
    step = Floor(prog.step, record_at=1)
    x = tf.constant([3.0, 4.0])
    step(x)
    with kernels() as executed:
        losses = [float(step(x)) for _ in range(4)]
    stats = step.stats()
    assert stats["diverged_steps"] == 2
    assert stats["replayed_steps"] == 4
    if where == "middle":  # Sum of the recorded Mul, then the gradient's update, for real
        assert stats["real_ops"] == len(executed) > 0
        assert losses[::2] == [3.0 - 8.0] * 2  # not |3| + |-8| as recorded
        assert losses[1::2] == [11.0] * 2
    else:
        assert stats["real_ops"] == 0 and executed == []


def test_worker_reports_the_floor():
    """The floor mode end to end in the worker: losses, and the counters of the timed steps."""
    result = run_one("mlp", "floor", steps=3, warmup=2)
    assert "error" not in result, result.get("traceback")
    stats = result["floor_stats"]
    assert stats["replayed_steps"] == 3 and stats["diverged_steps"] == 0, stats
    assert stats["real_ops"] == 0 and stats["ops_per_step"] > 20, stats
    assert result["losses"][2:] == [result["losses"][1]] * 3


def _run(mode, steps_per_s, losses, **extra):
    return dict(program="mlp", mode=mode, repeat=0, steps=10, steps_per_s=steps_per_s,
                losses=losses, **extra)


def test_report_shows_the_floor():
    """Its losses are not compared (not WRONG, not a failure), each mode gets its share of the
    floor's speed, and results.md a floor table with the counters."""
    floor_stats = dict(ops_per_step=222, whole_calls_per_step=2, replayed_steps=10,
                       diverged_steps=0, real_ops=0)
    runs = [_run("eager", 50.0, [2.5, 2.4]), _run("terra", 100.0, [2.5, 2.4]),
            _run("floor", 200.0, [2.5, 2.5], floor_stats=floor_stats)]
    modes = ["eager", "terra", "floor"]
    rows = harness.summarize(runs, ["mlp"], modes, 1e-4, 1e-6, 1e-3)
    by_mode = {r["mode"]: r for r in rows}
    assert by_mode["floor"]["status"] == "ok"
    assert by_mode["terra"]["median_vs_floor"] == 0.5
    assert by_mode["eager"]["median_vs_floor"] == 0.25
    assert by_mode["floor"]["median_speedup"] == 4.0
    text = report.text_table(rows)
    assert "% floor" in text.splitlines()[0]
    assert "n/a (floor)" in text
    meta = dict(command="python -m benchmarks", date="-", machine="-", tensorflow="-",
                keras="-", python="-", config="quick", repeats=1, rtol=1e-4, atol=1e-6,
                programs=["mlp"], warmup=dict(mlp=2), steps=dict(mlp=10))
    md = report.markdown(rows, meta)
    assert "## Floor" in md
    assert "| mlp | 5.00 | 20.00 (25%) | 10.00 (50%) | 222 | 0 | 0 |" in md
    assert "Failures" not in md

    runs[2]["floor_stats"] = dict(floor_stats, diverged_steps=4, real_ops=80)
    rows = harness.summarize(runs, ["mlp"], modes, 1e-4, 1e-6, 1e-3)
    assert "n/a (floor; 4 of 10 steps diverged, 80 ops run for real)" in report.text_table(rows)


def test_a_diverged_step_that_fails_says_there_is_no_floor():
    """Recorded on a 2-vector, then called on a 3-vector with another op path: eagerly the
    step is fine, but its first op is answered with the recorded 2-vector, which the real op
    after the divergence cannot reshape; the error says why there is no floor."""
    def step(x, column):
        h = x * 2.0
        if column:
            h = tf.reshape(h, (3, 1))
        return tf.reduce_sum(h)

    assert float(step(tf.constant([1.0, 2.0, 3.0]), True)) == 12.0  # fine eagerly
    floor = Floor(step, record_at=1)
    floor(tf.constant([3.0, 4.0]), False)
    with pytest.raises(FloorUnavailable, match="left the recorded op path"):
        floor(tf.constant([1.0, 2.0, 3.0]), True)
