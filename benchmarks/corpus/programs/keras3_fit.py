"""Keras 3: ``model.fit(run_eagerly=True)``, Keras' own training loop (its TensorFlow trainer's
``train_step`` opens the ``tf.GradientTape``), on the convnet of Keras' MNIST example (Conv2D,
MaxPooling, Dropout, softmax head) with Adam; per-step losses come from a callback's
``on_train_batch_end`` logs (Keras' running mean of the epoch's losses)."""

import keras
import numpy as np

from benchmarks.corpus.programs import Program, optimizer_variables

BATCH, CLASSES = 32, 10


class LossLog(keras.callbacks.Callback):
    def __init__(self, tick):
        super().__init__()
        self.tick = tick

    def on_train_batch_end(self, batch, logs=None):
        self.tick(logs["loss"])


class KerasFit(Program):
    def __init__(self, rng):
        self.model = keras.Sequential([
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(CLASSES, activation="softmax"),
        ])
        self.model.compile(optimizer=keras.optimizers.Adam(1e-3), run_eagerly=True,
                           loss="sparse_categorical_crossentropy")
        self.rng = rng

    def train(self, steps, tick):
        x = self.rng.uniform(size=(steps * BATCH, 28, 28, 1)).astype(np.float32)
        y = self.rng.integers(0, CLASSES, steps * BATCH)
        self.model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
                       callbacks=[LossLog(tick)])

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.model.optimizer)]


def build(rng):
    return KerasFit(rng)
