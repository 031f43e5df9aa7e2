"""Layer regions: a built-in Keras layer's call skipped by the skeleton keeps eager's numbers,
and every guard that must run the layer's Python does (``terra.layer_regions``).

Each program runs eagerly and under Terra (``differential``); ``skipped_layer_calls`` says
whether co-execution skipped the calls, so a guard that let a call through where it must not
(or a region that never engaged) fails here, not only the numbers."""

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tiny_models import batch, classification_data, sparse_xent, state

import terra
from terra import skips

keras = tf.keras


class Block(keras.layers.Layer):
    """The user's own layer around built-in ones (regions): attention, layer norm, dropout
    and a dense layer; the dropout gets ``training`` from the call context. It counts its
    calls, a Python side effect, so it is no region itself and its layers are regions of
    their own (the user's layers that are regions: ``test_user_layer_regions_differential``);
    the programs return the count, which must be eager's."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attention = keras.layers.MultiHeadAttention(2, 4, dropout=0.1)
        self.norm = keras.layers.LayerNormalization()
        self.drop = keras.layers.Dropout(0.2)
        self.dense = keras.layers.Dense(8, activation="gelu")
        self.calls = 0

    def call(self, x, mask):
        self.calls += 1
        x = self.norm(x + self.attention(x, x, attention_mask=mask))
        return self.dense(self.drop(x))


def _encoder_loop(tape_cls, steps, change=None):
    """A small encoder on token ids fed each step (an embedding reads them), two span-like
    heads; ``change(step, block)`` may change the model from Python before a step."""
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 50, (steps, 4, 6)).astype(np.int32)
    labels = rng.integers(0, 6, (steps, 4)).astype(np.int32)
    embed, block, head = keras.layers.Embedding(50, 8), Block(), keras.layers.Dense(1)
    optimizer = keras.optimizers.Adam(1e-2)
    loss_fn = sparse_xent()
    mask = tf.ones((4, 1, 6), tf.bool)
    embed(ids[0]), block(embed(ids[0]), mask), head(tf.zeros((4, 6, 8)))  # build
    variables = embed.trainable_variables + block.trainable_variables + head.trainable_variables
    losses = []
    for step in range(steps):
        if change is not None:
            change(step, block)
        with tape_cls() as tape:
            h = block(embed(tf.constant(ids[step])), mask, training=step % 3 != 2)
            loss = loss_fn(labels[step], tf.squeeze(head(h), -1))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        losses.append(float(loss))
        record_stats(f"step{step}")
    return {"losses": losses, "variables": variables,
            "optimizer": list(optimizer.variables), "block_calls": block.calls}


def test_built_in_layers_are_skipped_with_eagers_numbers():
    outcome = assert_same_as_eager(_encoder_loop, 12, max_traces=5, min_coexecuted=4)
    # per co-executed step: the embedding, norm, dropout, dense and head calls (attention's
    # call holds a branch, its own dropout runs only in training steps: its Python runs)
    assert outcome.stats.skipped_layer_calls >= 5 * outcome.stats.coexecuted, outcome.report()


def _rate_annealed(step, block):
    block.drop.rate = 0.2 * (1 - step / 12)


def test_a_dropout_rate_changed_from_python_keeps_eagers_numbers():
    outcome = assert_same_as_eager(lambda t, s: _encoder_loop(t, s, _rate_annealed), 12,
                                   expect_fallbacks=(0, 2), max_traces=5, min_coexecuted=2)
    assert "layer region off" in outcome.explain and "rate" in outcome.explain, outcome.report()


_SCALE = [1.0]


def _scaled(x):
    return x * _SCALE[0]  # a Python global the user changes


def _activation_loop(tape_cls, steps):
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 8, 6, 3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation=_scaled),
                              keras.layers.Dense(3)])
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        _SCALE[0] = 1.0 + 0.1 * step
        x, y = batch(data, step, 8)
        with tape_cls() as tape:
            loss = loss_fn(y, model(tf.constant(x), training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}


def test_a_layer_with_the_users_activation_function_runs_its_python():
    outcome = assert_same_as_eager(_activation_loop, 10, expect_fallbacks=(0, 4),
                                   max_traces=8, min_coexecuted=0)
    assert "function of the user's" in outcome.explain, outcome.report()


def _functional_loop(tape_cls, steps, peek_at=None):
    """A functional CNN with BatchNorm, called on a batch fed each step: one region for the
    whole model; at ``peek_at`` Python reads an intermediate the graph does not return."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 8, 0, 3, image=(8, 8, 2))
    inputs = keras.Input((8, 8, 2))
    h = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    h = keras.layers.ReLU()(keras.layers.BatchNormalization()(h))
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = sparse_xent()
    losses, peeked = [], []
    for step in range(steps):
        x, y = batch(data, step, 8)
        with tape_cls() as tape:
            logits = model(tf.constant(x), training=True)
            if step == peek_at:
                peeked.append(logits.numpy())
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, "peeked": peeked, **state(model, optimizer)}


def test_a_functional_model_on_a_fed_batch_is_one_skipped_call():
    outcome = assert_same_as_eager(_functional_loop, 10, min_coexecuted=4)
    assert outcome.stats.skipped_layer_calls == outcome.stats.coexecuted, outcome.report()


def test_a_value_read_from_a_skipped_call_falls_back_with_eagers_numbers():
    outcome = assert_same_as_eager(lambda t, s: _functional_loop(t, s, peek_at=7), 10,
                                   expect_fallbacks=(0, 1), max_traces=3, min_coexecuted=4)
    assert outcome.stats.skipped_layer_calls >= 4, outcome.report()


