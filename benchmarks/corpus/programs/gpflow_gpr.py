"""GPflow: exact Gaussian-process regression (``gpflow.models.GPR`` with a squared-exponential
kernel, its Cholesky-based marginal likelihood in float64) trained the way GPflow's notebooks do
without Scipy: ``Adam().minimize(model.training_loss, model.trainable_variables)``, one call per
step (tf_keras' optimizer opens the ``tf.GradientTape`` itself; Keras 3 optimizers have no
``minimize``), then the loss evaluated again for the log."""

import gpflow
import numpy as np
import tf_keras

from benchmarks.corpus.programs import Program, optimizer_variables

POINTS, FEATURES = 128, 2


class GPRegression(Program):
    def __init__(self, rng):
        x = rng.uniform(-3, 3, size=(POINTS, FEATURES))
        y = np.sin(x[:, :1]) * np.cos(x[:, 1:]) + 0.1 * rng.normal(size=(POINTS, 1))
        self.model = gpflow.models.GPR(
            (x, y), kernel=gpflow.kernels.SquaredExponential(lengthscales=[1.0] * FEATURES))
        self.optimizer = tf_keras.optimizers.Adam(learning_rate=0.05)

    def step(self):
        self.optimizer.minimize(self.model.training_loss, self.model.trainable_variables)
        return self.model.training_loss()

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def build(rng):
    return GPRegression(rng)
