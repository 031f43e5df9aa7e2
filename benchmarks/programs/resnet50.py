"""keras.applications.ResNet50 (weights=None) on small synthetic images, Adam.

A deep static graph: ~50 conv layers with BatchNorm and a 23M-parameter update per step.
AutoGraph handles it.

Only the first step's loss is comparable across modes: from random weights, with few samples
per BatchNorm channel, this training is chaotic. Grappler's arithmetic optimizer, which every
graph mode runs, changes rounding (first-step loss 4e-6 apart), some BatchNorm gradients then
differ by a few percent, and from the second step on the losses of eager and ``tf.function``
differ by 1-30% (bit-identical with ``arithmetic_optimization`` off). A batch of 16 does not
cure it.
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, keras


class ResNet50(Program):
    CONFIGS = {
        "quick": dict(batch=2, size=64, classes=10, n_batches=8),
        "large": dict(batch=16, size=64, classes=10, n_batches=8),
    }
    FEATURE = "deep static model (keras.applications)"

    def build(self):
        c = self.cfg
        self.model = keras.applications.ResNet50(
            weights=None, input_shape=(c.size, c.size, 3), classes=c.classes,
            classifier_activation=None)
        self.optimizer = keras.optimizers.Adam(1e-4)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.data = []
        for _ in range(c.n_batches):
            x = self.rng.uniform(0, 1, size=(c.batch, c.size, c.size, 3)).astype(np.float32)
            y = self.rng.integers(0, c.classes, size=c.batch).astype(np.int32)
            self.data.append((tf.constant(x), tf.constant(y)))

    def train_step(self, images, labels):
        with self.tape() as tape:
            logits = self.model(images, training=True)
            loss = self.loss_fn(labels, logits)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
        return loss
