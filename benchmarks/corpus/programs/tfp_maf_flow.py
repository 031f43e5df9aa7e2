"""TensorFlow Probability: a masked autoregressive flow (two ``tfb.MaskedAutoregressiveFlow``
bijectors with ``tfb.AutoregressiveNetwork`` MADE networks, a ``tfb.Permute`` between them) on a
``tfd.TransformedDistribution``, fitted to a 2-D two-moons sample by maximum likelihood with a
tape and a tf_keras Adam."""

import numpy as np
import tensorflow as tf
import tensorflow_probability as tfp
import tf_keras

from benchmarks.corpus.programs import Program, optimizer_variables

tfb, tfd = tfp.bijectors, tfp.distributions
BATCH, BATCHES = 128, 6


def two_moons(rng, n):
    angle = rng.uniform(0, np.pi, n)
    upper = rng.integers(0, 2, n)
    x = np.where(upper, np.cos(angle), 1 - np.cos(angle))
    y = np.where(upper, np.sin(angle), 0.5 - np.sin(angle))
    return np.stack([x, y], axis=1) + 0.05 * rng.normal(size=(n, 2))


class MaskedAutoregressiveFlow(Program):
    def __init__(self, rng):
        self.made = [tfb.AutoregressiveNetwork(params=2, hidden_units=[32, 32]) for _ in range(2)]
        flow = tfb.Chain([tfb.MaskedAutoregressiveFlow(self.made[0]),
                          tfb.Permute([1, 0]),
                          tfb.MaskedAutoregressiveFlow(self.made[1])])
        self.distribution = tfd.TransformedDistribution(
            tfd.MultivariateNormalDiag(loc=tf.zeros(2)), flow)
        self.distribution.log_prob(tf.zeros([1, 2]))  # builds the MADE networks' weights
        self.optimizer = tf_keras.optimizers.Adam(learning_rate=1e-3)
        self.data = [tf.constant(two_moons(rng, BATCH), tf.float32) for _ in range(BATCHES)]

    def step(self):
        x = self.next_batch()
        params = self.distribution.trainable_variables
        with tf.GradientTape() as tape:
            loss = -tf.reduce_mean(self.distribution.log_prob(x))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    def variables(self):
        return [*self.distribution.variables, *optimizer_variables(self.optimizer)]


def build(rng):
    return MaskedAutoregressiveFlow(rng)
