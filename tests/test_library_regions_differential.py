"""Library regions: a library optimizer's update skipped by the skeleton keeps eager's numbers,
and every guard that must keep the per-op path does (``terra.library_regions``).

Each program runs eagerly and under Terra (``differential``); ``skipped_calls`` says whether
co-execution skipped the update, so a guard that let the region through where it must not
(or a region that never engaged) fails here, not only the numbers."""

import pytest
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tiny_models import batch, mlp_task, state


def _loop(tape_cls, steps, optimizer=None, before_step=None, apply="apply_gradients",
          after_update=None):
    data, model, optimizer, loss_fn = mlp_task(steps, optimizer)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            if before_step is not None:  # inside the iteration, which begins at the tape
                before_step(step, optimizer)
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if apply == "apply_gradients":
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        else:
            optimizer.apply(grads, model.trainable_variables)
        if after_update is not None:
            after_update(step, model)
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}


def _skipped(outcome):
    return outcome.stats.skipped_calls


@pytest.mark.parametrize("apply", ["apply_gradients", "apply"])
def test_keras_adam_update_is_skipped(apply):
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, apply=apply), steps=12)
    assert _skipped(outcome) == outcome.stats.coexecuted > 0, outcome.report()


def test_builtin_schedule_is_skipped():
    def program(tape_cls, steps):
        schedule = tf.keras.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.5)
        return _loop(tape_cls, steps, tf.keras.optimizers.SGD(schedule, momentum=0.9))

    outcome = assert_same_as_eager(program, steps=12)
    assert _skipped(outcome) == outcome.stats.coexecuted > 0, outcome.report()


def test_learning_rate_variable_set_between_steps_is_skipped():
    """Keras keeps the learning rate in a variable: setting it from Python is an assignment
    the graph reads, so the region stays skipped and sees every new rate."""
    def set_rate(step, optimizer):
        optimizer.learning_rate = 1e-2 / (1 + step)

    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, before_step=set_rate), steps=12)
    assert _skipped(outcome) == outcome.stats.coexecuted > 0, outcome.report()


class _CountingAdam(tf.keras.optimizers.Adam):
    """A user's subclass whose update has a Python side effect that changes the numbers."""

    def apply(self, grads, trainable_variables=None):
        self.calls = getattr(self, "calls", 0) + 1
        grads = [g * (1.0 + 0.1 * (self.calls % 3)) for g in grads]
        return super().apply(grads, trainable_variables)


def test_user_subclass_keeps_the_per_op_path():
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, _CountingAdam(1e-2)), steps=12,
                                   expect_fallbacks=(0, None), max_traces=4)
    assert _skipped(outcome) == 0, outcome.report()
    assert "_CountingAdam is not keras's own class" in outcome.explain, outcome.explain


class _StepSchedule(tf.keras.optimizers.schedules.LearningRateSchedule):
    """A user's schedule with Python logic: halves the rate at a step counted in Python."""

    def __init__(self):
        self.calls = 0

    def __call__(self, step):
        self.calls += 1
        return 1e-2 if self.calls < 7 else 5e-3

    def get_config(self):
        return {}


def test_custom_schedule_keeps_the_per_op_path():
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, tf.keras.optimizers.SGD(
        _StepSchedule())), steps=12, expect_fallbacks=(0, None), max_traces=4)
    assert _skipped(outcome) == 0, outcome.report()


def test_attribute_changed_between_steps_turns_the_region_off():
    """A plain Python attribute the update reads (gradient clipping) changed mid-run: the
    skipped region would still clip as traced; the guard must see it and run the Python."""
    def clip_later(step, optimizer):
        if step == 7:
            optimizer.clipvalue = 1e-3
            record_stats("changed")

    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, before_step=clip_later),
                                   steps=14, expect_fallbacks=(0, None), max_traces=4)
    before = outcome.stats_at("changed").skipped_calls
    assert before > 0 and _skipped(outcome) == before, outcome.report()
    assert "library region off" in outcome.explain, outcome.explain


