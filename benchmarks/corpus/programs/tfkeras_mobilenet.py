"""tf_keras (``TF_USE_LEGACY_KERAS=1``): ``tf_keras.applications.MobileNetV2`` built from its
config with ``weights=None`` for 32x32 images and 10 classes (inverted residual blocks,
depthwise convolutions, BatchNormalization), trained with a custom tape loop and tf_keras'
SGD with momentum."""

import tensorflow as tf
import tf_keras

from benchmarks.corpus.programs import Program, optimizer_variables

BATCH, CLASSES, BATCHES = 16, 10, 4


class MobileNetLoop(Program):
    def __init__(self, rng):
        self.model = tf_keras.applications.MobileNetV2(
            weights=None, input_shape=(32, 32, 3), classes=CLASSES, alpha=0.35)
        self.loss_fn = tf_keras.losses.SparseCategoricalCrossentropy()
        self.optimizer = tf_keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        self.data = [(tf.constant(rng.uniform(-1, 1, size=(BATCH, 32, 32, 3)), tf.float32),
                      tf.constant(rng.integers(0, CLASSES, BATCH)))
                     for _ in range(BATCHES)]
        self.i = 0

    def step(self):
        images, labels = self.data[self.i % BATCHES]
        self.i += 1
        with tf.GradientTape() as tape:
            loss = self.loss_fn(labels, self.model(images, training=True))
        params = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def build(rng):
    return MobileNetLoop(rng)
