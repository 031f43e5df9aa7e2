"""Keras 3: the convolutional variational autoencoder of TensorFlow's CVAE tutorial (a Conv2D
encoder to a mean and a log-variance, a Conv2DTranspose decoder to Bernoulli logits), trained
on binarized 28x28 images with the tutorial's loss: the reparameterization trick (``eps`` from
``tf.random.normal`` drawn inside the train step), a hand-written ``log_normal_pdf`` and the
single-sample Monte Carlo estimate of the ELBO, Adam.

The tutorial's code as it stands (its sizes: 28x28, 32 and 64 filters, latent dimension 2,
batch 32), but for the data, which is random binary images here, and ``train_step`` returning
the loss for the log. Its ``train_step`` is a ``@tf.function``; the eager and Terra runs call it
undecorated, the function mode wraps it (``step_function``)."""

import keras
import numpy as np
import tensorflow as tf

from benchmarks.corpus.programs import Program, optimizer_variables

BATCH, LATENT, BATCHES = 32, 2, 8


class CVAE(keras.Model):
    """Convolutional variational autoencoder."""

    def __init__(self, latent_dim):
        super().__init__()
        self.latent_dim = latent_dim
        self.encoder = keras.Sequential([
            keras.Input(shape=(28, 28, 1)),
            keras.layers.Conv2D(filters=32, kernel_size=3, strides=(2, 2), activation="relu"),
            keras.layers.Conv2D(filters=64, kernel_size=3, strides=(2, 2), activation="relu"),
            keras.layers.Flatten(),
            # No activation
            keras.layers.Dense(latent_dim + latent_dim),
        ])
        self.decoder = keras.Sequential([
            keras.Input(shape=(latent_dim,)),
            keras.layers.Dense(units=7 * 7 * 32, activation="relu"),
            keras.layers.Reshape(target_shape=(7, 7, 32)),
            keras.layers.Conv2DTranspose(filters=64, kernel_size=3, strides=2, padding="same",
                                         activation="relu"),
            keras.layers.Conv2DTranspose(filters=32, kernel_size=3, strides=2, padding="same",
                                         activation="relu"),
            # No activation
            keras.layers.Conv2DTranspose(filters=1, kernel_size=3, strides=1, padding="same"),
        ])

    def encode(self, x):
        mean, logvar = tf.split(self.encoder(x), num_or_size_splits=2, axis=1)
        return mean, logvar

    def reparameterize(self, mean, logvar):
        eps = tf.random.normal(shape=mean.shape)
        return eps * tf.exp(logvar * .5) + mean

    def decode(self, z, apply_sigmoid=False):
        logits = self.decoder(z)
        if apply_sigmoid:
            probs = tf.sigmoid(logits)
            return probs
        return logits


def log_normal_pdf(sample, mean, logvar, raxis=1):
    log2pi = tf.math.log(2. * np.pi)
    return tf.reduce_sum(
        -.5 * ((sample - mean) ** 2. * tf.exp(-logvar) + logvar + log2pi),
        axis=raxis)


def compute_loss(model, x):
    mean, logvar = model.encode(x)
    z = model.reparameterize(mean, logvar)
    x_logit = model.decode(z)
    cross_ent = tf.nn.sigmoid_cross_entropy_with_logits(logits=x_logit, labels=x)
    logpx_z = -tf.reduce_sum(cross_ent, axis=[1, 2, 3])
    logpz = log_normal_pdf(z, 0., 0.)
    logqz_x = log_normal_pdf(z, mean, logvar)
    return -tf.reduce_mean(logpx_z + logpz - logqz_x)


def train_step(model, x, optimizer):
    """Executes one training step and returns the loss.

    This function computes the loss and gradients, and uses the latter to
    update the model's parameters.
    """
    with tf.GradientTape() as tape:
        loss = compute_loss(model, x)
    gradients = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables))
    return loss


class VAEProgram(Program):
    def __init__(self, rng):
        self.model = CVAE(LATENT)
        self.optimizer = keras.optimizers.Adam(1e-4)
        # the tutorial's preprocessing: pixels in [0, 1] thresholded at 0.5
        self.data = [tf.constant(np.where(rng.uniform(size=(BATCH, 28, 28, 1)) > .5, 1.0, 0.0),
                                 tf.float32) for _ in range(BATCHES)]

    def step(self):
        return train_step(self.model, self.next_batch(), self.optimizer)

    def step_function(self):
        compiled = tf.function(train_step)
        return lambda: compiled(self.model, self.next_batch(), self.optimizer)

    def variables(self):
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def build(rng):
    return VAEProgram(rng)
