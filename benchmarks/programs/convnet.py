"""Small conv net with BatchNorm on 28x28 synthetic images, Adam.

BatchNorm adds moving-statistics updates (variable writes inside the forward pass) on top of
the MLP's pattern; AutoGraph handles it.
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras


class ConvNet(Program):
    CONFIGS = {
        "quick": dict(batch=32, width=16, n_batches=16),
        "large": dict(batch=128, width=64, n_batches=16),
    }
    FEATURE = "BatchNorm moving-average updates"

    def build(self):
        c = self.cfg
        w = c.width
        self.model = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(w, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(2 * w, 3, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ])
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        # Ten classes = ten fixed blurry templates plus noise.
        templates = self.rng.normal(size=(10, 28, 28, 1)).astype(np.float32)
        self.data = []
        for _ in range(c.n_batches):
            y = self.rng.integers(0, 10, size=c.batch).astype(np.int32)
            x = templates[y] + self.rng.normal(size=(c.batch, 28, 28, 1)).astype(np.float32)
            self.data.append((tf.constant(x), tf.constant(y)))

    def train_step(self, x, y):
        with self.tape() as tape:
            logits = self.model(x, training=True)
            loss = self.loss_fn(y, logits)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return loss
