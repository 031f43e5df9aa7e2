"""Keras 3: the WGAN-GP of Keras' example "WGAN-GP overriding ``Model.train_step``", with
smaller convolutional models. A ``keras.Model`` subclass whose ``train_step`` runs three critic
steps, each with its own tape, the gradient penalty computed inside it through a nested tape on
interpolated samples (``gp_tape.watch(interpolated)``: the critic's loss holds a gradient, so
its own gradient is a second-order one), then one generator step; Adam optimizers with
beta_1 0.5, beta_2 0.9, the example's Wasserstein losses and penalty weight 10.

The example's code but for the sizes (16x16 single-channel images, a critic of 16 and 32
filters, a generator from a 32-dimensional latent through 4x4x64 with one upsampling block;
batch 32 in place of 512) and the data, random images in [-1, 1]. ``model.fit`` calls
``train_step`` once per batch (inside a ``tf.function`` unless ``run_eagerly``); this loop calls
it itself so that the eager and Terra runs drive the example's training step without Keras'
``fit`` machinery around it (``keras3_fit`` covers that), and the function mode wraps it in
``tf.function`` as ``fit`` would (``step_function``)."""

import keras
import tensorflow as tf

from benchmarks.corpus.programs import Program, optimizer_variables

IMG_SHAPE, NOISE_DIM, BATCH_SIZE, BATCHES = (16, 16, 1), 32, 32, 8


def conv_block(x, filters, activation, kernel_size=(3, 3), strides=(1, 1), padding="same",
               use_bias=True, use_bn=False, use_dropout=False, drop_value=0.5):
    x = keras.layers.Conv2D(filters, kernel_size, strides=strides, padding=padding,
                            use_bias=use_bias)(x)
    if use_bn:
        x = keras.layers.BatchNormalization()(x)
    x = activation(x)
    if use_dropout:
        x = keras.layers.Dropout(drop_value)(x)
    return x


def get_discriminator_model():
    img_input = keras.layers.Input(shape=IMG_SHAPE)
    x = conv_block(img_input, 16, kernel_size=(5, 5), strides=(2, 2), use_bn=False,
                   use_bias=True, activation=keras.layers.LeakyReLU(0.2), use_dropout=False,
                   drop_value=0.3)
    x = conv_block(x, 32, kernel_size=(5, 5), strides=(2, 2), use_bn=False,
                   activation=keras.layers.LeakyReLU(0.2), use_bias=True, use_dropout=True,
                   drop_value=0.3)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dropout(0.2)(x)
    x = keras.layers.Dense(1)(x)

    d_model = keras.models.Model(img_input, x, name="discriminator")
    return d_model


def upsample_block(x, filters, activation, kernel_size=(3, 3), strides=(1, 1),
                   up_size=(2, 2), padding="same", use_bn=False, use_bias=True,
                   use_dropout=False, drop_value=0.3):
    x = keras.layers.UpSampling2D(up_size)(x)
    x = keras.layers.Conv2D(filters, kernel_size, strides=strides, padding=padding,
                            use_bias=use_bias)(x)

    if use_bn:
        x = keras.layers.BatchNormalization()(x)

    if activation:
        x = activation(x)
    if use_dropout:
        x = keras.layers.Dropout(drop_value)(x)
    return x


def get_generator_model():
    noise = keras.layers.Input(shape=(NOISE_DIM,))
    x = keras.layers.Dense(4 * 4 * 64, use_bias=False)(noise)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.LeakyReLU(0.2)(x)

    x = keras.layers.Reshape((4, 4, 64))(x)
    x = upsample_block(x, 32, keras.layers.LeakyReLU(0.2), strides=(1, 1), use_bias=False,
                       use_bn=True, padding="same", use_dropout=False)
    x = upsample_block(x, 1, keras.layers.Activation("tanh"), strides=(1, 1),
                       use_bias=False, use_bn=True)

    g_model = keras.models.Model(noise, x, name="generator")
    return g_model


