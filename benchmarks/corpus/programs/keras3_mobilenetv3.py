"""Keras 3: ``keras.applications.MobileNetV3Small`` built from its config with ``weights=None``
for 32x32 images and 10 classes (squeeze-and-excitation blocks, hard-swish, BatchNormalization,
a Dropout head drawing from Keras' seed generator), trained with a custom tape loop and Keras
3's AdamW."""

import keras

from benchmarks.corpus.programs import KerasTapeLoop, image_batches

BATCH, CLASSES, BATCHES = 16, 10, 4


class MobileNetV3Loop(KerasTapeLoop):
    def __init__(self, rng):
        self.model = keras.applications.MobileNetV3Small(
            weights=None, input_shape=(32, 32, 3), classes=CLASSES, alpha=0.75,
            include_preprocessing=False)
        self.loss_fn = keras.losses.SparseCategoricalCrossentropy()
        self.optimizer = keras.optimizers.AdamW(learning_rate=1e-3)
        self.data = image_batches(rng, BATCHES, BATCH, 32, CLASSES)


def build(rng):
    return MobileNetV3Loop(rng)
