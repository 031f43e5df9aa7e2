"""Mixed precision with a loss-scale optimizer (policy ``mixed_float16``; Keras 3's
``LossScaleOptimizer``, tf_keras' ``mixed_precision.LossScaleOptimizer``) under Terra.

What is skipped, and what is not: the wrapped optimizer's own update (Adam's) is a library
region and is skipped; the loss scale's update around it is not. Eager ``tf.cond`` reads its
predicate's value and runs one branch in Python, and the loss scale takes two such branches
every step (are the gradients finite; has the counter reached the growth interval), so its
Python runs per op, reading both values, as eagerly. Each program runs eagerly and under
Terra (``differential``), bit for bit: losses, the last step's gradients, every variable, the
inner optimizer's slots and the loss scale's own variables (scale, counter)."""

import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, mlp_task, state

EXACT = ("losses", "grads", "model", "optimizer0", "optimizer1")


def _loop(tape_cls, steps):
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        data, model, inner, loss_fn = mlp_task(steps)
        optimizer = tf.keras.mixed_precision.LossScaleOptimizer(inner)
        keras3 = hasattr(optimizer, "scale_loss")
        losses = []
        for step in range(steps):
            x, y = batch(data, step, 16)
            with tape_cls() as tape:
                loss = loss_fn(y, model(x, training=True))
                scaled = optimizer.scale_loss(loss) if keras3 else \
                    optimizer.get_scaled_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            if not keras3:
                grads = optimizer.get_unscaled_gradients(grads)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(float(loss))
        own = [optimizer.dynamic_scale, optimizer.step_counter] if keras3 else \
            [optimizer.loss_scale, optimizer.dynamic_counter]
        return {"losses": losses, "grads": list(grads), **state(model, inner),
                "optimizer1": own}
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")


def tf_keras_program(tape_cls, steps):
    """The loop under tf_keras (run with ``TF_USE_LEGACY_KERAS=1``)."""
    return _loop(tape_cls, steps)


def _check(outcome):
    # the inner optimizer's update is skipped in every co-executed iteration
    assert outcome.stats.skipped_calls >= outcome.stats.coexecuted > 0, outcome.report()
    # the loss scale's two eager tf.cond predicates are read in Python (value reads)
    assert "value read" in outcome.explain, outcome.explain


def test_keras_loss_scale_optimizer():
    _check(assert_same_as_eager(_loop, steps=12, exact=EXACT))


def test_tf_keras_loss_scale_optimizer():
    pytest.importorskip("tf_keras")
    outcome = assert_same_as_eager(tf_keras_program, steps=12, exact=EXACT,
                                   env={"TF_USE_LEGACY_KERAS": "1"})
    assert outcome.keras.startswith("tf_keras"), outcome.keras
    _check(outcome)
