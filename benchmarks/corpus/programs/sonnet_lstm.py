"""Sonnet 2: ``snt.LSTM`` unrolled over a sequence with ``snt.static_unroll`` (Sonnet's own
Python loop over time steps) and a ``snt.Linear`` read-out predicting the next value of noisy
sine waves, trained with ``snt.optimizers.Adam`` and a tape."""

import numpy as np
import sonnet as snt
import tensorflow as tf

from benchmarks.corpus.programs import Program

BATCH, TIME, HIDDEN, BATCHES = 16, 12, 32, 6


class SonnetLSTM(Program):
    def __init__(self, rng):
        self.core = snt.LSTM(HIDDEN)
        self.readout = snt.Linear(1)
        self.optimizer = snt.optimizers.Adam(learning_rate=3e-3)
        self.data = []
        for _ in range(BATCHES):
            phase = rng.uniform(0, 2 * np.pi, size=(1, BATCH, 1))
            t = np.arange(TIME + 1).reshape(-1, 1, 1) * 0.3
            waves = np.sin(t + phase) + 0.05 * rng.normal(size=(TIME + 1, BATCH, 1))
            self.data.append((tf.constant(waves[:-1], tf.float32),  # time-major inputs
                              tf.constant(waves[1:], tf.float32)))

    def step(self):
        inputs, targets = self.next_batch()
        with tf.GradientTape() as tape:
            outputs, _ = snt.static_unroll(self.core, inputs, self.core.initial_state(BATCH))
            predictions = snt.BatchApply(self.readout)(outputs)
            loss = tf.reduce_mean(tf.square(predictions - targets))
        params = [*self.core.trainable_variables, *self.readout.trainable_variables]
        self.optimizer.apply(tape.gradient(loss, params), params)
        return loss

    def variables(self):
        return [*self.core.variables, *self.readout.variables, *self.optimizer.variables]


def build(rng):
    return SonnetLSTM(rng)
