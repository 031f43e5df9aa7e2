"""Differential tests of Terra's core: ordinary training loops, eagerly and under Terra.

Each program is written the way a user writes an eager loop; only the tape class is a parameter.
What is compared, and Terra's stats bounds, are in ``differential.assert_same_as_eager``.
"""

import copy
import pickle

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, classification_data, mlp, mlp_task, sparse_xent, state

STEPS = 10


# ------------------------------------------------------------------------------------ MLP + Adam


def mlp_adam_program(tape_cls, steps):
    """The README loop: 784-64-64-10 MLP, Adam, the loss logged with float() every step."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 32, 784, 10)
    model = mlp(784, (64, 64), 10)
    optimizer = tf.keras.optimizers.Adam(1e-3)
    loss_fn = sparse_xent()
    losses, grads_per_step = [], []
    for step in range(steps):
        x, y = batch(data, step, 32)
        with tape_cls() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
        grads_per_step.append([g.numpy() for g in grads])
    return {"losses": losses, "grads": grads_per_step, **state(model, optimizer)}


def test_mlp_adam_keras3():
    outcome = assert_same_as_eager(mlp_adam_program, STEPS)
    assert outcome.keras.startswith("keras.")
    # spelled out: the headline program must co-execute with the minimal number of traces
    assert outcome.stats.traces <= 2, outcome.report()
    assert outcome.stats.fallbacks == 0, outcome.report()
    assert outcome.stats.coexecuted > 0, outcome.report()


def test_mlp_adam_legacy_tf_keras_in_subprocess():
    """The same program under tf_keras (Keras 2), which TF picks only if the environment
    variable is set before TensorFlow is imported: hence a child process."""
    outcome = assert_same_as_eager(mlp_adam_program, STEPS, env={"TF_USE_LEGACY_KERAS": "1"})
    assert outcome.keras.startswith("tf_keras."), outcome.keras
    assert outcome.stats.traces <= 2 and outcome.stats.fallbacks == 0, outcome.report()


# ------------------------------------------------------------------------------------ CNN + BN


def cnn_batchnorm_program(tape_cls, steps):
    """Conv + BatchNorm: the moving mean/variance are updated by assignments in the forward
    pass, outside the gradient; they and an inference-mode forward pass must match eager."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, None, 3, image=(8, 8, 1))
    model = tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1)),
            tf.keras.layers.Conv2D(4, 3, padding="same", use_bias=False),
            tf.keras.layers.BatchNormalization(),
            tf.keras.layers.ReLU(),
            tf.keras.layers.Conv2D(4, 3, strides=2),
            tf.keras.layers.BatchNormalization(momentum=0.5),
            tf.keras.layers.ReLU(),
            tf.keras.layers.GlobalAveragePooling2D(),
            tf.keras.layers.Dense(3),
        ]
    )
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = sparse_xent()
    losses, grads_per_step = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(loss)  # materialized after training by the helper
        grads_per_step.append(grads)
    return {
        "losses": losses,
        "grads": grads_per_step,
        "moving_statistics": list(model.non_trainable_variables),
        "inference_logits": model(data[0][:16], training=False),
        **state(model, optimizer),
    }


def test_cnn_batchnorm_moving_statistics():
    assert_same_as_eager(cnn_batchnorm_program, STEPS)


# ------------------------------------------------------------------------------------ DCGAN


