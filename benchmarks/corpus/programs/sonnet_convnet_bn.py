"""Sonnet 2: a small ConvNet of ``snt.Conv2D`` + ``snt.BatchNorm`` (batch statistics in training,
moving averages updated by Sonnet's own ``ExponentialMovingAverage``) and ``snt.Linear``,
trained with ``snt.optimizers.Momentum`` and a tape on 32x32 RGB images (CIFAR-10 shapes)."""

import sonnet as snt
import tensorflow as tf

from benchmarks.corpus.programs import Program

BATCH, CLASSES, BATCHES = 32, 10, 6


class ConvNet(snt.Module):
    def __init__(self):
        super().__init__()
        self.convs = [snt.Conv2D(c, 3, stride=s) for c, s in ((16, 1), (32, 2), (32, 2))]
        self.norms = [snt.BatchNorm(create_scale=True, create_offset=True) for _ in self.convs]
        self.head = snt.Linear(CLASSES)

    def __call__(self, images, is_training):
        x = images
        for conv, norm in zip(self.convs, self.norms):
            x = tf.nn.relu(norm(conv(x), is_training=is_training))
        return self.head(tf.reduce_mean(x, axis=[1, 2]))


class SonnetConvNet(Program):
    def __init__(self, rng):
        self.model = ConvNet()
        self.optimizer = snt.optimizers.Momentum(learning_rate=0.05, momentum=0.9)
        self.data = [(tf.constant(rng.normal(size=(BATCH, 32, 32, 3)), tf.float32),
                      tf.constant(rng.integers(0, CLASSES, BATCH)))
                     for _ in range(BATCHES)]
        self.i = 0

    def step(self):
        images, labels = self.data[self.i % BATCHES]
        self.i += 1
        with tf.GradientTape() as tape:
            logits = self.model(images, is_training=True)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits))
        params = self.model.trainable_variables
        self.optimizer.apply(tape.gradient(loss, params), params)
        return loss

    def variables(self):
        return [*self.model.variables, *self.optimizer.variables]


def build(rng):
    return SonnetConvNet(rng)
