"""A user's own learning-rate schedule inside a library optimizer's update (``terra.
library_regions``, held to ``terra.user_layers``' rule): a pure schedule leaves the update
skipped with eager's numbers; one whose Python does something a skipped update would leave
out keeps the per-op path, runs its Python as eager does and says why in ``explain()``.

Each program runs eagerly and under Terra (``differential``), bit for bit: losses, the last
step's gradients, every variable and optimizer slot, and what the schedule's Python counted
or printed. ``skipped_calls`` says whether co-execution skipped the update."""

import contextlib
import inspect
import io
import math

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, mlp_task, state

EXACT = ("losses", "grads", "model", "optimizer0", "schedule")
PEAK = 1e-2  # a module global the schedule reads (``test_a_global_changed...``)


class WarmupCosine(tf.keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up, then cosine decay: TF ops on the step, attribute reads."""

    def __init__(self, peak, warmup, total):
        self.peak, self.warmup, self.total = peak, warmup, total

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = self.peak * (step + 1.0) / self.warmup
        progress = tf.minimum((step - self.warmup) / (self.total - self.warmup), 1.0)
        cosine = 0.5 * self.peak * (1.0 + tf.cos(math.pi * tf.maximum(progress, 0.0)))
        return tf.where(step < self.warmup, warm, cosine)

    def get_config(self):
        return {"peak": self.peak, "warmup": self.warmup, "total": self.total}


class GlobalPeak(WarmupCosine):
    """Reads its peak from a module global."""

    def __call__(self, step):
        return PEAK * super().__call__(step) / self.peak


class Printing(WarmupCosine):
    def __call__(self, step):
        print("schedule called")
        return super().__call__(step)


class Counting(WarmupCosine):
    def __call__(self, step):
        self.calls = getattr(self, "calls", 0) + 1
        return super().__call__(step)


class NumPyDecay(WarmupCosine):
    def __call__(self, step):
        decay = np.exp(-0.01 * step).astype(np.float32)  # NumPy on the step: its value read
        return super().__call__(step) * decay


class PythonBranch(WarmupCosine):
    def __call__(self, step):
        if step < self.warmup:  # the step's value, read into Python
            return self.peak * 0.5
        return super().__call__(step)


class CondWarmup(WarmupCosine):
    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        return tf.cond(step < self.warmup, lambda: self.peak * (step + 1.0) / self.warmup,
                       lambda: tf.constant(self.peak))


def _line(cls, text):
    """The line of ``cls.__call__`` that holds ``text``, as ``file:line``."""
    lines, first = inspect.getsourcelines(cls.__call__)
    index = next(i for i, line in enumerate(lines) if text in line)
    return f"{inspect.getsourcefile(cls)}:{first + index}"


def _loop(tape_cls, steps, schedule_cls=WarmupCosine, between=None):
    schedule = schedule_cls(1e-2, 3, steps)
    data, model, optimizer, loss_fn = mlp_task(steps, tf.keras.optimizers.Adam(schedule))
    losses, out = [], io.StringIO()
    with contextlib.redirect_stdout(out):
        for step in range(steps):
            if between is not None:
                between(step)
            x, y = batch(data, step, 16)
            with tape_cls() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(float(loss))
    return {"losses": losses, "grads": list(grads), **state(model, optimizer),
            "schedule": [out.getvalue().count("\n"), getattr(schedule, "calls", 0)]}


def _skipped(outcome):
    return outcome.stats.skipped_calls


def test_pure_schedule_update_is_skipped():
    outcome = assert_same_as_eager(_loop, steps=12, exact=EXACT)
    assert _skipped(outcome) >= outcome.stats.coexecuted > 0, outcome.report()
    assert "library region off" not in outcome.explain, outcome.explain


def tf_keras_program(tape_cls, steps):
    """The loop with tf_keras' Adam and the schedule (run with ``TF_USE_LEGACY_KERAS=1``)."""
    return _loop(tape_cls, steps)


def test_tf_keras_pure_schedule_update_is_skipped():
    pytest.importorskip("tf_keras")
    outcome = assert_same_as_eager(tf_keras_program, steps=12, exact=EXACT,
                                   env={"TF_USE_LEGACY_KERAS": "1"})
    assert outcome.keras.startswith("tf_keras"), outcome.keras
    assert _skipped(outcome) >= outcome.stats.coexecuted > 0, outcome.report()


def tf_keras_printing_program(tape_cls, steps):
    return _loop(tape_cls, steps, Printing)


def test_tf_keras_printing_schedule_runs_its_python():
    pytest.importorskip("tf_keras")
    outcome = assert_same_as_eager(tf_keras_printing_program, steps=12, exact=EXACT,
                                   env={"TF_USE_LEGACY_KERAS": "1"}, min_coexecuted=0,
                                   max_traces=4)
    assert _skipped(outcome) == 0, outcome.report()
    assert outcome.terra["schedule"][0] == 12, outcome.terra
    assert f"calls print at {_line(Printing, 'print(')}" in outcome.explain, outcome.explain


@pytest.mark.parametrize("schedule_cls, why, text", [
    (Printing, "calls print", "print("),
    (NumPyDecay, "reads a tensor's value (__array__)", "np.exp"),
    (PythonBranch, "reads a tensor's value (__bool__)", "if step"),
    (CondWarmup, "branches on a tensor's value (eager tf.cond", "tf.cond("),
], ids=["print", "numpy", "python-branch", "tf-cond"])
def test_schedule_with_a_side_effect_keeps_the_per_op_path(schedule_cls, why, text):
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, schedule_cls), steps=12,
                                   exact=EXACT, min_coexecuted=0, max_traces=8,
                                   expect_fallbacks=(0, None))
    assert _skipped(outcome) == 0, outcome.report()
    assert "library region off" in outcome.explain, outcome.explain
    assert f"{why}" in outcome.explain and _line(schedule_cls, text) in outcome.explain, \
        outcome.explain


def test_counting_schedule_is_seen_before_its_first_call():
    """``self.calls = ...`` in ``__call__``: the bytecode check turns the region off before
    the update ever runs, and the counter counts every call, as eagerly."""
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, Counting), steps=12, exact=EXACT,
                                   min_coexecuted=0, max_traces=4)
    assert _skipped(outcome) == 0, outcome.report()
    assert outcome.terra["schedule"][1] == 12, outcome.terra
    assert "its __call__ assigns the attribute calls" in outcome.explain, outcome.explain


def test_a_global_changed_between_steps_turns_the_region_off():
    """The schedule reads the module global ``PEAK``; the loop halves it at step 8, after
    updates were skipped: the guard sees the change and the update takes the per-op path."""
    global PEAK

    def between(step):
        global PEAK
        PEAK = 1e-2 if step < 8 else 5e-3

    try:
        outcome = assert_same_as_eager(lambda t, s: _loop(t, s, GlobalPeak, between),
                                       steps=12, exact=EXACT, expect_fallbacks=(0, None),
                                       max_traces=4)
    finally:
        PEAK = 1e-2
    assert 0 < _skipped(outcome) < outcome.stats.coexecuted, outcome.report()
    assert "the global PEAK it reads changed" in outcome.explain, outcome.explain
