"""A checkpoint saved between steps costs the graph nothing: the optimizer's update stays a
skipped library call (``terra.library_regions``), whichever Keras made it, although a save
changes the checkpoint bookkeeping TF keeps on the optimizer object."""

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager


def _saving_loop(keras, tape_cls, steps, directory):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam(1e-2)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((steps, 16, 8)).astype("float32")
    ys = rng.standard_normal((steps, 16, 1)).astype("float32")
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer),
                                         directory, max_to_keep=2)
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            loss = tf.reduce_mean((model(tf.constant(xs[step]), training=True) - ys[step]) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(loss)
        if step % 3 == 2:
            manager.save()
    found = optimizer.variables
    return {"losses": losses, "variables": model.variables + list(
        found() if callable(found) else found)}


@pytest.mark.parametrize("which", ["keras3", "tf_keras"])
def test_a_checkpoint_saved_between_steps_keeps_the_update_skipped(which, tmp_path):
    keras = tf.keras if which == "keras3" else pytest.importorskip("tf_keras")
    runs = iter(("eager", "terra"))

    def program(tape_cls, steps):
        return _saving_loop(keras, tape_cls, steps, str(tmp_path / next(runs)))

    outcome = assert_same_as_eager(program, 12, exact=("losses", "variables"), min_coexecuted=6)
    assert outcome.stats.skipped_calls >= outcome.stats.coexecuted, outcome.report()
    assert "library region off" not in outcome.explain, outcome.report()
