"""Sonnet 2: ``snt.nets.MLP`` classifier trained with ``snt.optimizers.Adam`` and a tape, the
loop of Sonnet's MNIST example (flattened 28x28 inputs, 10 classes)."""

import sonnet as snt
import tensorflow as tf

from benchmarks.corpus.programs import Program

BATCH, FEATURES, CLASSES, BATCHES = 64, 784, 10, 8


class SonnetMLP(Program):
    def __init__(self, rng):
        self.model = snt.nets.MLP([256, 128, CLASSES])
        self.optimizer = snt.optimizers.Adam(learning_rate=1e-3)
        self.data = [(tf.constant(rng.normal(size=(BATCH, FEATURES)), tf.float32),
                      tf.constant(rng.integers(0, CLASSES, BATCH)))
                     for _ in range(BATCHES)]
        self.i = 0

    def step(self):
        images, labels = self.data[self.i % BATCHES]
        self.i += 1
        with tf.GradientTape() as tape:
            logits = self.model(images)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        params = self.model.trainable_variables
        self.optimizer.apply(tape.gradient(loss, params), params)
        return loss

    def variables(self):
        return [*self.model.variables, *self.optimizer.variables]


def build(rng):
    return SonnetMLP(rng)
