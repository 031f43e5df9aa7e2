"""Sonnet 2: a small ConvNet of ``snt.Conv2D`` + ``snt.BatchNorm`` (batch statistics in training,
moving averages updated by Sonnet's own ``ExponentialMovingAverage``) and ``snt.Linear``,
trained with ``snt.optimizers.Momentum`` and a tape on 32x32 RGB images (CIFAR-10 shapes)."""

import sonnet as snt
import tensorflow as tf

from benchmarks.corpus.programs import image_batches
from benchmarks.corpus.programs.sonnet_mlp import SonnetClassifier

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


class SonnetConvNet(SonnetClassifier):
    def __init__(self, rng):
        self.model = ConvNet()
        self.optimizer = snt.optimizers.Momentum(learning_rate=0.05, momentum=0.9)
        self.data = image_batches(rng, BATCHES, BATCH, 32, CLASSES)

    def logits(self, images):
        return self.model(images, is_training=True)


def build(rng):
    return SonnetConvNet(rng)
