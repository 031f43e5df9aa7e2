"""DCGAN on 28x28 synthetic images (the TensorFlow DCGAN tutorial, scaled down).

Two tapes are open at once (generator and discriminator) and two optimizers step after them;
the latent noise is drawn inside the step from a seed stream (``base.SeedStream``: Keras 3's
seed generator, as the Keras 3 DCGAN example uses, in plain TensorFlow so tf_keras runs it too).
AutoGraph handles it.
"""

import numpy as np
import tensorflow as tf

from benchmarks.programs.base import Program, SeedStream, keras


class DCGAN(Program):
    CONFIGS = {
        "quick": dict(batch=16, noise=32, width=16, n_batches=8),
        "large": dict(batch=64, noise=100, width=64, n_batches=8),
    }
    FEATURE = "two tapes open at once, two optimizers"

    def build(self):
        c = self.cfg
        w = c.width
        self.generator = keras.Sequential([
            keras.Input((c.noise,)),
            keras.layers.Dense(7 * 7 * 4 * w, use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.LeakyReLU(),
            keras.layers.Reshape((7, 7, 4 * w)),
            keras.layers.Conv2DTranspose(2 * w, 5, strides=1, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.LeakyReLU(),
            keras.layers.Conv2DTranspose(w, 5, strides=2, padding="same", use_bias=False),
            keras.layers.BatchNormalization(),
            keras.layers.LeakyReLU(),
            keras.layers.Conv2DTranspose(1, 5, strides=2, padding="same", activation="tanh"),
        ])
        self.discriminator = keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(w, 5, strides=2, padding="same"),
            keras.layers.LeakyReLU(),
            keras.layers.Dropout(0.3),
            keras.layers.Conv2D(2 * w, 5, strides=2, padding="same"),
            keras.layers.LeakyReLU(),
            keras.layers.Dropout(0.3),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ])
        self.cross_entropy = keras.losses.BinaryCrossentropy(from_logits=True)
        self.generator_optimizer = keras.optimizers.Adam(1e-4)
        self.discriminator_optimizer = keras.optimizers.Adam(1e-4)
        self.noise = SeedStream(self.seed)
        # "Real" images: smooth random blobs in [-1, 1].
        self.data = []
        grid = np.stack(np.meshgrid(np.arange(28), np.arange(28), indexing="ij"), -1)
        for _ in range(c.n_batches):
            centres = self.rng.uniform(6, 22, size=(c.batch, 1, 1, 2))
            d2 = ((grid[None] - centres) ** 2).sum(-1, keepdims=True)
            images = (2 * np.exp(-d2 / 20.0) - 1).astype(np.float32)
            self.data.append((tf.constant(images),))

    def train_step(self, images):
        noise = self.noise.normal((self.cfg.batch, self.cfg.noise))
        with self.tape() as gen_tape, self.tape() as disc_tape:
            generated = self.generator(noise, training=True)
            real_output = self.discriminator(images, training=True)
            fake_output = self.discriminator(generated, training=True)
            gen_loss = self.cross_entropy(tf.ones_like(fake_output), fake_output)
            disc_loss = (self.cross_entropy(tf.ones_like(real_output), real_output)
                         + self.cross_entropy(tf.zeros_like(fake_output), fake_output))
        gen_vars = self.generator.trainable_variables
        disc_vars = self.discriminator.trainable_variables
        gen_grads = gen_tape.gradient(gen_loss, gen_vars)
        disc_grads = disc_tape.gradient(disc_loss, disc_vars)
        self.generator_optimizer.apply_gradients(zip(gen_grads, gen_vars, strict=True))
        self.discriminator_optimizer.apply_gradients(zip(disc_grads, disc_vars, strict=True))
        return gen_loss, disc_loss
