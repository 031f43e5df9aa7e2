"""Sonnet 2: ``snt.nets.MLP`` classifier trained with ``snt.optimizers.Adam`` and a tape, the
loop of Sonnet's MNIST example (flattened 28x28 inputs, 10 classes)."""

import sonnet as snt
import tensorflow as tf

from benchmarks.corpus.programs import Program

BATCH, FEATURES, CLASSES, BATCHES = 64, 784, 10, 8


class SonnetClassifier(Program):
    """Sonnet's example loop: subclasses set ``model``, ``optimizer`` (a ``snt.optimizers``
    one, updated with ``apply``), ``data`` and ``logits``."""

    def logits(self, images):
        return self.model(images)

    def step(self):
        images, labels = self.next_batch()
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels, logits=self.logits(images)))
        params = self.model.trainable_variables
        self.optimizer.apply(tape.gradient(loss, params), params)
        return loss

    def variables(self):
        return [*self.model.variables, *self.optimizer.variables]


class SonnetMLP(SonnetClassifier):
    def __init__(self, rng):
        self.model = snt.nets.MLP([256, 128, CLASSES])
        self.optimizer = snt.optimizers.Adam(learning_rate=1e-3)
        self.data = [(tf.constant(rng.normal(size=(BATCH, FEATURES)), tf.float32),
                      tf.constant(rng.integers(0, CLASSES, BATCH)))
                     for _ in range(BATCHES)]


def build(rng):
    return SonnetMLP(rng)
