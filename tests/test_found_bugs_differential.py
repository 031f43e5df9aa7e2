"""Programs that once killed the process: each runs in a child process (``env=``), since a
TensorFlow CHECK failure aborts it and would take the test runner down with it.

Both are conv nets whose steps alternate between paths that train different variables, so the
optimizer's update of "the k-th variable that has a gradient" reads a joined value of a
different shape on each path, which a later switch-case applies to a different variable per
branch. TF infers the instantiated graph's shapes again from the ops' shape functions; there a
tensor dequeued from one of Terra's queues had none (the captured handle carries no shapes;
``set_shape`` informed Python's graph only), and with the branches using one value as two
shapes Grappler did not recover its rank from the consumers either. The Conv2D reading it was
fused with its bias and activation and recorded with an unknown-rank input shape, which
oneDNN's rewrite read as rank 0: ``tensor_shape.cc: Check failed: d < dims() (1 vs. 0)``.
"""

import random

import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, classification_data, sparse_xent

STEPS = 10
CHILD = {"TF_CPP_MIN_LOG_LEVEL": "3"}


def pooling_choice_program(tape_cls, steps):
    """Per step one of average pooling, max pooling or a strided Conv2D, chosen by a seeded
    ``random.Random``: conv and max alternate for the first steps, then average pooling
    comes (a new path: a fallback). The strided conv's variables get no gradient on the
    pooling paths, so ``apply_gradients`` updates a different variable list per path. The
    first Conv2D reads the fed batch directly."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 8, 0, 5, image=(16, 16, 3))
    conv = tf.keras.layers.Conv2D(8, 3, padding="same")
    down = tf.keras.layers.Conv2D(8, 3, strides=2, padding="same")
    head = tf.keras.layers.Dense(5)
    conv.build((None, 16, 16, 3))
    down.build((None, 16, 16, 8))
    head.build((None, 8))
    variables = conv.trainable_variables + down.trainable_variables + head.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.1)
    optimizer.build(variables)
    loss_fn = sparse_xent()
    choose = random.Random(297)  # conv, max, conv, max, avg, conv, max, avg, avg, avg
    losses, paths = [], []
    for step in range(steps):
        x, y = batch(data, step, 8)
        path = choose.choice(["avg", "max", "conv"])
        with tape_cls() as tape:
            h = tf.nn.relu(conv(x))
            if path == "avg":
                h = tf.nn.avg_pool2d(h, 2, 2, "VALID")
            elif path == "max":
                h = tf.nn.max_pool2d(h, 2, 2, "VALID")
            else:
                h = down(h)
            loss = loss_fn(y, head(tf.reduce_mean(h, axis=[1, 2])))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(
            [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None])
        losses.append(float(loss))
        paths.append(path)
    return {"losses": losses, "paths": paths, "vars": variables,
            "optimizer": list(optimizer.variables)}


def test_paths_training_different_variables_with_a_conv_on_a_fed_batch():
    outcome = assert_same_as_eager(pooling_choice_program, STEPS, expect_fallbacks=(0, 2),
                                   max_traces=8, env=CHILD)
    assert outcome.stats.coexecuted >= 2, outcome.report()


def noisy_heads_program(tape_cls, steps):
    """Input noise drawn by a stateful random op (run in Python, its value fed to the graph)
    is added to the batch before a Conv2D + ReLU; even steps train a 3-unit head, odd steps
    a 5-unit one whose first three logits are used. A different queue (a Python-run op's
    output) feeds the conv, and heads of different shapes join in the optimizer's updates."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 8, 0, 3, image=(8, 8, 3))
    conv = tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu")
    wide, narrow = tf.keras.layers.Dense(5), tf.keras.layers.Dense(3)
    conv.build((None, 8, 8, 3))
    wide.build((None, 4))
    narrow.build((None, 4))
    variables = conv.trainable_variables + wide.trainable_variables + narrow.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.05)
    optimizer.build(variables)
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 8)
        with tape_cls() as tape:
            noisy = tf.constant(x) + 0.1 * tf.random.normal((8, 8, 8, 3))
            features = tf.reduce_mean(conv(noisy), axis=[1, 2])
            logits = wide(features)[:, :3] if step % 2 else narrow(features)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(
            [(g, v) for g, v in zip(grads, variables, strict=True) if g is not None])
        losses.append(float(loss))
    return {"losses": losses, "vars": variables, "optimizer": list(optimizer.variables)}


def test_alternating_heads_with_a_conv_on_python_drawn_noise():
    outcome = assert_same_as_eager(noisy_heads_program, STEPS, max_traces=4, env=CHILD)
    assert outcome.stats.coexecuted >= 4, outcome.report()
