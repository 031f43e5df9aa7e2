"""Programs the differential fuzzer (``python -m benchmarks.fuzz``) found Terra getting wrong,
written out by hand: each must give eager's numbers under Terra."""

import keras
import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager


def _rnn_data(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((8, 4, 6)).astype("float32"),
             rng.standard_normal((8, 3)).astype("float32")) for _ in range(steps)]


def optimizer_swapped_for_an_unbuilt_one(tape_cls, steps):
    """At step 7 the loop switches to a Keras optimizer never built: its first update creates
    slot variables inside ``tf.init_scope``, which pauses gradient recording, and the graph
    falls back there. The replay ran under that pause, so the replayed gradient was None and
    the next use of a gradient raised (``IterationAborted``) out of Keras' optimizer."""
    keras.utils.set_random_seed(0)
    cell = keras.layers.GRUCell(8)
    cell.build((None, 6))
    head = keras.layers.Dense(3)
    head.build((None, 8))
    params = cell.trainable_weights + head.trainable_weights
    first = keras.optimizers.SGD(0.05, momentum=0.9)
    first.build(params)
    later = keras.optimizers.SGD(0.02, momentum=0.5)
    optimizer = first
    losses = []
    for step, (x, y) in enumerate(_rnn_data(steps)):
        with tape_cls() as tape:
            h = [tf.zeros((8, 8))]
            for t in range(4):
                out, h = cell(x[:, t], h, training=True)
            loss = tf.reduce_mean(tf.square(head(out) - y))
        grads = tape.gradient(loss, params)
        optimizer.apply_gradients(zip(grads, params))
        losses.append(float(loss))
        if step == 6:
            optimizer = later
    return {"losses": losses, "vars": params, "slots": first.variables + later.variables}


def test_fallback_where_recording_is_paused_replays_with_recording_on():
    assert_same_as_eager(optimizer_swapped_for_an_unbuilt_one, 12, rtol=1e-5,
                         expect_fallbacks=(1, None), max_traces=6)


def nested_tape_on_an_activation(tape_cls, steps):
    """An inner tape watches an activation and its gradient feeds the outer loss (a
    second-order term). The inner gradient's source is a tensor of the iteration: the log held
    its stand-in (it looked alive at the iteration's end: a fallback at every step), and a
    replay differentiated with respect to the stand-in, not the replayed value (None, then a
    TypeError out of the replay). A late branch makes the replay happen."""
    rng = np.random.default_rng(0)
    w = tf.Variable(rng.normal(0, 0.4, (6, 8)).astype("float32"))
    u = tf.Variable(rng.normal(0, 0.4, (8, 8)).astype("float32"))
    out = tf.Variable(rng.normal(0, 0.4, (8, 3)).astype("float32"))
    params = [w, u, out]
    losses = []
    for step, (x, y) in enumerate(_rnn_data(steps, seed=1)):
        with tape_cls() as tape:
            h = tf.zeros((8, 8))
            for t in range(4):
                h = tf.tanh(x[:, t] @ w + h @ u)
            with tape_cls() as inner:
                inner.watch(h)
                energy = tf.reduce_sum(tf.tanh(h) ** 2)
            h = h + 0.1 * inner.gradient(energy, h)
            loss = tf.reduce_mean(tf.square(h @ out - y))
            if step >= 8:
                loss = loss + 1e-3 * tf.reduce_sum(tf.square(u))
        grads = tape.gradient(loss, params)
        for g, v in zip(grads, params):
            v.assign_sub(0.05 * g)
        losses.append(float(loss))
    return {"losses": losses, "vars": params}


def test_nested_tape_on_an_activation_coexecutes_and_replays():
    outcome = assert_same_as_eager(nested_tape_on_an_activation, 12, rtol=1e-5,
                                   expect_fallbacks=(1, 2), max_traces=6, min_coexecuted=3)
    assert "outlived its iteration" not in outcome.explain, outcome.report()


