"""Keras 3: the conditional GAN of TensorFlow's pix2pix tutorial, at 32x32 in place of 256x256.
A U-Net generator (strided Conv2D downsampling blocks, Conv2DTranspose upsampling blocks with
BatchNormalization, Dropout in the first upsampling blocks, skip connections through
Concatenate, a tanh output) and a PatchGAN discriminator on the (input, target) pair; one train
step opens two tapes in one ``with`` (``gen_tape``, ``disc_tape``), computes the generator's
GAN + 100 x L1 loss and the discriminator's loss on real and generated pairs, and applies two
Adam optimizers (2e-4, beta_1 0.5).

The tutorial's code but for the sizes (five downsampling blocks in place of eight, filters
divided by four or eight, so that the bottleneck is 1x1 as in the tutorial), random image
pairs for the data, and the TensorBoard summaries of its ``train_step`` left out, with the
step argument they are tagged with (its loop writes them to disk); ``train_step`` returns the
two losses for the log. Its batch size is the
tutorial's: 1. The eager and Terra runs call ``train_step`` undecorated, the function mode
wraps it in ``tf.function`` as the tutorial does (``step_function``)."""

import keras
import tensorflow as tf

from benchmarks.corpus.programs import Program, optimizer_variables

SIZE, OUTPUT_CHANNELS, BATCH_SIZE, BATCHES = 32, 3, 1, 8
LAMBDA = 100


def downsample(filters, size, apply_batchnorm=True):
    initializer = tf.random_normal_initializer(0., 0.02)

    result = keras.Sequential()
    result.add(
        keras.layers.Conv2D(filters, size, strides=2, padding="same",
                            kernel_initializer=initializer, use_bias=False))

    if apply_batchnorm:
        result.add(keras.layers.BatchNormalization())

    result.add(keras.layers.LeakyReLU())

    return result


def upsample(filters, size, apply_dropout=False):
    initializer = tf.random_normal_initializer(0., 0.02)

    result = keras.Sequential()
    result.add(
        keras.layers.Conv2DTranspose(filters, size, strides=2, padding="same",
                                     kernel_initializer=initializer, use_bias=False))

    result.add(keras.layers.BatchNormalization())

    if apply_dropout:
        result.add(keras.layers.Dropout(0.5))

    result.add(keras.layers.ReLU())

    return result


def Generator():
    inputs = keras.layers.Input(shape=[SIZE, SIZE, 3])

    down_stack = [
        downsample(16, 4, apply_batchnorm=False),  # (batch_size, 16, 16, 16)
        downsample(32, 4),  # (batch_size, 8, 8, 32)
        downsample(64, 4),  # (batch_size, 4, 4, 64)
        downsample(64, 4),  # (batch_size, 2, 2, 64)
        downsample(64, 4),  # (batch_size, 1, 1, 64)
    ]

    up_stack = [
        upsample(64, 4, apply_dropout=True),  # (batch_size, 2, 2, 128)
        upsample(64, 4, apply_dropout=True),  # (batch_size, 4, 4, 128)
        upsample(32, 4),  # (batch_size, 8, 8, 64)
        upsample(16, 4),  # (batch_size, 16, 16, 32)
    ]

    initializer = tf.random_normal_initializer(0., 0.02)
    last = keras.layers.Conv2DTranspose(OUTPUT_CHANNELS, 4, strides=2, padding="same",
                                        kernel_initializer=initializer,
                                        activation="tanh")  # (batch_size, 32, 32, 3)

    x = inputs

    # Downsampling through the model
    skips = []
    for down in down_stack:
        x = down(x)
        skips.append(x)

    skips = reversed(skips[:-1])

    # Upsampling and establishing the skip connections
    for up, skip in zip(up_stack, skips):
        x = up(x)
        x = keras.layers.Concatenate()([x, skip])

    x = last(x)

    return keras.Model(inputs=inputs, outputs=x)


