"""TensorFlow Probability: a Bayesian neural network of ``tfp.layers.DenseReparameterization``
layers (tf_keras layers; every call samples the weights from their posterior with stateful
random ops) fitted by minimizing the negative ELBO (Gaussian negative log-likelihood plus the
layers' KL terms from ``model.losses``) with a tape and a tf_keras Adam."""

import tensorflow as tf
import tensorflow_probability as tfp
import tf_keras

from benchmarks.corpus.programs import Program, optimizer_variables

BATCH, FEATURES, BATCHES, EXAMPLES = 64, 8, 6, 384


class BayesianRegression(Program):
    def __init__(self, rng):
        self.model = tf_keras.Sequential([
            tfp.layers.DenseReparameterization(32, activation="relu"),
            tfp.layers.DenseReparameterization(1),
        ])
        self.optimizer = tf_keras.optimizers.Adam(learning_rate=1e-2)
        true_w = rng.normal(size=(FEATURES, 1))
        self.data = []
        for _ in range(BATCHES):
            x = rng.normal(size=(BATCH, FEATURES))
            y = x @ true_w + 0.1 * rng.normal(size=(BATCH, 1))
            self.data.append((tf.constant(x, tf.float32), tf.constant(y, tf.float32)))
        self.likelihood_scale = 0.5

    def step(self):
        x, y = self.next_batch()
        with tf.GradientTape() as tape:
            predictions = self.model(x, training=True)
            likelihood = tfp.distributions.Normal(predictions, self.likelihood_scale)
            nll = -tf.reduce_mean(likelihood.log_prob(y))
            kl = tf.add_n(self.model.losses) / EXAMPLES
            loss = nll + kl
        params = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, params), params))
        return loss

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def build(rng):
    return BayesianRegression(rng)
