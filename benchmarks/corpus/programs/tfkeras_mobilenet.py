"""tf_keras (``TF_USE_LEGACY_KERAS=1``): ``tf_keras.applications.MobileNetV2`` built from its
config with ``weights=None`` for 32x32 images and 10 classes (inverted residual blocks,
depthwise convolutions, BatchNormalization), trained with a custom tape loop and tf_keras'
SGD with momentum."""

import tf_keras

from benchmarks.corpus.programs import KerasTapeLoop, image_batches

BATCH, CLASSES, BATCHES = 16, 10, 4


class MobileNetLoop(KerasTapeLoop):
    def __init__(self, rng):
        self.model = tf_keras.applications.MobileNetV2(
            weights=None, input_shape=(32, 32, 3), classes=CLASSES, alpha=0.35)
        self.loss_fn = tf_keras.losses.SparseCategoricalCrossentropy()
        self.optimizer = tf_keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        self.data = image_batches(rng, BATCHES, BATCH, 32, CLASSES)


def build(rng):
    return MobileNetLoop(rng)
