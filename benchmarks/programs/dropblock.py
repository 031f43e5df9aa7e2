"""CNN regularized with DropBlock whose ``keep_prob`` is annealed every step.

``DropBlock2D`` keeps ``keep_prob`` as a plain Python attribute (as the original TF2 layer
does) and the step lowers it linearly from 1.0 with ``set_keep_prob``. The layer also takes a
Python branch on it (no dropping at ``keep_prob == 1``). Under ``tf.function`` the attribute is
read once, while tracing: AutoGraph silently keeps the first value (Python object mutation,
paper Table 3.1). (On its first call ``tf.function`` traces twice, the first time to create the
optimizer's variables, so the step counter advances twice and the frozen value is the second
one, 0.996: the losses differ from eager's from the first step on.)
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, SeedStream, keras


class DropBlock2D(keras.layers.Layer):
    """Drops contiguous ``block_size`` x ``block_size`` regions of a feature map."""

    def __init__(self, keep_prob, block_size, **kwargs):
        super().__init__(**kwargs)
        self.keep_prob = keep_prob
        self.block_size = block_size
        self.seed_stream = SeedStream(1234)

    def set_keep_prob(self, keep_prob=None):
        if keep_prob is not None:
            self.keep_prob = keep_prob

    def call(self, inputs, training=False):
        if not training or self.keep_prob == 1.0:
            return inputs
        _, h, w, c = inputs.shape
        bs = self.block_size
        # gamma: the seed-drop rate that drops (1 - keep_prob) of the units after expansion.
        gamma = (1.0 - self.keep_prob) / bs**2 * (h * w) / ((h - bs + 1) * (w - bs + 1))
        # Seeds only where a whole block fits.
        valid = np.zeros((1, h, w, 1), np.float32)
        valid[:, bs // 2: h - (bs - 1) // 2, bs // 2: w - (bs - 1) // 2, :] = 1.0
        noise = self.seed_stream.uniform(tf.shape(inputs))
        seeds = tf.cast(noise < gamma, inputs.dtype) * valid
        block_mask = 1.0 - tf.nn.max_pool2d(seeds, bs, strides=1, padding="SAME")
        scale = tf.cast(tf.size(block_mask), inputs.dtype) / tf.reduce_sum(block_mask)
        return inputs * block_mask * scale


class DropBlock(Program):
    CONFIGS = {
        "quick": dict(batch=32, size=32, width=16, block=5, target_keep=0.8, anneal=50,
                      n_batches=8),
        "large": dict(batch=64, size=64, width=32, block=7, target_keep=0.8, anneal=1000,
                      n_batches=8),
    }
    FEATURE = "Python attribute keep_prob annealed every step"
    AUTOGRAPH = "wrong"

    def build(self):
        c = self.cfg
        w = c.width
        self.dropblock = DropBlock2D(keep_prob=1.0, block_size=c.block)
        self.model = keras.Sequential([
            keras.Input((c.size, c.size, 3)),
            keras.layers.Conv2D(w, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(2 * w, 3, padding="same", activation="relu"),
            self.dropblock,
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(2 * w, 3, padding="same", activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ])
        self.optimizer = keras.optimizers.Adam(1e-3)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.step = 0
        templates = self.rng.normal(size=(10, c.size, c.size, 3)).astype(np.float32)
        self.data = []
        for _ in range(c.n_batches):
            y = self.rng.integers(0, 10, size=c.batch).astype(np.int32)
            x = templates[y] + self.rng.normal(size=(c.batch, c.size, c.size, 3))
            self.data.append((tf.constant(x.astype(np.float32)), tf.constant(y)))

    def train_step(self, images, labels):
        # Linear schedule from 1.0 to target_keep over `anneal` steps (DropBlock paper, §4.1).
        c = self.cfg
        self.dropblock.set_keep_prob(1.0 - (1.0 - c.target_keep) * min(1.0, self.step / c.anneal))
        self.step += 1
        with self.tape() as tape:
            logits = self.model(images, training=True)
            loss = self.loss_fn(labels, logits)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return loss