def Discriminator():
    initializer = tf.random_normal_initializer(0., 0.02)

    inp = keras.layers.Input(shape=[SIZE, SIZE, 3], name="input_image")
    tar = keras.layers.Input(shape=[SIZE, SIZE, 3], name="target_image")

    x = keras.layers.concatenate([inp, tar])  # (batch_size, 32, 32, channels*2)

    down1 = downsample(16, 4, False)(x)  # (batch_size, 16, 16, 16)
    down2 = downsample(32, 4)(down1)  # (batch_size, 8, 8, 32)
    down3 = downsample(64, 4)(down2)  # (batch_size, 4, 4, 64)

    zero_pad1 = keras.layers.ZeroPadding2D()(down3)  # (batch_size, 6, 6, 64)
    conv = keras.layers.Conv2D(128, 4, strides=1, kernel_initializer=initializer,
                               use_bias=False)(zero_pad1)  # (batch_size, 3, 3, 128)

    batchnorm1 = keras.layers.BatchNormalization()(conv)

    leaky_relu = keras.layers.LeakyReLU()(batchnorm1)

    zero_pad2 = keras.layers.ZeroPadding2D()(leaky_relu)  # (batch_size, 5, 5, 128)

    last = keras.layers.Conv2D(1, 4, strides=1,
                               kernel_initializer=initializer)(zero_pad2)  # (batch_size, 2, 2, 1)

    return keras.Model(inputs=[inp, tar], outputs=last)


loss_object = keras.losses.BinaryCrossentropy(from_logits=True)


def generator_loss(disc_generated_output, gen_output, target):
    gan_loss = loss_object(tf.ones_like(disc_generated_output), disc_generated_output)

    # Mean absolute error
    l1_loss = tf.reduce_mean(tf.abs(target - gen_output))

    total_gen_loss = gan_loss + (LAMBDA * l1_loss)

    return total_gen_loss, gan_loss, l1_loss


def discriminator_loss(disc_real_output, disc_generated_output):
    real_loss = loss_object(tf.ones_like(disc_real_output), disc_real_output)

    generated_loss = loss_object(tf.zeros_like(disc_generated_output), disc_generated_output)

    total_disc_loss = real_loss + generated_loss

    return total_disc_loss


class Pix2Pix(Program):
    def __init__(self, rng):
        self.generator = Generator()
        self.discriminator = Discriminator()
        self.generator_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)
        self.discriminator_optimizer = keras.optimizers.Adam(2e-4, beta_1=0.5)
        # the tutorial's images are normalized to [-1, 1]
        self.data = [tuple(tf.constant(rng.uniform(-1, 1, size=(BATCH_SIZE, SIZE, SIZE, 3)),
                                       tf.float32) for _ in range(2))
                     for _ in range(BATCHES)]

    def train_step(self, input_image, target):
        generator, discriminator = self.generator, self.discriminator
        generator_optimizer = self.generator_optimizer
        discriminator_optimizer = self.discriminator_optimizer
        with tf.GradientTape() as gen_tape, tf.GradientTape() as disc_tape:
            gen_output = generator(input_image, training=True)

            disc_real_output = discriminator([input_image, target], training=True)
            disc_generated_output = discriminator([input_image, gen_output], training=True)

            gen_total_loss, gen_gan_loss, gen_l1_loss = generator_loss(
                disc_generated_output, gen_output, target)
            disc_loss = discriminator_loss(disc_real_output, disc_generated_output)

        generator_gradients = gen_tape.gradient(gen_total_loss,
                                                generator.trainable_variables)
        discriminator_gradients = disc_tape.gradient(disc_loss,
                                                     discriminator.trainable_variables)

        generator_optimizer.apply_gradients(zip(generator_gradients,
                                                generator.trainable_variables))
        discriminator_optimizer.apply_gradients(zip(discriminator_gradients,
                                                    discriminator.trainable_variables))
        return gen_total_loss, disc_loss

    def step(self):
        input_image, target = self.next_batch()
        return self.train_step(input_image, target)

    def step_function(self):
        compiled = tf.function(self.train_step)
        return lambda: compiled(*self.next_batch())

    def variables(self):
        return [*self.generator.variables, *self.discriminator.variables,
                *optimizer_variables(self.generator_optimizer),
                *optimizer_variables(self.discriminator_optimizer)]


def build(rng):
    return Pix2Pix(rng)
