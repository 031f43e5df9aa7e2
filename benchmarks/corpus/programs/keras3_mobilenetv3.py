"""Keras 3: ``keras.applications.MobileNetV3Small`` built from its config with ``weights=None``
for 32x32 images and 10 classes (squeeze-and-excitation blocks, hard-swish, BatchNormalization,
a Dropout head drawing from Keras' seed generator), trained with a custom tape loop and Keras
3's AdamW, the loop of Keras' "writing a training loop from scratch" guide."""

import keras
import tensorflow as tf

from benchmarks.corpus.programs import Program, optimizer_variables

BATCH, CLASSES, BATCHES = 16, 10, 4


class MobileNetV3Loop(Program):
    def __init__(self, rng):
        self.model = keras.applications.MobileNetV3Small(
            weights=None, input_shape=(32, 32, 3), classes=CLASSES, alpha=0.75,
            include_preprocessing=False)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=False)
        self.optimizer = keras.optimizers.AdamW(learning_rate=1e-3)
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
    return MobileNetV3Loop(rng)
