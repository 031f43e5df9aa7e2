"""GPflow: the exact GP regression of ``gpflow_gpr``, trained with GPflow's default
``model.training_loss_closure()``, which wraps the loss in a ``tf.function``
(``compile=True``): every step's tape (tf_keras' ``minimize``) differentiates a call of a
compiled function, and the loss is evaluated again for the log by another call of it."""

from benchmarks.corpus.programs.gpflow_gpr import GPRegression


class CompiledGPRegression(GPRegression):
    def __init__(self, rng):
        super().__init__(rng)
        self.loss = self.model.training_loss_closure()  # a tf.function (GPflow's default)

    def step(self):
        self.optimizer.minimize(self.loss, self.model.trainable_variables)
        return self.loss()


def build(rng):
    return CompiledGPRegression(rng)
