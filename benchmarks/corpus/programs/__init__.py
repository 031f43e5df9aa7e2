"""The corpus programs: one module per program, each with ``build(rng) -> Program``.

``rng`` is a seeded ``numpy.random.Generator`` for the synthetic data; the worker has already
seeded Python's ``random``, NumPy's global generator and TensorFlow's global seed, so the
library's own initializers and samplers draw the same numbers in the eager and the Terra run.
"""

from __future__ import annotations

import tensorflow as tf


class Program:
    """One training program: ``step()`` runs one training step of the library and returns its
    loss: a tensor, a number, or a tuple or dict of them where a step has several losses (a
    GAN's); the worker reads it back at once, so that every mode waits for the step's work at
    the same point. ``variables()`` lists every variable the run changes (model and optimizer
    state), in a fixed order, for the final comparison.

    ``step_function()`` is the same step for the ``function`` mode, its TensorFlow work in one
    ``tf.function`` the way the program's tutorial compiles it. Python that runs between steps
    (``next_batch``) must stay outside the function, else it would run once, at tracing, and
    every step would train on the first batch; so each program that can run under
    ``tf.function`` says how, and the default (None) reports the mode n/a.

    ``train`` is the loop; a program whose library owns the loop (``model.fit``) overrides it
    and reports each step's loss through ``tick`` from a callback. ``next_batch`` cycles
    through ``data``, a few pre-made batches (the same in both runs).
    """

    data: list = []
    _cursor = 0

    def next_batch(self):
        batch = self.data[self._cursor % len(self.data)]
        self._cursor += 1
        return batch

    def step(self):
        raise NotImplementedError

    def step_function(self):
        return None

    def variables(self) -> list:
        raise NotImplementedError

    def train(self, steps: int, tick, step=None) -> None:
        step = step or self.step
        for _ in range(steps):
            tick(step())


def optimizer_variables(optimizer) -> list:
    """An optimizer's state: ``variables`` is a method on tf_keras optimizers and a property on
    Keras 3 and Sonnet ones."""
    found = optimizer.variables
    return list(found() if callable(found) else found)


def image_batches(rng, count: int, batch: int, size: int, classes: int) -> list:
    """``count`` batches of (``size`` x ``size`` RGB images, integer labels)."""
    return [(tf.constant(rng.normal(size=(batch, size, size, 3)), tf.float32),
             tf.constant(rng.integers(0, classes, batch)))
            for _ in range(count)]


class KerasTapeLoop(Program):
    """The custom loop of Keras' "training loop from scratch" guide, for a Keras 3 or a tf_keras
    classifier: subclasses set ``model``, ``loss_fn``, ``optimizer`` and ``data``."""

    def step(self):
        images, labels = self.next_batch()
        with tf.GradientTape() as tape:
            loss = self.loss_fn(labels, self.model(images, training=True))
        params = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.optimizer)]