def dcgan_program(tape_cls, steps):
    """TF-tutorial DCGAN step: two tapes open at once (one iteration), two optimizers, noise
    from a Keras SeedGenerator (stateless random ops + a seed variable), Dropout in D."""
    tf.keras.utils.set_random_seed(0)
    layers = tf.keras.layers
    generator = tf.keras.Sequential(
        [
            tf.keras.Input((8,)),
            layers.Dense(4 * 4 * 8, use_bias=False),
            layers.BatchNormalization(),
            layers.LeakyReLU(),
            layers.Reshape((4, 4, 8)),
            layers.Conv2DTranspose(4, 3, strides=2, padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.LeakyReLU(),
            layers.Conv2DTranspose(1, 3, padding="same", activation="tanh"),
        ]
    )
    discriminator = tf.keras.Sequential(
        [
            tf.keras.Input((8, 8, 1)),
            layers.Conv2D(4, 3, strides=2, padding="same"),
            layers.LeakyReLU(),
            layers.Dropout(0.3),
            layers.Flatten(),
            layers.Dense(1),
        ]
    )
    g_optimizer, d_optimizer = tf.keras.optimizers.Adam(1e-3), tf.keras.optimizers.Adam(1e-3)
    bce = tf.keras.losses.BinaryCrossentropy(from_logits=True)
    seed = tf.keras.random.SeedGenerator(1)
    images = np.tanh(classification_data(steps * 8, None, 2, image=(8, 8, 1))[0])
    g_losses, d_losses, g_grads_log, d_grads_log = [], [], [], []
    for step in range(steps):
        real = images[step * 8 : (step + 1) * 8]
        noise = tf.keras.random.normal((8, 8), seed=seed)
        with tape_cls() as g_tape, tape_cls() as d_tape:
            fake = generator(noise, training=True)
            real_out = discriminator(real, training=True)
            fake_out = discriminator(fake, training=True)
            g_loss = bce(tf.ones_like(fake_out), fake_out)
            d_loss = bce(tf.ones_like(real_out), real_out) + bce(tf.zeros_like(fake_out), fake_out)
        g_grads = g_tape.gradient(g_loss, generator.trainable_variables)
        d_grads = d_tape.gradient(d_loss, discriminator.trainable_variables)
        g_optimizer.apply_gradients(zip(g_grads, generator.trainable_variables, strict=True))
        d_optimizer.apply_gradients(zip(d_grads, discriminator.trainable_variables, strict=True))
        g_losses.append(g_loss.numpy())
        d_losses.append(d_loss.numpy())
        g_grads_log.append(g_grads)
        d_grads_log.append(d_grads)
    return {
        "g_losses": g_losses,
        "d_losses": d_losses,
        "g_grads": g_grads_log,
        "d_grads": d_grads_log,
        "seed_state": seed.state,
        "generator": state(generator, g_optimizer),
        "discriminator": state(discriminator, d_optimizer),
    }


def test_dcgan_two_tapes_two_optimizers():
    # The noise for step i+1 is drawn before its tape opens, so it belongs to iteration i. After
    # the last step Python never draws it, but the graph already has (advancing the seed
    # variable): reading results after the loop falls back once to undo that speculative tail.
    assert_same_as_eager(dcgan_program, STEPS, expect_fallbacks=(0, 1))


# ------------------------------------------------------------------------------------ fetching


def materialize_everything_program(tape_cls, steps, capsys):
    """Mid-iteration, inside the tape: read tensors in every way Python can and feed a Python
    float derived from all of them back into the loss."""
    import keras  # Keras 3 only (convert_to_numpy); this program never runs under tf_keras

    data, model, optimizer, loss_fn = mlp_task(steps)
    capsys.readouterr()
    keys = ("numpy", "float", "bool", "if", "int", "range", "format")
    seen = {key: [] for key in (*keys, "arrays", "scale", "printed", "losses")}
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
            predicted = tf.argmax(logits, axis=1, output_type=tf.int32)
            correct = tf.reduce_sum(tf.cast(tf.equal(predicted, y), tf.int32))
            loss_value = loss.numpy()
            as_float = float(loss)
            is_nonzero = bool(loss)
            if tf.reduce_max(logits) > 0.5:
                branch = 1.0
            else:
                branch = -1.0
            n_correct = int(correct)
            count = len(range(correct))
            text = f"{loss:.4f}"
            print(loss)
            print(f"step {step}: loss={loss} correct={correct} max={tf.reduce_max(logits):.3f}")
            print(repr(correct), str(predicted))
            arrays = [
                np.asarray(logits),
                np.array(logits),
                np.array(logits, dtype=np.float64),
                keras.ops.convert_to_numpy(logits),
                tf.get_static_value(logits),
                np.from_dlpack(logits),
                pickle.loads(pickle.dumps(logits)).numpy(),
                copy.deepcopy(logits).numpy(),
                np.add(logits, 1.0),
            ]
            scalars = [np.sum(logits), np.float32(loss), np.asarray(loss), np.mean(predicted)]
            scale = 1.0 + 0.01 * (
                float(loss_value) + as_float + is_nonzero + branch + n_correct / 16 + count / 16
            )
            scale += 0.001 * sum(float(np.mean(a)) for a in arrays) + 0.001 * float(text)
            scale += 0.001 * sum(float(s) for s in scalars)
            scaled_loss = loss * scale
        grads = tape.gradient(scaled_loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        fetched = {
            "numpy": loss_value,
            "float": as_float,
            "bool": is_nonzero,
            "if": branch,
            "int": n_correct,
            "range": count,
            "format": text,
        }
        for key, value in fetched.items():
            seen[key].append(value)
        seen["arrays"].append(arrays + [np.asarray(s) for s in scalars])
        seen["scale"].append(scale)
        seen["printed"].append(capsys.readouterr().out)
        seen["losses"].append(scaled_loss.numpy())
    return {**seen, **state(model, optimizer)}


def test_materialize_mid_iteration_every_way_and_feed_back(capsys):
    outcome = assert_same_as_eager(
        lambda tape_cls, steps: materialize_everything_program(tape_cls, steps, capsys), STEPS
    )
    assert all("tf.Tensor(" in text for text in outcome.terra["printed"])


def python_attribute_program(tape_cls, steps):
    """A Python float on an object, changed every step, scales the loss; another one on a
    custom layer scales its output. Python values reach the graph as feeds, not constants."""
    tf.keras.utils.set_random_seed(0)

    class Temperature(tf.keras.layers.Layer):
        def __init__(self):
            super().__init__()
            self.temperature = 1.0

        def call(self, inputs):
            return inputs / self.temperature

    class Trainer:
        def __init__(self):
            self.model = tf.keras.Sequential([mlp(20, (16,), 5), Temperature()])
            self.optimizer = tf.keras.optimizers.Adam(1e-2)
            self.loss_fn = sparse_xent()
            self.scale = 1.0

        def train_step(self, x, y, step):
            self.scale = 1.0 / (step + 1)
            self.model.layers[-1].temperature = 1.0 + 0.25 * step
            with tape_cls() as tape:
                loss = self.scale * self.loss_fn(y, self.model(x, training=True))
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables, strict=True))
            return loss

    data = classification_data(steps * 16, 20, 5)
    trainer = Trainer()
    losses = [float(trainer.train_step(*batch(data, step, 16), step)) for step in range(steps)]
    return {"losses": losses, **state(trainer.model, trainer.optimizer)}