def test_an_inference_dropout_returns_its_argument_itself():
    drop, dense = keras.layers.Dropout(0.5), keras.layers.Dense(2)
    x = tf.ones((2, 3))
    dense(x)
    same = []
    terra.reset()
    for _ in range(8):
        with terra.TerraGradientTape():
            h = dense(x)
            same.append(drop(h, training=False) is h)
    assert all(same) and terra.stats().skipped_layer_calls >= 2, terra.explain()


def _swapped_loop(tape_cls, steps):
    """Two Dense layers alike (same class, shapes and arguments) applied in an order that
    changes every third step: a skipped call must be the very layer's, not its twin's."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 8, 8, 3)
    a, b, head = keras.layers.Dense(8), keras.layers.Dense(8), keras.layers.Dense(3)
    x0 = tf.zeros((8, 8))
    a(x0), b(x0), head(x0)
    variables = a.trainable_variables + b.trainable_variables + head.trainable_variables
    optimizer = keras.optimizers.SGD(0.1)
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        first, second = (b, a) if step % 3 == 2 else (a, b)
        x, y = batch(data, step, 8)
        with tape_cls() as tape:
            loss = loss_fn(y, head(second(tf.nn.relu(first(tf.constant(x))))))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, "variables": variables}


def test_twin_layers_called_in_another_order_are_told_apart():
    outcome = assert_same_as_eager(_swapped_loop, 12, expect_fallbacks=(0, 2), max_traces=5,
                                   min_coexecuted=3)
    # the head's call is skipped; the twins' ops merged into one path with a branch in it
    assert outcome.stats.skipped_layer_calls >= outcome.stats.coexecuted, outcome.report()


def _softmax_loop(tape_cls, steps):
    """A classifier whose last layer is a softmax: Keras keeps the logits on the output
    tensor (``_keras_logits``) and its cross-entropy computes from them; a stand-in without
    them would send the loss down the clipped-probabilities path (other ops, other numbers)."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 8, 6, 3)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(3, activation="softmax")])
    optimizer = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.CategoricalCrossentropy()
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 8)
        with tape_cls() as tape:
            loss = loss_fn(tf.one_hot(y, 3), model(tf.constant(x), training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}


def test_an_output_carrying_python_attributes_is_not_stood_in_for():
    outcome = assert_same_as_eager(_softmax_loop, 10, min_coexecuted=4)
    assert outcome.stats.skipped_layer_calls == 0, outcome.report()


LENGTHS = (6, 4, 8)  # a sequence length per step, in turn


def _varying_length_loop(tape_cls, steps):
    """``_encoder_loop``'s model on sequences whose length changes every step: every layer
    call sees three input shapes, and Keras' Python feeds its ops sizes it computed from
    them (the attention's and dense layer's reshapes of a 3-D input)."""
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    embed, block = keras.layers.Embedding(50, 8), Block()
    # no biases in the attention: the key's has a gradient of zero but for rounding, which
    # Adam makes a step of, and with shapes that vary the graph's gradient is TF's symbolic
    # one (architecture.md 3.4), which rounds otherwise than eager's tape
    block.attention = keras.layers.MultiHeadAttention(2, 4, dropout=0.1, use_bias=False)
    head = keras.layers.Dense(1, use_bias=False)  # the same holds for a bias under a softmax
    optimizer = keras.optimizers.Adam(1e-2)
    loss_fn = sparse_xent()
    for n in LENGTHS:  # build
        head(block(embed(tf.ones((4, n), tf.int32)), tf.ones((4, 1, n), tf.bool)))
    variables = embed.trainable_variables + block.trainable_variables + head.trainable_variables
    losses = []
    for step in range(steps):
        n = LENGTHS[step % len(LENGTHS)]
        ids = tf.constant(rng.integers(1, 50, (4, n)).astype(np.int32))
        labels = rng.integers(0, n, 4).astype(np.int32)
        with tape_cls() as tape:
            h = block(embed(ids), tf.ones((4, 1, n), tf.bool), training=True)
            loss = loss_fn(labels, tf.squeeze(head(h), -1))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        losses.append(float(loss))
        record_stats(f"step{step}")
    return {"losses": losses, "variables": variables,
            "optimizer": list(optimizer.variables), "block_calls": block.calls}


def test_calls_with_input_shapes_that_vary_are_skipped_once_learned_with_eagers_numbers():
    """Each input shape is learned from two calls run op by op in co-execution (what they
    returned and fed); from then on, the calls with that shape are skipped."""
    steps = 18
    outcome = assert_same_as_eager(_varying_length_loop, steps, max_traces=4, min_coexecuted=10)
    late = outcome.stats.skipped_layer_calls - outcome.stats_at("step11").skipped_layer_calls
    # per step: the embedding, attention, norm, dropout, dense and head calls
    assert late >= 6 * (steps - 12), outcome.report()


def test_a_learned_call_needs_two_calls_that_agree():
    first = skips.Learned(((((4, 6, 8)), 1),), {(0, 1): tf.constant([4, 6])})
    again = skips.Learned(((((4, 6, 8)), 1),), {(0, 1): tf.constant([4, 6])})
    other = skips.Learned(((((4, 6, 8)), 1),), {(0, 1): tf.constant([4, 7])})
    assert first.same(again) and not first.same(other)
    assert not first.same(skips.Learned(((((4, 6, 9)), 1),), {(0, 1): tf.constant([4, 6])}))
