"""The headline program, eager vs Terra: same losses and variables, and it co-executes."""

import numpy as np
import tensorflow as tf

import terra


def _mlp_program(tape_cls, steps=10):
    tf.keras.utils.set_random_seed(0)
    keras = tf.keras
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    opt = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((steps, 16, 32)).astype("float32")
    ys = rng.integers(0, 10, (steps, 16)).astype("int32")
    losses = []
    for i in range(steps):
        with tape_cls() as tape:
            loss = loss_fn(ys[i], model(xs[i], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(loss)
    return [float(x) for x in losses], [v.numpy() for v in model.variables]


def test_mlp_same_as_eager_and_coexecutes():
    eager_losses, eager_vars = _mlp_program(tf.GradientTape)
    terra.reset()
    losses, variables = _mlp_program(terra.TerraGradientTape)
    s = terra.stats()
    np.testing.assert_allclose(losses, eager_losses, rtol=1e-6)
    for a, b in zip(variables, eager_vars):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert s.traces <= 2, terra.explain()
    assert s.coexecuted > 0, terra.explain()