class WGAN(keras.Model):
    def __init__(self, discriminator, generator, latent_dim, discriminator_extra_steps=3,
                 gp_weight=10.0):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.latent_dim = latent_dim
        self.d_steps = discriminator_extra_steps
        self.gp_weight = gp_weight

    def compile(self, d_optimizer, g_optimizer, d_loss_fn, g_loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.d_loss_fn = d_loss_fn
        self.g_loss_fn = g_loss_fn

    def gradient_penalty(self, batch_size, real_images, fake_images):
        """Calculates the gradient penalty.

        This loss is calculated on an interpolated image
        and added to the discriminator loss.
        """
        # Get the interpolated image
        alpha = tf.random.normal([batch_size, 1, 1, 1], 0.0, 1.0)
        diff = fake_images - real_images
        interpolated = real_images + alpha * diff

        with tf.GradientTape() as gp_tape:
            gp_tape.watch(interpolated)
            # 1. Get the discriminator output for this interpolated image.
            pred = self.discriminator(interpolated, training=True)

        # 2. Calculate the gradients w.r.t to this interpolated image.
        grads = gp_tape.gradient(pred, [interpolated])[0]
        # 3. Calculate the norm of the gradients.
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=[1, 2, 3]))
        gp = tf.reduce_mean((norm - 1.0) ** 2)
        return gp

    def train_step(self, real_images):
        if isinstance(real_images, tuple):
            real_images = real_images[0]

        # Get the batch size
        batch_size = tf.shape(real_images)[0]

        # For each batch, we are going to perform the
        # following steps as laid out in the original paper:
        # 1. Train the generator and get the generator loss
        # 2. Train the discriminator and get the discriminator loss
        # 3. Calculate the gradient penalty
        # 4. Multiply this gradient penalty with a constant weight factor
        # 5. Add the gradient penalty to the discriminator loss
        # 6. Return the generator and discriminator losses as a loss dictionary

        # Train the discriminator first. The original paper recommends training
        # the discriminator for `x` more steps (typically 5) as compared to
        # one step of the generator. Here we will train it for 3 extra steps
        # as compared to 5 to reduce the training time.
        for _ in range(self.d_steps):
            # Get the latent vector
            random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
            with tf.GradientTape() as tape:
                # Generate fake images from the latent vector
                fake_images = self.generator(random_latent_vectors, training=True)
                # Get the logits for the fake images
                fake_logits = self.discriminator(fake_images, training=True)
                # Get the logits for the real images
                real_logits = self.discriminator(real_images, training=True)

                # Calculate the discriminator loss using the fake and real image logits
                d_cost = self.d_loss_fn(real_img=real_logits, fake_img=fake_logits)
                # Calculate the gradient penalty
                gp = self.gradient_penalty(batch_size, real_images, fake_images)
                # Add the gradient penalty to the original discriminator loss
                d_loss = d_cost + gp * self.gp_weight

            # Get the gradients w.r.t the discriminator loss
            d_gradient = tape.gradient(d_loss, self.discriminator.trainable_variables)
            # Update the weights of the discriminator using the discriminator optimizer
            self.d_optimizer.apply_gradients(
                zip(d_gradient, self.discriminator.trainable_variables))

        # Train the generator
        # Get the latent vector
        random_latent_vectors = tf.random.normal(shape=(batch_size, self.latent_dim))
        with tf.GradientTape() as tape:
            # Generate fake images using the generator
            generated_images = self.generator(random_latent_vectors, training=True)
            # Get the discriminator logits for fake images
            gen_img_logits = self.discriminator(generated_images, training=True)
            # Calculate the generator loss
            g_loss = self.g_loss_fn(gen_img_logits)

        # Get the gradients w.r.t the generator loss
        gen_gradient = tape.gradient(g_loss, self.generator.trainable_variables)
        # Update the weights of the generator using the generator optimizer
        self.g_optimizer.apply_gradients(zip(gen_gradient, self.generator.trainable_variables))
        return {"d_loss": d_loss, "g_loss": g_loss}


# Define the loss functions for the discriminator,
# which should be (fake_loss - real_loss).
# We will add the gradient penalty later to this loss function.
def discriminator_loss(real_img, fake_img):
    real_loss = tf.reduce_mean(real_img)
    fake_loss = tf.reduce_mean(fake_img)
    return fake_loss - real_loss


# Define the loss functions for the generator.
def generator_loss(fake_img):
    return -tf.reduce_mean(fake_img)


class WGANGP(Program):
    def __init__(self, rng):
        self.wgan = WGAN(discriminator=get_discriminator_model(),
                         generator=get_generator_model(), latent_dim=NOISE_DIM,
                         discriminator_extra_steps=3)
        self.wgan.compile(
            d_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
            g_optimizer=keras.optimizers.Adam(learning_rate=0.0002, beta_1=0.5, beta_2=0.9),
            g_loss_fn=generator_loss, d_loss_fn=discriminator_loss)
        # the example scales its images to [-1, 1] (the generator ends in tanh)
        self.data = [tf.constant(rng.uniform(-1, 1, size=(BATCH_SIZE, *IMG_SHAPE)), tf.float32)
                     for _ in range(BATCHES)]

    def step(self):
        logs = self.wgan.train_step(self.next_batch())
        return logs["d_loss"], logs["g_loss"]

    def step_function(self):
        compiled = tf.function(self.wgan.train_step)

        def step():
            logs = compiled(self.next_batch())
            return logs["d_loss"], logs["g_loss"]
        return step

    def variables(self):
        return [*self.wgan.discriminator.variables, *self.wgan.generator.variables,
                *optimizer_variables(self.wgan.d_optimizer),
                *optimizer_variables(self.wgan.g_optimizer)]


def build(rng):
    return WGANGP(rng)
