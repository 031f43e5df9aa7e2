"""GPflow: a sparse variational GP classifier (``gpflow.models.SVGP``, Matern-5/2 kernel,
Bernoulli likelihood, 16 inducing points) trained on minibatches the way GPflow's SVGP notebook
does: ``model.training_loss_closure(iter(dataset))`` (the negative ELBO of the next ``tf.data``
batch, Gauss-Hermite quadrature for the likelihood) minimized with a tf_keras Adam's
``minimize``. The closure is built with ``compile=False``: GPflow's default wraps it in a
``tf.function``, which leaves nothing imperative for Terra (the gradient of a function call is a
stateful op that Terra keeps in Python, so the whole program runs eagerly)."""

import gpflow
import tensorflow as tf
import tf_keras

from benchmarks.corpus.programs import Program, optimizer_variables

POINTS, BATCH, INDUCING = 512, 64, 16


class SVGPClassifier(Program):
    def __init__(self, rng):
        x = rng.uniform(-3, 3, size=(POINTS, 2))
        y = (x[:, :1] ** 2 + x[:, 1:] - 1 + 0.3 * rng.normal(size=(POINTS, 1)) > 0).astype(float)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(BATCH)
        self.model = gpflow.models.SVGP(
            kernel=gpflow.kernels.Matern52(), likelihood=gpflow.likelihoods.Bernoulli(),
            inducing_variable=x[rng.choice(POINTS, INDUCING, replace=False)], num_data=POINTS)
        self.optimizer = tf_keras.optimizers.Adam(learning_rate=0.01)
        self.loss = self.model.training_loss_closure(iter(dataset), compile=False)

    def step(self):
        self.optimizer.minimize(self.loss, self.model.trainable_variables)
        return self.loss()  # the next batch's loss, for the log

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def build(rng):
    return SVGPClassifier(rng)