def test_fallback_after_a_skipped_update_replays_it():
    """A new op after the update in a co-executed step: the fallback replays the skipped
    update from the plan, and every variable (slots, iteration counter) is eager's."""
    def program(tape_cls, steps):
        extra = []

        def after_update(step, model):
            w = model.trainable_variables[0]
            # an op after the update every step; at step 8 another one, mid-iteration
            extra.append(float(tf.reduce_max(w) if step == 8 else tf.reduce_sum(w)))

        return {**_loop(tape_cls, steps, after_update=after_update), "extra": extra}

    outcome = assert_same_as_eager(program, steps=12, expect_fallbacks=1, max_traces=4)
    assert _skipped(outcome) > 0, outcome.report()


def _sonnet_loop(tape_cls, steps, change_rate_at=None):
    snt = pytest.importorskip("sonnet")
    tf.random.set_seed(0)
    data, _, _, loss_fn = mlp_task(steps)
    model = snt.nets.MLP([16, 5])
    optimizer = snt.optimizers.Adam(1e-2)
    losses = []
    for step in range(steps):
        if step == change_rate_at:
            optimizer.learning_rate = 3e-3  # a Python float the update casts to a constant
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        losses.append(float(loss))
    return {"losses": losses, "model": list(model.variables),
            "optimizer": [optimizer.step, *optimizer.m, *optimizer.v]}


def test_sonnet_adam_update_is_skipped():
    outcome = assert_same_as_eager(_sonnet_loop, steps=12)
    assert _skipped(outcome) == outcome.stats.coexecuted > 0, outcome.report()


def test_sonnet_learning_rate_set_as_a_float_turns_the_region_off():
    outcome = assert_same_as_eager(lambda t, s: _sonnet_loop(t, s, change_rate_at=8),
                                   steps=14, expect_fallbacks=(0, None), max_traces=4)
    assert 0 < _skipped(outcome) < outcome.stats.coexecuted, outcome.report()
    assert "learning_rate" in outcome.explain, outcome.explain


def tf_keras_program(tape_cls, steps):
    """The loop with tf_keras' Adam (run with ``TF_USE_LEGACY_KERAS=1``)."""
    return _loop(tape_cls, steps)


def test_tf_keras_adam_update_is_skipped():
    pytest.importorskip("tf_keras")
    outcome = assert_same_as_eager(tf_keras_program, steps=12,
                                   env={"TF_USE_LEGACY_KERAS": "1"})
    assert outcome.keras.startswith("tf_keras"), outcome.keras
    assert _skipped(outcome) == outcome.stats.coexecuted > 0, outcome.report()


def _sparse_loop(tape_cls, steps):
    """An embedding's gradient is an IndexedSlices: Adam deduplicates its indices
    (``tf.unique``, whose output shape depends on the data) before the sparse update; the
    sequences are 5 or 7 tokens long, so the graph cannot know that shape."""
    tf.keras.utils.set_random_seed(0)
    ids = [tf.random.uniform((8, 5 + 2 * (step % 2)), 0, 30, tf.int32, seed=step)
           for step in range(steps)]
    labels = tf.random.uniform((steps, 8), 0, 3, tf.int32, seed=99)
    embed, head = tf.keras.layers.Embedding(30, 6), tf.keras.layers.Dense(3)
    head(embed(ids[0])[:, 0])
    variables = embed.trainable_variables + head.trainable_variables
    optimizer = tf.keras.optimizers.Adam(1e-2)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            loss = loss_fn(labels[step], head(tf.reduce_mean(embed(ids[step]), axis=1)))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, "variables": variables, "optimizer": list(optimizer.variables)}


def test_an_update_of_a_sparse_gradient_is_skipped():
    outcome = assert_same_as_eager(_sparse_loop, 10)
    assert _skipped(outcome) >= outcome.stats.coexecuted >= 4, outcome.report()
