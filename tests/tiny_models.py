"""Tiny models and data for the differential programs: a few ms per training step on a CPU.

Builders use ``tf.keras`` only, so the same program runs under Keras 3 and, with
``TF_USE_LEGACY_KERAS=1``, under tf_keras.
"""

import numpy as np
import tensorflow as tf


def classification_data(samples, features, classes, seed=0, image=None):
    """Gaussian inputs (float32, optionally shaped as ``image``) and int32 labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, *(image or (features,)))).astype(np.float32)
    y = rng.integers(0, classes, samples).astype(np.int32)
    return x, y


def batch(data, step, size):
    """The ``step``-th slice of each array in ``data``: a plain numpy batch, fed as a constant."""
    return tuple(array[step * size : (step + 1) * size] for array in data)


def mlp(features, hidden, classes, **dense_kwargs):
    layers = [tf.keras.Input((features,))]
    layers += [tf.keras.layers.Dense(units, activation="relu", **dense_kwargs) for units in hidden]
    layers.append(tf.keras.layers.Dense(classes))
    return tf.keras.Sequential(layers)


def sparse_xent():
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def mlp_task(steps, optimizer=None):
    """The usual small task, seeded: data for ``steps`` batches of 16, a 20-16-5 MLP, an
    optimizer (Adam 1e-2 unless one is given) and the loss. Returns them in that order."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, 20, 5)
    model = mlp(20, (16,), 5)
    return data, model, optimizer or tf.keras.optimizers.Adam(1e-2), sparse_xent()


def state(model, *optimizers):
    """Everything training changes: all model variables (BatchNorm moving statistics included)
    and every optimizer variable (slots, iteration counter)."""
    result = {"model": list(model.variables)}
    for index, optimizer in enumerate(optimizers):
        result[f"optimizer{index}"] = list(optimizer.variables)
    return result


def mlp_loop(tape_cls, steps):
    """The plain training loop on ``mlp_task``: tape, gradient, optimizer, loss read back."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}
