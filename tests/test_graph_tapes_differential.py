"""A gradient the graph computes itself (its backward values follow a boolean mask's row
count) is summed as eager's tape summed it: bit for bit, step after step.

The programs give a tensor many consumers, so its gradient is a sum of many contributions
whose order decides the last bits (``tf.gradients`` adds them in another order than the
tape), and pause the tape inside it (``tf.stop_gradient``, as Keras' batch statistics do),
which eager's tape does not record. A gradient call whose traces include an iteration a
fallback replayed keeps its graph tape too: the replay watches variables and pauses the tapes
as eager did, so that trace is like the others.
"""

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tiny_models import classification_data, sparse_xent, state


class FanOut(tf.Module):
    """A linear layer whose output feeds a dozen terms, then a masked loss."""

    def __init__(self):
        super().__init__()
        self.w = tf.Variable(tf.random.stateless_normal((12, 16), seed=(3, 4)) * 0.3)
        self.b = tf.Variable(tf.zeros((16,)))

    def __call__(self, x):
        h = tf.matmul(x, self.w) + self.b
        centred = h - tf.stop_gradient(tf.reduce_mean(h, 0))  # the tape is paused for it
        terms = [tf.tanh(h * c) for c in (0.3, 0.7, 1.1, 1.9, 2.3)]
        terms += [tf.sigmoid(centred * c) for c in (0.5, 1.3, 3.1)]
        terms += [h * h * 0.01, tf.abs(h) * 0.2, tf.nn.relu(centred)]
        return tf.add_n(terms)


def fan_out_program(tape_cls, steps, optimizer=None, inside=False):
    rng = np.random.default_rng(0)
    model = FanOut()
    optimizer = optimizer or tf.keras.optimizers.SGD(0.05, momentum=0.9)
    losses, rows = [], []
    for _ in range(steps):
        x = tf.constant(rng.normal(size=(32, 12)).astype(np.float32))
        keep = tf.constant(rng.random(32) < 0.3 + 0.4 * rng.random())
        with tape_cls() as tape:
            out = model(x)
            picked = tf.boolean_mask(out, keep)  # its rows change every step
            loss = tf.reduce_mean(tf.square(picked - 0.5)) + tf.reduce_mean(out) * 0.1
            if inside:  # the tape stops recording at the call, as TF's does
                grads = tape.gradient(loss, model.trainable_variables)
        if not inside:
            grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
        rows.append(int(picked.shape[0]))
    return {"losses": losses, "rows": rows, "grads": [g.numpy() for g in grads],
            "variables": [v.numpy() for v in model.trainable_variables]}


def test_a_gradient_whose_shapes_follow_data_sums_as_the_tape():
    outcome = assert_same_as_eager(fan_out_program, 16, exact=("losses", "grads", "variables"),
                                   max_traces=3, min_coexecuted=8)
    assert len(set(outcome.eager["rows"])) > 4  # the mask's rows did change


def _adam(tape_cls, steps):
    return fan_out_program(tape_cls, steps, tf.keras.optimizers.Adam(0.01))


def test_the_same_with_adam():
    assert_same_as_eager(_adam, 14, exact=("losses", "grads", "variables"), max_traces=3,
                         min_coexecuted=6)


def _inside_the_with(tape_cls, steps):
    return fan_out_program(tape_cls, steps, tf.keras.optimizers.Adam(0.01), inside=True)


def test_a_gradient_taken_inside_the_tapes_with():
    assert_same_as_eager(_inside_the_with, 14, exact=("losses", "grads", "variables"),
                         max_traces=3, min_coexecuted=6)


def batch_norm_program(tape_cls, steps):
    """Keras' BatchNormalization in training mode before the masked loss: its batch
    variance subtracts a ``tf.stop_gradient`` of the mean, which eager's tape skips."""
    rng = np.random.default_rng(1)
    dense = tf.keras.layers.Dense(16, kernel_initializer=tf.keras.initializers.GlorotUniform(3))
    norm = tf.keras.layers.BatchNormalization()
    head = tf.keras.layers.Dense(4, kernel_initializer=tf.keras.initializers.GlorotUniform(4))
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        x = tf.constant(rng.normal(size=(32, 12)).astype(np.float32))
        keep = tf.constant(rng.random(32) < 0.3 + 0.4 * rng.random())
        with tape_cls() as tape:
            h = norm(dense(x), training=True)
            out = head(tf.nn.relu(h) + tf.tanh(h) + h * 0.1)
            loss = tf.reduce_mean(tf.square(tf.boolean_mask(out, keep) - 0.5))
        variables = dense.trainable_variables + norm.trainable_variables + \
            head.trainable_variables
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, "grads": [g.numpy() for g in grads],
            "variables": [v.numpy() for v in variables + norm.non_trainable_variables]}


def test_batch_statistics_behind_stop_gradient_sum_as_the_tape():
    assert_same_as_eager(batch_norm_program, 14, exact=("losses", "grads", "variables"),
                         max_traces=3, min_coexecuted=6)


EPOCHS = 3


def smaller_last_batch_program(tape_cls, steps):
    """``for x, y in dataset`` over three epochs whose last batch is smaller (no
    ``drop_remainder``), into Dense + BatchNormalization. The smaller batch's new shape
    falls back, and the replay runs the skipped model call from the plan; the graph built
    from traces of both batch sizes computes the gradient itself (the backward values follow
    the batch size), from the graph tape only if every trace, the replayed ones too, watched
    the same variables and paused the tapes at the batch mean's ``tf.stop_gradient``.
    Without that it took
    ``tf.gradients``, whose sums in another order put the first kernel's gradient a few ulps
    off eager's and, through Adam, the variables ~1e-5 relative."""
    tf.keras.utils.set_random_seed(0)
    per_epoch = steps // EPOCHS  # batches of 16, the last of 4
    x, y = classification_data(16 * (per_epoch - 1) + 4, 20, 5)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model = tf.keras.Sequential([
        tf.keras.Input((20,)),
        tf.keras.layers.Dense(32),
        tf.keras.layers.BatchNormalization(),
        tf.keras.layers.ReLU(),
        tf.keras.layers.Dense(5),
    ])
    optimizer = tf.keras.optimizers.Adam(1e-2)
    loss_fn = sparse_xent()
    losses, grads_per_step = [], []
    for epoch in range(EPOCHS):
        for xb, yb in dataset:
            with tape_cls() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(float(loss))
            grads_per_step.append([g.numpy() for g in grads])
        record_stats(f"epoch{epoch}")
    return {"losses": losses, "grads": grads_per_step, **state(model, optimizer)}


@pytest.mark.parametrize("env", [None, {"TF_USE_LEGACY_KERAS": "1"}], ids=["keras3", "tf_keras"])
def test_a_smaller_last_batch_keeps_eagers_sums(env):
    steps = 7 * EPOCHS
    outcome = assert_same_as_eager(
        smaller_last_batch_program, steps, exact=("losses", "grads", "model", "optimizer0"),
        expect_fallbacks=(1, 2 * EPOCHS), max_traces=2 * EPOCHS + 2, env=env)
    assert outcome.keras.startswith("tf_keras." if env else "keras."), outcome.keras
    # the graph was built again for both batch sizes and co-executed the later epochs
    first = outcome.stats_at("epoch0")
    assert first.fallbacks >= 1, outcome.report()
    assert outcome.stats.coexecuted - first.coexecuted >= 8, outcome.report()
