"""The base class of the benchmark programs: seeding, config lookup, a cycling batch pool."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import keras
import numpy as np
import tensorflow as tf


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

