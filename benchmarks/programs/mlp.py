"""MLP 784-256-256-10 on MNIST-shaped synthetic data, Adam: the headline model.

The most common TF2 custom training loop there is; it has no Python feature that troubles
AutoGraph, so it measures pure per-op overhead (eager pays it on every op of every step).
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras


class MLP(Program):
    CONFIGS = {
        "quick": dict(batch=64, hidden=256, n_batches=16),
        "large": dict(batch=256, hidden=1024, n_batches=16),
    }
    FEATURE = "plain Keras 3 model, Adam"

    def build(self):
        c = self.cfg
        self.model = keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(c.hidden, activation="relu"),
            keras.layers.Dense(c.hidden, activation="relu"),
            keras.layers.Dense(10),
        ])
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        # Learnable synthetic task: the label is the argmax of a fixed random projection.
        proj = self.rng.normal(size=(784, 10)).astype(np.float32)
        self.data = []
        for _ in range(c.n_batches):
            x = self.rng.normal(size=(c.batch, 784)).astype(np.float32)
            y = np.argmax(x @ proj, axis=1).astype(np.int32)
            self.data.append((tf.constant(x), tf.constant(y)))

    def train_step(self, x, y):
        with self.tape() as tape:
            logits = self.model(x, training=True)
            loss = self.loss_fn(y, logits)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return loss
