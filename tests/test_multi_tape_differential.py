"""Several tapes per training step: a WGAN-GP's critic steps, each with its own tape and a
nested tape for the gradient penalty, then a generator step. Every tape is an iteration to
Terra, so the program's paths repeat with a period (critic, critic, critic, generator): the
generator's path, met again after co-executed critic iterations, gets a graph of its own
rather than a detour at every generator step.
"""

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager, record_stats

import terra

N_CRITIC, BATCH, NOISE, FEATURES = 3, 32, 16, 32


def wgan_gp(tape_cls, steps):
    """``steps`` WGAN-GP steps (``N_CRITIC`` + 1 tapes each) under Terra's default budget;
    the Terra run notes its stats halfway and at the end of the loop."""
    keras = tf.keras
    keras.utils.set_random_seed(0)
    if tape_cls is terra.TerraGradientTape:
        terra.configure(budget=0.05, min_saving=float("-inf"))
    gen = keras.Sequential([keras.Input((NOISE,)), keras.layers.Dense(64, activation="relu"),
                            keras.layers.Dense(FEATURES)])
    critic = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(64),
                               keras.layers.LeakyReLU(0.2), keras.layers.Dense(1)])
    g_opt = keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9)
    c_opt = keras.optimizers.Adam(1e-3, beta_1=0.5, beta_2=0.9)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((steps, BATCH, FEATURES)).astype("float32")

    def penalty(real, fake):
        alpha = tf.random.uniform([BATCH, 1])
        interp = real + alpha * (fake - real)
        with tape_cls() as gp_tape:
            gp_tape.watch(interp)
            pred = critic(interp, training=True)
        grads = gp_tape.gradient(pred, interp)
        norm = tf.sqrt(tf.reduce_sum(tf.square(grads), axis=1))
        return tf.reduce_mean((norm - 1.0) ** 2)

    c_losses, g_losses = [], []
    for step in range(steps):
        real = data[step]  # a NumPy batch, as a dataset slice would be
        for _ in range(N_CRITIC):
            z = tf.random.normal([BATCH, NOISE])  # drawn before the tape, as tutorials do
            with tape_cls() as tape:
                fake = gen(z, training=True)
                c_loss = tf.reduce_mean(critic(fake, training=True)) - \
                    tf.reduce_mean(critic(real, training=True))
                c_loss += 10.0 * penalty(real, fake)
            grads = tape.gradient(c_loss, critic.trainable_variables)
            c_opt.apply_gradients(zip(grads, critic.trainable_variables))
            c_losses.append(c_loss)
        z = tf.random.normal([BATCH, NOISE])
        with tape_cls() as tape:
            g_loss = -tf.reduce_mean(critic(gen(z, training=True), training=True))
        grads = tape.gradient(g_loss, gen.trainable_variables)
        g_opt.apply_gradients(zip(grads, gen.trainable_variables))
        g_losses.append(g_loss)
        if step == steps // 2:
            record_stats("halfway")
    record_stats("end")  # (reading the results after the loop leaves the last path)
    return {"critic_losses": c_losses, "generator_losses": g_losses,
            "variables": gen.variables + critic.variables + g_opt.variables + c_opt.variables}


def test_critic_and_generator_tapes_converge_to_one_graph():
    steps = 16
    outcome = assert_same_as_eager(wgan_gp, steps, exact=("critic_losses", "generator_losses",
                                                          "variables"),
                                   expect_fallbacks=(0, 3), max_traces=12,
                                   min_coexecuted=steps * (N_CRITIC + 1) // 2,
                                   env={"TERRA_BACKGROUND": "1"})  # as a user runs it
    stats = dict(outcome.timeline)
    assert stats["end"]["fallbacks"] <= 2, outcome.report()  # a detour, then its graph
    assert stats["end"]["fallbacks"] == stats["halfway"]["fallbacks"], outcome.report()