def nested_tape_after_a_cycling_branch(tape_cls, steps):
    """The activation a nested tape watches comes out of a branch cycling over three paths and
    a scale read back from the loss. Co-execution fell back at the inner ``tape.gradient``
    itself (its forward pass took a path its recorded gradient was not computed for); the
    gradient then ran on the real tape with the watched activation's stand-in as its source,
    not the replayed value, and returned None (a TypeError in user code)."""
    rng = np.random.default_rng(5)
    emb = tf.Variable(rng.normal(0, 0.4, (20, 8)).astype("float32"))
    out = tf.Variable(rng.normal(0, 0.4, (8, 3)).astype("float32"))
    params = [emb, out]
    mode, scale, losses = 0, 1.0, []
    for step in range(steps):
        ids = tf.constant(rng.integers(0, 20, (8, (3, 5)[step % 2])).astype("int32"))
        y = tf.constant(rng.standard_normal((8, 3)).astype("float32"))
        with tape_cls() as tape:
            h = tf.reduce_mean(tf.gather(emb, ids), axis=1)
            if mode == 1:
                h = tf.tanh(h) * 1.5
            elif mode == 2:
                h = tf.nn.softplus(h) - 0.5
            h = h * scale
            with tape_cls() as inner:
                inner.watch(h)
                energy = tf.reduce_sum(tf.tanh(h) ** 2)
            h = h + 0.1 * inner.gradient(energy, h)
            loss = tf.reduce_mean(tf.square(h @ out - y))
        grads = tape.gradient(loss, params)
        for g, v in zip(grads, params):
            v.assign_sub(0.05 * tf.convert_to_tensor(g))
        losses.append(float(loss))
        mode = (mode + 1) % 3
        scale = 0.5 if float(loss) > 0.38 else 1.0
    return {"losses": losses, "vars": params}


def test_fallback_at_a_nested_gradient_differentiates_the_replayed_value():
    assert_same_as_eager(nested_tape_after_a_cycling_branch, 14, rtol=1e-5,
                         expect_fallbacks=(0, None), max_traces=10, min_coexecuted=1)