def test_python_float_attribute_changed_every_step():
    """``Temperature`` is the user's layer: its call is a region in the first trace, and the
    attribute it reads changes at the next call, which turns the region off (its Python runs
    from then on) and drops the trace recorded with it: a third trace."""
    assert_same_as_eager(python_attribute_program, STEPS, max_traces=3)


def deferred_materialization_program(tape_cls, steps):
    """Tensors kept past their iteration (losses, gradient norms, a copy of a weight as it was
    that step) and read only after training."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    losses, norms, kernels = [], [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(loss)
        norms.append(tf.linalg.global_norm(grads))
        kernels.append(tf.identity(model.trainable_variables[0]))
    return {
        "losses": [loss.numpy() for loss in losses],
        "norms": [float(norm) for norm in norms],
        "kernels": [np.asarray(kernel) for kernel in kernels],
        **state(model, optimizer),
    }


def test_tensors_materialized_after_training():
    assert_same_as_eager(deferred_materialization_program, STEPS)


def tensor_held_by_a_dropped_tensor_program(tape_cls, steps):
    """Keras 3 attaches a mask to a layer's output tensor (``_keras_mask``): a tensor held only
    by another tensor that dies with the iteration. Neither outlives it; co-execution must not
    take the mask for an escape (it did: a fallback at every iteration of the BERT programs)."""
    data, model, optimizer, loss_fn = mlp_task(steps)

    def forward(x):
        hidden = model(x, training=True)
        hidden.mask_like = tf.greater(hidden, 0.0)
        return hidden * 2.0  # ``hidden`` dies here, and with it the only hold on its mask

    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, forward(x))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return state(model, optimizer)


def test_a_tensor_held_only_by_a_dropped_tensor_is_no_escape():
    assert_same_as_eager(tensor_held_by_a_dropped_tensor_program, STEPS, expect_fallbacks=0,
                         min_coexecuted=STEPS - 4)


# ------------------------------------------------------------------------------------ input


def tf_data_program(tape_cls, steps, epochs):
    """``for x, y in ds`` over a shuffled, batched tf.data pipeline; ``steps`` batches in all.
    The end of each epoch is an IteratorGetNext that fails with OutOfRange -> StopIteration."""
    tf.keras.utils.set_random_seed(0)
    per_epoch = steps // epochs
    x, y = classification_data(per_epoch * 8, 12, 3)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=1).batch(8)
    model = mlp(12, (8,), 3)
    optimizer = tf.keras.optimizers.Adam(1e-2)
    loss_fn = sparse_xent()
    losses, labels = [], []
    for _ in range(epochs):
        for xb, yb in ds:
            with tape_cls() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(float(loss))
            labels.append(yb.numpy())
    return {"losses": losses, "labels": labels, **state(model, optimizer)}


@pytest.mark.parametrize("epochs", [1, 2])
def test_tf_data_for_loop(epochs):
    # the end of the data may cost a fallback per epoch (the graph saw only successful reads)
    assert_same_as_eager(
        lambda tape_cls, steps: tf_data_program(tape_cls, steps, epochs),
        STEPS,
        expect_fallbacks=(0, epochs),
        max_traces=2 + epochs,
    )


# ------------------------------------------------------------------------------------ the tape


def watched_input_program(tape_cls, steps):
    """``tape.watch`` on an input tensor; gradient with nested (dict) sources."""
    data, model, optimizer, loss_fn = mlp_task(steps, tf.keras.optimizers.SGD(0.1))
    losses, input_grads = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        x = tf.constant(x)
        with tape_cls() as tape:
            tape.watch(x)
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, {"input": x, "weights": model.trainable_variables})
        optimizer.apply_gradients(zip(grads["weights"], model.trainable_variables, strict=True))
        losses.append(float(loss))
        input_grads.append(grads["input"].numpy())
    return {"losses": losses, "input_grads": input_grads, **state(model, optimizer)}


def test_watch_input_tensor_gradient():
    assert_same_as_eager(watched_input_program, STEPS)


def persistent_tape_program(tape_cls, steps):
    """A persistent tape asked for two gradients (loss and a weight penalty), then deleted."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    losses, penalty_grads_log = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls(persistent=True) as tape:
            loss = loss_fn(y, model(x, training=True))
            penalty = tf.add_n([tf.reduce_sum(tf.square(w)) for w in model.trainable_variables])
        loss_grads = tape.gradient(loss, model.trainable_variables)
        penalty_grads = tape.gradient(penalty, model.trainable_variables)
        del tape
        grads = [g + 1e-3 * p for g, p in zip(loss_grads, penalty_grads, strict=True)]
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
        penalty_grads_log.append([p.numpy() for p in penalty_grads])
    return {"losses": losses, "penalty_grads": penalty_grads_log, **state(model, optimizer)}


