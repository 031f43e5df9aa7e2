"""The base class of the benchmark programs (seeding, config lookup, a cycling batch pool), and
the Keras they are written against.

The programs import ``keras`` from here, not directly: it is whichever Keras ``tf.keras`` resolves
to, tf_keras (Keras 2) when ``TF_USE_LEGACY_KERAS=1`` was set before TensorFlow was imported
(``python -m benchmarks --keras 2``), Keras 3 otherwise. TensorFlow makes that choice; this module
only follows it, so the programs and TensorFlow cannot disagree about which Keras runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import tensorflow as tf


def _keras():
    """The top-level Keras package behind ``tf.keras`` (``tf.keras`` itself is an API module
    without ``__version__``)."""
    return importlib.import_module("tf_keras" if tf.keras.__name__.startswith("tf_keras")
                                   else "keras")


keras = _keras()


class SeedStream:
    """Random draws inside a step that eager, ``tf.function`` and Terra agree on, in either Keras.

    Keras 3's ``keras.random.SeedGenerator`` with ``keras.random.normal(seed=...)`` written in
    plain TensorFlow, because tf_keras has neither: a seed variable advanced by one per draw and
    a stateless op seeded from it. The same steps as Keras 3's TensorFlow backend, so Keras 3
    runs draw the same numbers as with ``keras.random``.
    """

    def __init__(self, seed: int):
        self.state = tf.Variable([seed, 0], dtype=tf.int64, trainable=False,
                                 name="seed_stream_state")

    def _next(self):
        seed = self.state * 1  # a copy, taken before the increment
        self.state.assign_add([0, 1])
        # Stateless ops want an int32 seed; Keras 3 folds the int64 state the same way.
        return tf.cast(tf.math.floormod(seed, tf.int32.max - 1), tf.int32)

    def normal(self, shape):
        return tf.random.stateless_normal(shape, seed=self._next())

    def uniform(self, shape):
        return tf.random.stateless_uniform(shape, seed=self._next())


class Program:
    """Shared plumbing: seeding, config lookup, a cycling pool of pre-generated batches.

    Subclasses set ``CONFIGS`` (``{"quick": {...}, "large": {...}}``), ``FEATURE`` (the Python
    feature that decides how AutoGraph fares, one line) and ``AUTOGRAPH``, how AutoGraph is
    expected to fare: ``"ok"``, ``"fails"`` (raises) or ``"wrong"`` (runs, but its losses differ
    from eager's; the paper's Table 3.1 counts both as failures). They implement ``build()``
    (model, optimizer and ``self.data``, a list of per-step input tuples) and ``train_step``.
    """

    CONFIGS: dict[str, dict] = {}
    FEATURE = "plain training step"
    AUTOGRAPH = "ok"

    def __init__(self, config: str = "quick", seed: int = 0, tape=tf.GradientTape):
        if config not in self.CONFIGS:
            raise ValueError(f"{type(self).__name__}: unknown config {config!r}")
        self.config = config
        self.cfg = SimpleNamespace(**self.CONFIGS[config])
        self.seed = seed
        self.tape = tape
        keras.utils.set_random_seed(seed)  # python random, numpy, tf; Keras seed generators
        self.rng = np.random.default_rng(seed)  # data and host-side sampling
        self._cursor = 0
        self.build()

    def build(self) -> None:
        raise NotImplementedError

    def train_step(self, *batch):
        raise NotImplementedError

    def batches(self, steps: int) -> Iterator[tuple]:
        """The next ``steps`` batches; consecutive calls continue where the last one stopped."""
        for _ in range(steps):
            yield self.data[self._cursor % len(self.data)]
            self._cursor += 1

    def after_step(self, out):
        return out