def custom_gradient_interrupted_by_a_fallback(tape_cls, steps):
    """Fuzz seed 5015, minimized: a ``tf.custom_gradient`` clip whose input takes one of
    three paths (a random softplus, a recursion of depth 0 or 1). The first iteration on the
    untraced path (no softplus, depth 0) falls back at the clip's own ``tf.identity``, after
    ``tf.custom_gradient`` took its argument as a stand-in; it then recorded its gradient
    over the stand-in, which no replayed op produced, so the clip was bypassed and the
    embedding got the unclipped gradient (7x eager's)."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(5015)
    draws = np.random.default_rng(1).random(steps) < 0.38
    embedding = keras.layers.Embedding(20, 8)
    embedding.build((None, 4))
    head = keras.layers.Dense(3)
    head.build((None, 8))
    params = embedding.trainable_weights + head.trainable_weights

    def deep(h, depth):
        return h if depth == 0 else deep(tf.tanh(h) + 0.5 * h, depth - 1)

    @tf.custom_gradient
    def clip(t):
        def grad(dy):
            return tf.clip_by_value(dy, -0.01, 0.01)
        return tf.identity(t), grad

    losses, grads_seen = [], []
    for step in range(steps):
        x = tf.constant(rng.integers(0, 20, (8, 4)).astype(np.int32))
        y = tf.constant(rng.standard_normal((8, 3)).astype(np.float32))
        with tape_cls() as tape:
            h = tf.reduce_mean(embedding(x), axis=1)
            if draws[step]:
                h = tf.nn.softplus(h) - 0.5
            h = clip(deep(h, step % 2 if step < 5 else 0))
            loss = tf.reduce_mean(tf.square(head(h) - y))
        grads = tape.gradient(loss, params)
        grads_seen.append([tf.convert_to_tensor(g).numpy() for g in grads])
        for g, v in zip(grads, params):
            v.assign_sub(0.05 * tf.convert_to_tensor(g))
        losses.append(float(loss))
    return {"losses": losses, "grads": grads_seen, "params": [v.numpy() for v in params]}


def test_custom_gradient_whose_argument_was_a_stand_in_before_a_fallback():
    outcome = assert_same_as_eager(custom_gradient_interrupted_by_a_fallback, 10,
                                   expect_fallbacks=(1, None), max_traces=10,
                                   min_coexecuted=1)
    assert "new branch" in outcome.explain, outcome.report()


def gradient_through_a_nested_gradient(tape_cls, steps, nested=True):
    """The outer tape differentiates ``h + 0.1 * inner.gradient(o, h)``, so its backward pass
    reads the inner gradient's backward ops; with the batch size changing, the inner region
    was emitted as TF's symbolic gradient, which does not make those ops, and generation
    failed (``KeyError`` on an inner backward op's value: the program never co-executed).
    Then the outer region, fed backward values by the iteration's signature, fell back at
    every step: the signature held the values of the batch's labels (six or eight int32s,
    small enough to be taken for a size), new every step."""
    rng = np.random.default_rng(7036)
    w = tf.Variable(rng.standard_normal((6, 8)).astype(np.float32) * 0.3)
    head = tf.Variable(rng.standard_normal((8, 3)).astype(np.float32) * 0.3)
    losses, grads_seen = [], []
    for step in range(steps):
        batch = (8, 6)[step % 2]
        x = tf.constant(rng.standard_normal((batch, 6)).astype(np.float32))
        y = tf.constant(rng.integers(0, 3, batch).astype(np.int32))
        with tape_cls() as tape:
            h = x @ w
            if nested:
                with tape_cls() as inner:
                    inner.watch(h)
                    o = tf.reduce_sum(tf.tanh(h) ** 2)
                h = h + 0.1 * inner.gradient(o, h)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ head))
        grads = tape.gradient(loss, [w, head])
        grads_seen.append([g.numpy() for g in grads])
        for g, v in zip(grads, [w, head]):
            v.assign_sub(0.05 * g)
        losses.append(float(loss))
    return {"losses": losses, "grads": grads_seen, "params": [w.numpy(), head.numpy()]}


def test_a_gradient_through_a_nested_gradient_under_varying_shapes_is_generated():
    assert_same_as_eager(gradient_through_a_nested_gradient, 12, max_traces=3, min_coexecuted=8)


def test_a_small_batchs_labels_do_not_make_every_signature_new():
    assert_same_as_eager(lambda t, s: gradient_through_a_nested_gradient(t, s, nested=False),
                         12, max_traces=3, min_coexecuted=8)


def masked_rows_behind_dropout(tape_cls, steps):
    """Fuzz seed 6 of ``--only masked_loss,fan_out``, written out: a loss term over the rows
    whose largest logit passes a threshold. Traced steps whose masks kept equally many rows
    make the row count a constant of the recorded backward ops, valid for those masks only:
    at another count the graph fails (a ``Reshape``) and Terra falls back, with eager's
    numbers. (The generated program itself, which crashed there, is run by
    ``tests/test_fuzz_quick.py``.)"""
    keras.utils.set_random_seed(6)
    first, last = keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)
    first.build((None, 6))
    last.build((None, 8))
    drop = keras.layers.Dropout(0.2, seed=3)
    params = first.trainable_weights + last.trainable_weights
    rng = np.random.default_rng(6)
    losses = []
    for _ in range(steps):
        x = tf.constant(rng.standard_normal((8, 6)).astype(np.float32))
        y = tf.constant(rng.standard_normal((8, 3)).astype(np.float32))
        with tape_cls() as tape:
            h = drop(first(x), training=True)
            h = tf.add_n([tf.abs(h) * 0.2, h - tf.stop_gradient(tf.reduce_mean(h, axis=0)),
                          h * h * 0.1]) / 3.0
            logits = last(h)
            loss = tf.reduce_mean(tf.square(logits - y))
            keep = tf.reduce_max(logits, axis=-1) > 0.26
            loss = loss + 0.1 * tf.reduce_sum(tf.square(tf.boolean_mask(logits, keep))) / 8.0
        grads = tape.gradient(loss, params)
        for g, v in zip(grads, params, strict=True):
            v.assign_sub(0.05 * g)
        losses.append(float(loss))
    return {"losses": losses, "variables": params}


def test_masks_of_a_row_count_no_trace_had_fall_back_to_eagers_numbers():
    assert_same_as_eager(masked_rows_behind_dropout, 14, max_traces=10,
                         expect_fallbacks=(0, None), min_coexecuted=2)