def test_persistent_tape_two_gradient_calls():
    assert_same_as_eager(persistent_tape_program, STEPS)


def unconnected_sources_program(tape_cls, steps):
    """Sources without a gradient path (unused, behind stop_gradient, integer-valued) get
    ``None`` exactly where eager gives ``None``."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, 20, 5)
    model = mlp(20, (16,), 5)
    unused = tf.Variable(tf.ones((5,)), name="unused")
    frozen = tf.Variable(tf.fill((5,), 0.5), name="frozen")
    counter = tf.Variable(0, name="counter")
    optimizer = tf.keras.optimizers.SGD(0.1)
    loss_fn = sparse_xent()
    sources = [*model.trainable_variables, unused, frozen, counter]
    losses, grads_log, none_positions = [], [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            counter.assign_add(1)
            logits = model(x, training=True) + tf.stop_gradient(frozen)
            loss = loss_fn(y, logits)
        grads = tape.gradient(loss, sources)
        none_positions.append([g is None for g in grads])
        optimizer.apply_gradients(
            [
                (g, v)
                for g, v in zip(grads[:-3], model.trainable_variables, strict=True)
                if g is not None
            ]
        )
        losses.append(float(loss))
        grads_log.append(grads)  # the helper compares None positions exactly
    return {
        "losses": losses,
        "grads": grads_log,
        "none_positions": none_positions,
        "extra": [unused, frozen, counter],
        **state(model, optimizer),
    }


def test_unconnected_sources_give_none_like_eager():
    outcome = assert_same_as_eager(unconnected_sources_program, STEPS)
    assert outcome.eager["none_positions"][0][-3:] == [True, True, True]  # the program's premise


# ------------------------------------------------------------------------------------ randomness


def stateful_random_program(tape_cls, steps):
    """Stateful random ops seeded by the global seed (input noise via tf.random.normal, whose
    seed2 differs per call) next to Keras Dropout."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, 20, 5)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((20,)),
            tf.keras.layers.Dense(16, activation="relu"),
            tf.keras.layers.Dropout(0.25),
            tf.keras.layers.Dense(5),
        ]
    )
    optimizer = tf.keras.optimizers.Adam(1e-2)
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            noisy = x + 0.1 * tf.random.normal(x.shape)
            loss = loss_fn(y, model(noisy, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}


def test_stateful_random_ops_and_dropout():
    assert_same_as_eager(stateful_random_program, STEPS)


# ------------------------------------------------------------------------------------ shapes


def batch_16_or_12(data, step):
    """Batches of 16 and 12 rows in turn (a partial last batch, every other step)."""
    x, y = batch(data, step, 16)
    return (x[:12], y[:12]) if step % 2 else (x, y)


def varying_batch_training(tape_cls, steps, forward):
    """The MLP task on batches of 16 and 12 rows in turn; ``forward(tape_cls, model, x, y,
    loss_fn)`` opens the tape(s) and returns ``(tape, loss)``."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    losses, grads_log = [], []
    for step in range(steps):
        x, y = batch_16_or_12(data, step)
        tape, loss = forward(tape_cls, model, x, y, loss_fn)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
        grads_log.append(grads)
    return {"losses": losses, "grads": grads_log, **state(model, optimizer)}


def varying_batch_program(tape_cls, steps):
    """Batches of 16 and 12 rows in turn (a partial last batch, every other step): the graph
    is built with the batch dimension relaxed, and the PythonRunner checks each op's shapes
    against those seen."""
    def forward(tape_cls, model, x, y, loss_fn):
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape, loss

    return varying_batch_training(tape_cls, steps, forward)


def test_batch_size_changing_between_steps():
    """The eager backward pass computes shape-derived values in Python (``Tile`` multiples,
    the count a mean divides by): backward ops read values that change with the batch size.
    The PythonRunner skips that code; the graph computes them in TF's symbolic gradient, so
    both batch sizes co-execute. (The two tests below keep the recorded backward ops, whose
    values are fed by the iteration's signature.)"""
    outcome = assert_same_as_eager(varying_batch_program, 12, expect_fallbacks=0,
                                   max_traces=4, min_coexecuted=6)
    assert "feed[float32 ?x20]" in outcome.explain, outcome.report()


def same_area_images_program(tape_cls, steps):
    """Images whose sizes cycle (4, 4), (4, 6), (6, 4), (5, 5), as a detector's: the two
    traces (the second and third steps) have one area, and a per-pixel weight computed in
    numpy each step (as anchors are) kept its length in both. Raw variables and ops."""
    rng = np.random.default_rng(3)
    kernel = tf.Variable(rng.normal(size=(3, 3, 3, 4)).astype("float32"))
    sizes = [(4, 4), (4, 6), (6, 4), (5, 5)]
    images = [tf.constant(rng.normal(size=(1, h, w, 3)).astype("float32")) for h, w in sizes]
    losses = []
    for step in range(steps):
        image = images[step % len(sizes)]
        h, w = image.shape[1], image.shape[2]
        weights = rng.uniform(size=h * w * 4).astype("float32")  # per pixel and channel
        with tape_cls() as tape:
            features = tf.nn.conv2d(image, kernel, 1, "SAME")
            loss = tf.reduce_sum(tf.reshape(features, [-1]) * weights)
        kernel.assign_sub(0.01 * tape.gradient(loss, kernel))
        losses.append(float(loss))
    return {"losses": losses, "kernel": kernel}


def test_a_value_of_one_length_in_both_traces_is_fed_relaxed_where_image_sizes_vary():
    """The weights' length is the first new one at step 3: with it fixed in the graph that
    step fell back, traced again and built a second graph (a detector's start-up doubled).
    Relaxed, the one graph takes every size."""
    outcome = assert_same_as_eager(same_area_images_program, 12, expect_fallbacks=0,
                                   max_traces=2, min_coexecuted=6)
    assert outcome.stats.graph_generations == 1, outcome.report()


def read_before_the_tape_program(tape_cls, steps):
    """The last layer's kernel is read before the tape that differentiates the loss opens (a
    scale computed from it, in the same iteration: an outer tape is open) and again inside:
    eager's gradient for it flows only through the read inside. With batches of varying size
    the region's backward values vary, so Terra would emit the graph's symbolic gradient;
    that one would also flow through the earlier read (a silently wrong gradient), so here
    the recorded backward ops are kept."""
    def forward(tape_cls, model, x, y, loss_fn):
        with tape_cls():
            scale = 1.0 + tf.reduce_mean(tf.square(model.layers[-1].kernel))
            with tape_cls() as tape:
                loss = loss_fn(y, model(x, training=True) * scale)
        return tape, loss

    return varying_batch_training(tape_cls, steps, forward)


def test_a_variable_read_before_the_tape_gets_the_tapes_gradient():
    assert_same_as_eager(read_before_the_tape_program, 12, expect_fallbacks=0,
                         max_traces=4, min_coexecuted=6)


@tf.custom_gradient
def clip_gradient(x):
    """Identity forward; the backward clips the incoming gradient."""
    return tf.identity(x), lambda dy: tf.clip_by_value(dy, -1e-3, 1e-3)


def custom_gradient_program(tape_cls, steps):
    """A ``tf.custom_gradient`` in the forward pass, with batches of varying size: the graph's
    own gradient of the recorded ops (an Identity) is not the tape's (a clip), so the region
    keeps its recorded backward ops."""
    def forward(tape_cls, model, x, y, loss_fn):
        with tape_cls() as tape:
            loss = loss_fn(y, clip_gradient(model(x, training=True)))
        return tape, loss

    return varying_batch_training(tape_cls, steps, forward)


def test_a_custom_gradient_is_the_tapes():
    assert_same_as_eager(custom_gradient_program, 12, expect_fallbacks=0, max_traces=4,
                         min_coexecuted=6)


def boolean_mask_program(tape_cls, steps):
    """A YOLO-style loss over the rows a boolean mask selects: the mask's row count depends on
    the data, so the op's output shape is only known once the graph has computed it."""
    data, model, optimizer, _ = mlp_task(steps, tf.keras.optimizers.SGD(0.1))
    losses, counts = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            logits = model(x, training=True)
            selected = tf.boolean_mask(logits, y > 1)
            loss = tf.reduce_mean(tf.square(selected))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
        counts.append(int(tf.shape(selected)[0]))
    return {"losses": losses, "counts": counts, **state(model, optimizer)}


def test_data_dependent_output_shape():
    """The row count is fetched where the mask is applied; the ops after it get their shapes
    from their shape functions, and the gradient is TF's symbolic one (whose gradient
    functions compute the mean's divisor from the row count at run time), so a row count
    no trace had co-executes too."""
    outcome = assert_same_as_eager(boolean_mask_program, 2 * STEPS, expect_fallbacks=0,
                                   max_traces=4, min_coexecuted=2 * STEPS - 6)
    counts = outcome.eager["counts"]
    assert len(set(counts[6:]) - set(counts[:6])) > 2, counts  # the premise: new counts


def test_where_the_symbolic_gradient_fails_the_recorded_ops_are_used(monkeypatch):
    """If TF's symbolic gradient cannot be built for a region (an op without a registered
    gradient), generation emits that region's recorded ops instead of giving up: the
    boolean-mask program then co-executes with backward values fed by signature."""
    def no_gradient(*args, **kwargs):
        raise LookupError("no gradient registered (simulated)")

    monkeypatch.setattr("terra.region_emission.gradients_impl.gradients", no_gradient)
    outcome = assert_same_as_eager(boolean_mask_program, 2 * STEPS, expect_fallbacks=(0, None),
                                   max_traces=2 * STEPS, min_coexecuted=1)
    assert outcome.stats.phase != "eager", outcome.report()


def masked_metric_program(tape_cls, steps):
    """After each step, a metric over the rows a boolean mask selects: a new row count in
    most steps, with ops after the mask (``Square``, ``Sum``, a ``Reshape`` to the count)
    whose input shapes no trace had. No gradient flows through them."""
    data, model, optimizer, _ = mlp_task(steps, tf.keras.optimizers.SGD(0.1))
    losses, metrics = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.square(logits))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        selected = tf.boolean_mask(logits, logits[:, 0] > 0)
        per_row = tf.reshape(tf.reduce_sum(tf.square(selected), axis=1), (-1, 1))
        losses.append(float(loss))
        metrics.append(float(tf.reduce_sum(per_row)))
    return {"losses": losses, "metrics": metrics, **state(model, optimizer)}


def test_ops_after_a_new_data_dependent_shape_get_their_shapes_from_tf():
    """Shapes no trace had are inferred with the ops' shape functions (TF's graph-mode shape
    inference), so a new row count does not fall back."""
    outcome = assert_same_as_eager(masked_metric_program, 2 * STEPS, expect_fallbacks=0,
                                   max_traces=4, min_coexecuted=2 * STEPS - 6)
    assert len(set(outcome.eager["metrics"])) > 4  # the premise: many row counts


def test_lazy_mode_serializes_the_runners_with_the_same_numbers():
    """TERRA_LAZY=1: the graph of an iteration starts only when Python needs a value."""
    outcome = assert_same_as_eager(mlp_adam_program, STEPS, env={"TERRA_LAZY": "1"})
    assert outcome.stats.coexecuted > 0, outcome.report()


def test_xla_mode_computes_eager_numbers_with_random_ops_outside_xla():
    """TERRA_XLA=1: the graph's compute ops run compiled; dropout's random ops stay TF ops
    (XLA would draw other numbers), so the numbers are eager's up to XLA's rounding."""
    outcome = assert_same_as_eager(stateful_random_program, STEPS, env={"TERRA_XLA": "1"},
                                   rtol=1e-4, atol=1e-6)
    assert outcome.stats.coexecuted > 0, outcome.report()


def test_xla_mode_computes_eager_numbers_with_every_update_compiled():
    """TERRA_XLA=1 on convolutions, batch norm's moving statistics and momentum: each
    segment's ops, every variable's update among them, run as one compiled function
    (``terra.xla``) and give eager's numbers up to XLA's rounding (the benchmark's rtol)."""
    outcome = assert_same_as_eager(cnn_batchnorm_program, STEPS, env={"TERRA_XLA": "1"},
                                   rtol=1e-3, atol=1e-6)
    assert outcome.stats.coexecuted > 0, outcome.report()
