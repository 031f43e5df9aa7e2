"""Pre-activation ResNet with stochastic down-sampling points (SDPoint).

Every step the training code picks, with Python's ``random``, the block after which the feature
map is down-sampled and the down-sampling ratio (or no down-sampling), and sets them as
attributes of the model. Under ``tf.function`` the choice is made once, while tracing:
AutoGraph silently freezes the first choice (Python object mutation, paper Table 3.1).
"""

import random

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras


class PreActBlock(keras.layers.Layer):
    def __init__(self, filters, stride, **kwargs):
        super().__init__(**kwargs)
        self.bn1 = keras.layers.BatchNormalization()
        self.conv1 = keras.layers.Conv2D(filters, 3, strides=stride, padding="same",
                                         use_bias=False)
        self.bn2 = keras.layers.BatchNormalization()
        self.conv2 = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)
        self.stride, self.filters = stride, filters
        self.shortcut = None

    def build(self, input_shape):
        if self.stride != 1 or input_shape[-1] != self.filters:
            self.shortcut = keras.layers.Conv2D(self.filters, 1, strides=self.stride,
                                                use_bias=False)

    def call(self, x, training=False):
        out = tf.nn.relu(self.bn1(x, training=training))
        shortcut = self.shortcut(out) if self.shortcut is not None else x
        out = self.conv1(out)
        out = self.conv2(tf.nn.relu(self.bn2(out, training=training)))
        return out + shortcut


class SDPointResNet(keras.Model):
    def __init__(self, width, blocks_per_stage, classes, **kwargs):
        super().__init__(**kwargs)
        self.stem = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)
        self.blocks = []
        for stage, mult in enumerate((1, 2, 4)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                self.blocks.append(PreActBlock(width * mult, stride))
        self.bn = keras.layers.BatchNormalization()
        self.fc = keras.layers.Dense(classes)
        # SDPoint instance: down-sample after block `sdpoint_block` by `sdpoint_ratio`.
        self.sdpoint_block = None
        self.sdpoint_ratio = 1.0

    def set_sdpoint(self, block, ratio):
        self.sdpoint_block, self.sdpoint_ratio = block, ratio

    def call(self, x, training=False):
        x = self.stem(x)
        for i, block in enumerate(self.blocks):
            x = block(x, training=training)
            if training and i == self.sdpoint_block:
                h, w = x.shape[1], x.shape[2]
                size = (int(h * self.sdpoint_ratio), int(w * self.sdpoint_ratio))
                x = tf.image.resize(x, size, method="bilinear", antialias=False)
        x = tf.nn.relu(self.bn(x, training=training))
        return self.fc(tf.reduce_mean(x, axis=[1, 2]))


class SDPoint(Program):
    CONFIGS = {
        "quick": dict(batch=16, size=32, width=16, blocks_per_stage=1, n_batches=8),
        "large": dict(batch=64, size=32, width=32, blocks_per_stage=2, n_batches=8),
    }
    FEATURE = "down-sampling point and ratio drawn with Python random, set as attributes"
    AUTOGRAPH = "wrong"
    RATIOS = (0.5, 0.75)

    def build(self):
        c = self.cfg
        self.model = SDPointResNet(c.width, c.blocks_per_stage, 10)
        self.optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        templates = self.rng.normal(size=(10, c.size, c.size, 3)).astype(np.float32)
        self.data = []
        for _ in range(c.n_batches):
            y = self.rng.integers(0, 10, size=c.batch).astype(np.int32)
            x = templates[y] + self.rng.normal(size=(c.batch, c.size, c.size, 3))
            self.data.append((tf.constant(x.astype(np.float32)), tf.constant(y)))
        self.model(self.data[0][0])

    def train_step(self, images, labels):
        # One SDPoint instance per step; `None` (no down-sampling) is one of the instances.
        # Down-sampling after the last block is pointless (global pooling follows).
        block = random.choice([None] + list(range(len(self.model.blocks) - 1)))
        self.model.set_sdpoint(block, random.choice(self.RATIOS))
        with self.tape() as tape:
            logits = self.model(images, training=True)
            loss = self.loss_fn(labels, logits)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return loss
