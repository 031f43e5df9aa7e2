"""Layer regions of tf_keras (legacy Keras 2): a tf_keras layer's call skipped by the
skeleton keeps eager's numbers, and the guards that must run its Python do
(``terra.layer_regions``, ``terra.keras_families``).

tf_keras' recurrent layers run a Python loop over time steps when called eagerly: skipped,
a GRU's hundred steps are one call in Python. Each program runs eagerly and under Terra
(``differential``); ``skipped_layer_calls`` tells whether co-execution skipped the calls.
"""

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager

tf_keras = pytest.importorskip("tf_keras")

EXACT = ("losses", "variables")


def _train(tape_cls, steps, model, batches, loss_fn, before_step=None, training=None):
    """A custom loop of tf_keras' guide; ``training(step)``: the mode of each step's call."""
    optimizer = tf_keras.optimizers.Adam(1e-2)
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step, model)
        x, y = batches(step)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True if training is None else training(step)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(loss)
    return {"losses": losses, "variables": model.variables + optimizer.variables()}


def gru_language_model(tape_cls, steps):
    """Embedding, a GRU over 30 time steps, a vocabulary's logits."""
    tf_keras.utils.set_random_seed(0)
    vocab, length, batch = 40, 30, 8
    model = tf_keras.Sequential([tf_keras.layers.Embedding(vocab, 16),
                                 tf_keras.layers.GRU(24, return_sequences=True),
                                 tf_keras.layers.Dense(vocab)])
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (steps, batch, length + 1))
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return _train(tape_cls, steps, model, lambda s: (tf.constant(tokens[s, :, :-1]),
                                                     tf.constant(tokens[s, :, 1:])), loss_fn)


def test_a_tf_keras_gru_language_model_is_one_skipped_call():
    outcome = assert_same_as_eager(gru_language_model, 10, exact=EXACT, min_coexecuted=5)
    assert outcome.stats.skipped_layer_calls >= outcome.stats.coexecuted, outcome.report()


def _regression(tape_cls, steps, layers, **kwargs):
    tf_keras.utils.set_random_seed(0)
    inputs = tf_keras.Input((6,))
    h = inputs
    for layer in layers:
        h = layer(h)
    model = tf_keras.Model(inputs, tf_keras.layers.Dense(1)(h))
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((steps, 16, 6)).astype("float32")
    ys = rng.standard_normal((steps, 16, 1)).astype("float32")
    return _train(tape_cls, steps, model, lambda s: (tf.constant(xs[s]), tf.constant(ys[s])),
                  tf_keras.losses.MeanSquaredError(), **kwargs)


def batch_norm(tape_cls, steps):
    """A functional model with BatchNormalization: its moving statistics are variables the
    skipped call's ops update."""
    return _regression(tape_cls, steps, [tf_keras.layers.Dense(12, activation="relu"),
                                         tf_keras.layers.BatchNormalization()])


def test_a_tf_keras_batch_norm_model_is_skipped_with_eagers_numbers():
    outcome = assert_same_as_eager(batch_norm, 12, exact=EXACT, min_coexecuted=5)
    assert outcome.stats.skipped_layer_calls >= outcome.stats.coexecuted, outcome.report()


def batch_norm_train_and_inference(tape_cls, steps):
    """The same called in training and in inference mode in turn: the modes share the ops
    before the batch norm, so the call is no single path and runs op by op."""
    return _regression(tape_cls, steps, [tf_keras.layers.Dense(12, activation="relu"),
                                         tf_keras.layers.BatchNormalization()],
                       training=lambda step: step % 2 == 0)


def test_a_tf_keras_batch_norm_in_both_modes_keeps_eagers_numbers():
    assert_same_as_eager(batch_norm_train_and_inference, 12, exact=EXACT, max_traces=4,
                         min_coexecuted=5)


def _halved(x):
    return x * 0.5


def users_activation(tape_cls, steps):
    """A Dense whose activation is a function of the user's: its Python runs."""
    return _regression(tape_cls, steps, [tf_keras.layers.Dense(12, activation=_halved)])


def test_a_tf_keras_layer_with_the_users_function_runs_its_python():
    outcome = assert_same_as_eager(users_activation, 10, exact=EXACT, min_coexecuted=4)
    assert "function of the user's" in outcome.explain, outcome.report()


class Scaled(tf_keras.layers.Layer):
    """The user's own layer around a built-in one: its Python runs, its Dense is skipped."""

    def __init__(self):
        super().__init__()
        self.dense = tf_keras.layers.Dense(12, activation="tanh")
        self.calls = 0

    def call(self, x):
        self.calls += 1  # a Python side effect the skeleton must keep
        return self.dense(x) * 2.0


def users_layer(tape_cls, steps):
    out = _regression(tape_cls, steps, [layer := Scaled()])
    out["calls"] = layer.calls
    return out


def test_a_users_tf_keras_layer_runs_its_python_around_skipped_sublayers():
    outcome = assert_same_as_eager(users_layer, 10, exact=EXACT, min_coexecuted=4)
    assert outcome.terra["calls"] == outcome.eager["calls"] == 11  # one builds the model
    assert outcome.stats.skipped_layer_calls >= outcome.stats.coexecuted, outcome.report()


def _anneal(step, model):
    if step == 6:
        model.layers[2].rate = 0.0


def dropout_rate_changed(tape_cls, steps):
    """A dropout rate set from Python halfway: the call's regions turn off, eager's numbers."""
    return _regression(tape_cls, steps, [tf_keras.layers.Dense(12),
                                         tf_keras.layers.Dropout(0.3)], before_step=_anneal)


def test_a_tf_keras_dropout_rate_changed_from_python_keeps_eagers_numbers():
    outcome = assert_same_as_eager(dropout_rate_changed, 12, exact=EXACT, expect_fallbacks=(0, 2),
                                   max_traces=6, min_coexecuted=3)
    assert "attributes changed" in outcome.explain, outcome.report()


class StatefulLM(tf_keras.Model):
    """The text-generation tutorial's model: the GRU is given its initial state (tf_keras'
    ``RNN.__call__`` then sets ``state_spec`` anew at every call) and returns its state (each
    output gets ``_keras_mask = None``)."""

    def __init__(self):
        super().__init__()
        self.embedding = tf_keras.layers.Embedding(40, 16)
        self.gru = tf_keras.layers.GRU(24, return_sequences=True, return_state=True)
        self.dense = tf_keras.layers.Dense(40)

    def call(self, inputs, training=False):
        x = self.embedding(inputs, training=training)
        x, _ = self.gru(x, initial_state=self.gru.get_initial_state(x), training=training)
        return self.dense(x, training=training)


def gru_with_initial_state(tape_cls, steps):
    tf_keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 40, (steps, 8, 21))
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return _train(tape_cls, steps, StatefulLM(), lambda s: (tf.constant(tokens[s, :, :-1]),
                                                           tf.constant(tokens[s, :, 1:])), loss_fn)


def test_a_gru_given_its_state_and_returning_it_is_skipped():
    outcome = assert_same_as_eager(gru_with_initial_state, 10, exact=EXACT, min_coexecuted=5)
    # the user's model, its embedding, GRU and dense layer inside: one call skipped a step
    assert outcome.stats.skipped_layer_calls == outcome.stats.coexecuted, outcome.report()
    assert "region off" not in outcome.explain, outcome.report()
