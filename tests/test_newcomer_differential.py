"""Patterns of ordinary TF2 programs that Terra once got wrong or crashed on, each run eagerly
and under Terra: the numbers must be eager's.

Programs use raw ``tf.Variable``s in ``tf.Module``s, Keras 3 and tf_keras layers, custom
gradients, varying batch sizes and data-dependent Python branches, the whole GradientTape API,
and Terra behind ``tf.GradientTape`` (``terra.enable()``) for code that names only TF's class.
"""

import collections
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, mlp_task, state

import terra
from terra.tape import RealGradientTape

# -- global enablement ----------------------------------------------------------------


def test_enable_puts_terra_behind_tf_gradient_tape_and_disable_restores_it():
    assert not terra.tape.is_enabled()
    with terra.enabled():
        tape = tf.GradientTape()
        assert isinstance(tape, terra.TerraGradientTape)
        assert isinstance(tape, RealGradientTape)  # libraries' isinstance checks hold
        assert tf.compat.v2.GradientTape is terra.TerraGradientTape
        assert tf.autodiff.GradientTape is terra.TerraGradientTape
    assert tf.GradientTape is RealGradientTape
    assert type(tf.GradientTape()) is RealGradientTape


def through_tf_gradient_tape(body):
    """A program that only ever names ``tf.GradientTape`` (as library code does): under Terra
    it runs inside ``terra.enabled()``, eagerly with TF's own class."""
    def program(tape_cls, steps):
        if tape_cls is terra.TerraGradientTape:
            with terra.enabled():
                return body(steps)
        return body(steps)

    return program


def _tape_api(steps):
    """Every GradientTape method, in a loop that otherwise co-executes: nested and persistent
    tapes, output_gradients, unconnected_gradients, watch, stop_recording, jacobian,
    batch_jacobian, reset and watched_variables (the last few are served by fallback)."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    extra = tf.Variable(tf.ones((5,)))
    results = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        x = tf.constant(x)
        with tf.GradientTape(persistent=True) as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
            grads = inner.gradient(loss, model.trainable_variables,
                                   unconnected_gradients=tf.UnconnectedGradients.ZERO)
            with outer.stop_recording() if step == 5 else _nothing():
                unused = tf.reduce_sum(extra)
            penalty = tf.add_n([tf.reduce_sum(tf.square(g)) for g in grads])
        dx = outer.gradient(penalty, x, output_gradients=tf.constant(0.5))
        by_extra = outer.gradient(loss, extra, unconnected_gradients="zero")
        if step == 6:
            results.append(outer.jacobian(logits, x)[0, 0])
            results.append(outer.batch_jacobian(logits, x)[0])
            results.append([v.name for v in outer.watched_variables()])
        del outer
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        results.append((float(loss), dx, by_extra, unused))
    return {"results": results, **state(model, optimizer)}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_whole_gradient_tape_api_through_tf_gradient_tape():
    outcome = assert_same_as_eager(through_tf_gradient_tape(_tape_api), 10,
                                   expect_fallbacks=(0, None), max_traces=8, min_coexecuted=2)
    assert "tape.jacobian" in outcome.explain or "tape.stop_recording" in outcome.explain, \
        outcome.report()


# -- argument structures ----------------------------------------------------------------

Pair = collections.namedtuple("Pair", "first second")


class Parts(tf.Module):
    """A raw tf.Module whose list attribute becomes TF's ListWrapper (a list subclass whose
    constructor wraps rather than copies)."""

    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32) * 0.3)
        self.parts = []

    def __call__(self, x):
        self.parts = [x @ self.w, tf.nn.relu(x) @ self.w]
        joined = tf.concat(self.parts, axis=1)  # a ListWrapper of this step's tensors
        pair = Pair(joined, joined * 2.0)
        return tf.stack(pair) + tf.add_n((joined, [joined][0]))


def structures(tape_cls, steps):
    rng = np.random.default_rng(1)
    x_all = rng.standard_normal((steps, 16, 8)).astype(np.float32)
    module, kept, losses = Parts(), [], []
    for step in range(steps):
        with tape_cls() as tape:
            out = module(x_all[step])
            loss = tf.reduce_mean(tf.square(out))
        (g,) = tape.gradient(loss, [module.w])
        module.w.assign_sub(0.05 * g)
        kept.append(module.parts[0])  # a list subclass holding last step's tensors
        losses.append(float(loss))
    return {"losses": losses, "w": module.w, "last_parts": tf.concat(kept[-1:], 0)}


def test_list_subclasses_namedtuples_and_nested_arguments():
    assert_same_as_eager(structures, 10, expect_fallbacks=(0, 1), max_traces=4)


# -- raw tf.Module with a conditional extra loss term ----------------------------------


class Regressor(tf.Module):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32) * 0.3)
        self.b = tf.Variable(np.zeros(4, np.float32))

    def __call__(self, x):
        return tf.nn.relu(x @ self.w + self.b)


def weight_decay_every_third_step(where):
    def program(tape_cls, steps):
        rng = np.random.default_rng(1)
        x, y = (rng.standard_normal((16, n)).astype(np.float32) for n in (8, 4))
        net, losses = Regressor(), []
        for step in range(steps):
            with tape_cls() as tape:
                out = net(x)
                if where == "mid" and step % 3 == 0:
                    out = out + 1e-3 * tf.reduce_sum(tf.square(net.w))
                loss = tf.reduce_mean(tf.square(out - y))
                if where == "end" and step % 3 == 0:
                    loss = loss + 1e-3 * tf.reduce_sum(tf.square(net.w))
            grads = tape.gradient(loss, net.trainable_variables)
            for v, g in zip(net.trainable_variables, grads, strict=True):
                v.assign_sub(0.1 * g)
            losses.append(float(loss))
        return {"losses": losses, "vars": list(net.trainable_variables)}

    return program


@pytest.mark.parametrize("where", ["end", "mid"])
def test_conditional_weight_decay_on_a_raw_module(where):
    assert_same_as_eager(weight_decay_every_third_step(where), 15,
                         expect_fallbacks=(0, None), max_traces=8)


# -- varying batch + a branch on a fetched loss; reads after the loop -----------------


def fetched_branch_varying_batch(tape_cls, steps):
    """Batches alternate 16 / 12 rows, and inside the tape ``if float(loss) > 1.2`` halves the
    loss. The graph once failed at the iteration's last op (an update), and that op ran twice:
    once in the fallback's replay, once more when re-issued eagerly."""
    rng = np.random.RandomState(4)
    x_all = rng.randn(64, 8).astype("float32")
    y_all = rng.randn(64, 1).astype("float32") * 1.2
    w1 = tf.Variable(rng.randn(8, 16).astype("float32") * 0.5)
    b1 = tf.Variable(np.zeros(16, "float32"))
    w2 = tf.Variable(rng.randn(16, 1).astype("float32") * 0.5)
    losses = []
    for step in range(steps):
        size, start = (16 if step % 2 == 0 else 12), (step * 4) % 32
        x, y = x_all[start:start + size], y_all[start:start + size]
        with tape_cls() as tape:
            pred = (x @ w1 + b1) @ w2
            loss = tf.reduce_mean(tf.square(pred - y))
            if float(loss) > 1.2:
                loss = loss * 0.5
        grads = tape.gradient(loss, [w1, b1, w2])
        for v, g in zip([w1, b1, w2], grads, strict=True):
            v.assign_sub(0.08 * g)
        losses.append(float(loss))
    after = [float(tf.reduce_sum(v)) for v in (w1, b1, w2)]  # ops after the training loop
    return {"losses": losses, "after": after, "vars": [w1, b1, w2]}


def test_branch_on_fetched_loss_with_varying_batch_then_reads_after_the_loop():
    assert_same_as_eager(fetched_branch_varying_batch, 24, expect_fallbacks=(0, None),
                         max_traces=8)


# -- a custom gradient after a numpy-computed scale, varying batch, Adam --------------


@tf.custom_gradient
def clipped_backward(x):
    def grad(dy):
        return tf.clip_by_value(dy, -0.05, 0.05)

    return tf.identity(x), grad


def custom_gradient_numpy_scale(tape_cls, steps):
    """A fallback's replay once re-ran the forward ops without the custom gradient the
    decorator had put on the tape, and trained with the unclipped gradient. A batch of a size
    no trace had (step 9) makes the fallback come after the custom gradient."""
    rng = np.random.RandomState(0)
    x_all = rng.randn(64, 8).astype("float32")
    y_all = rng.randn(64, 1).astype("float32")
    w1 = tf.Variable(rng.randn(8, 16).astype("float32") * 0.5)
    w2 = tf.Variable(rng.randn(16, 1).astype("float32") * 0.5)
    optimizer = tf.keras.optimizers.Adam(0.01)
    losses = []
    for step in range(steps):
        size = 20 if step == 9 else 16 if step % 2 == 0 else 12
        x, y = x_all[:size], y_all[:size]
        with tape_cls() as tape:
            h = x @ w1
            h = h * (1 + 0.01 * np.abs(h.numpy()).mean())
            h = clipped_backward(h)
            loss = tf.reduce_mean(tf.square(h @ w2 - y))
        grads = tape.gradient(loss, [w1, w2])
        optimizer.apply_gradients(zip(grads, [w1, w2], strict=True))
        losses.append(float(loss))
    return {"losses": losses, "vars": [w1, w2], "optimizer": list(optimizer.variables)}


def test_custom_gradient_survives_fallback():
    assert_same_as_eager(custom_gradient_numpy_scale, 16, expect_fallbacks=(1, None),
                         max_traces=10, min_coexecuted=0)


# -- tf_keras (Keras 2): Dense adds its bias with BiasAdd --------------------------------


def tf_keras_dense_with_branch(tape_cls, steps):
    """Replayed BiasAdd ops once lacked their defaulted ``data_format``, which TF's gradient
    function reads: every tf_keras Dense with a bias crashed after a fallback."""
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    dense1 = tf_keras.layers.Dense(16, activation="relu")
    dense2 = tf_keras.layers.Dense(1)
    rng = np.random.RandomState(0)
    x = rng.randn(16, 8).astype("float32")
    y = rng.randn(16, 1).astype("float32")
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            loss = tf.reduce_mean(tf.square(dense2(dense1(x)) - y))
            if step % 3 == 0:
                loss = loss + 0.1
        variables = dense1.trainable_variables + dense2.trainable_variables
        grads = tape.gradient(loss, variables)
        for v, g in zip(variables, grads, strict=True):
            v.assign_sub(0.05 * g)
        losses.append(float(loss))
    return {"losses": losses, "vars": variables}


def test_tf_keras_dense_bias_add_after_fallback():
    outcome = assert_same_as_eager(tf_keras_dense_with_branch, 12, env={
        "TF_USE_LEGACY_KERAS": "1"}, expect_fallbacks=(1, None), max_traces=8)
    assert outcome.stats.fallbacks >= 1, outcome.report()


# -- tf_keras Embedding + GRU: a gradient result that no op computed ----------------------


def tf_keras_embedding_gru(tape_cls, steps):
    """The embedding's gradient is an ``IndexedSlices`` whose ``dense_shape`` TF converts from
    the variable's static shape without an op. Terra once took the region for one that must run
    in Python and never traced the program (0 traces, eager, slower than eager)."""
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Embedding(50, 8), tf_keras.layers.GRU(8),
                                 tf_keras.layers.Dense(2)])
    optimizer = tf_keras.optimizers.Adam(1e-2)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    x = rng.integers(1, 50, size=(steps, 8, 6)).astype("int32")
    y = rng.integers(0, 2, size=(steps, 8))
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            loss = loss_fn(y[step], model(x[step], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return {"losses": losses, "vars": model.variables, "optimizer": optimizer.variables()}


def test_tf_keras_embedding_gru_coexecutes():
    outcome = assert_same_as_eager(tf_keras_embedding_gru, 10, rtol=1e-4,
                                   env={"TF_USE_LEGACY_KERAS": "1"}, min_coexecuted=5)
    assert outcome.stats.graph_generations == 1, outcome.report()


def test_finding_user_frames_does_not_import_keras_3():
    """Locating the user's line once imported Keras 3 (and scikit-learn through it) into
    tf_keras programs: seconds added to their first traced step."""
    code = ("import sys, tf_keras\nfrom terra import location\nlocation.user_location()\n"
            "print('keras.src' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TF_USE_LEGACY_KERAS": "1"}, timeout=300)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


# -- patterns of dm-sonnet and tf_keras' optimizer.minimize -------------------------------


def fused_batch_norm_shared_constant(tape_cls, steps):
    """Like ``snt.BatchNorm`` on images: ``FusedBatchNormV2`` in training mode with one empty
    constant as both mean and variance, and an int given for a float attr (the op wrapper's
    fast path refuses it and its slow path reads the variables again). The first once made
    the merge crash (an input referring to its own op), the second recorded four variable
    reads where co-execution issues two: Terra ran eagerly or fell back at every step."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4, 6, 6, 3)).astype("float32"))
    scale = tf.Variable(tf.ones([3]))
    offset = tf.Variable(tf.zeros([3]))
    counter = tf.Variable(0, dtype=tf.int64)
    average = tf.Variable(tf.zeros([3]))
    empty = tf.constant([])
    losses = []
    for _ in range(steps):
        with tape_cls() as tape:
            out, mean, _, _, _ = tf.raw_ops.FusedBatchNormV2(
                x=x * 2.0, mean=empty, variance=empty, scale=scale, offset=offset,
                is_training=True, epsilon=1e-3, exponential_avg_factor=1,
                data_format="NHWC")
            counter.assign_add(1)
            decay = tf.pow(0.9, tf.cast(counter, tf.float32))
            average.assign_sub((average - mean) * (1 - 0.9) / (1 - decay))
            loss = tf.reduce_mean(out * out * tf.range(3, dtype=tf.float32))
        grads = tape.gradient(loss, [scale, offset])
        scale.assign_sub(0.1 * grads[0])
        offset.assign_sub(0.1 * grads[1])
        losses.append(float(loss))
    return {"losses": losses, "vars": [scale, offset, counter, average]}


def test_fused_batch_norm_with_shared_constant_and_slow_path_coexecutes():
    assert_same_as_eager(fused_batch_norm_shared_constant, 10, min_coexecuted=5)


def watch_variables_first(tape_cls, steps):
    """``tape.watch(var_list)`` before the loss, as tf_keras' ``optimizer.minimize`` does: the
    watch once recorded a read of each variable (a read the co-executed watch never issues:
    a fallback at every step), and with ``watch_accessed_variables=False`` it watched that
    read instead of the variable, so the gradient was None."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(8, 3)))
    w = tf.Variable(tf.ones([3], tf.float64))
    b = tf.Variable(tf.zeros([], tf.float64))
    losses = []
    for step in range(steps):
        with tape_cls(watch_accessed_variables=step % 2 == 0) as tape:
            tape.watch([w, b])
            loss = tf.reduce_sum(tf.exp(x * tf.nn.softplus(w)) + b)
        grads = tape.gradient(loss, [w, b])
        w.assign_sub(0.01 * grads[0])
        b.assign_sub(0.01 * grads[1])
        losses.append(float(loss))
    return {"losses": losses, "vars": [w, b]}


def test_watching_variables_inside_the_tape_coexecutes():
    assert_same_as_eager(watch_variables_first, 12, min_coexecuted=5, max_traces=4)


# -- tf_keras BatchNormalization: fused, with an output of unknown graph shape -------------


def tf_keras_fused_batch_norm_branches(tape_cls, steps):
    """tf_keras' BatchNormalization runs ``FusedBatchNormV3``, whose last output (kernel
    scratch space) has no static shape in a graph. Generation once marked only that output
    data-dependent, while co-execution then fetched every output of the op: a "new fetch
    point" fallback at every step, for good (a pre-activation ResNet drawing its blocks with
    Python's ``random`` gave up after four)."""
    import random

    import tf_keras

    tf_keras.utils.set_random_seed(0)
    random.seed(0)
    layers = tf_keras.layers
    stem = layers.Conv2D(4, 3, padding="same")
    norms = [layers.BatchNormalization(), layers.BatchNormalization()]
    head = tf_keras.Sequential([layers.GlobalAveragePooling2D(), layers.Dense(3)])
    optimizer = tf_keras.optimizers.SGD(0.05, momentum=0.9)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(4, 3)).astype("float32")
    for norm in norms:  # build both branches, so the optimizer knows every variable
        head(tf.nn.relu(norm(stem(x), training=True)))
    variables = stem.trainable_variables + head.trainable_variables + [
        v for n in norms for v in n.trainable_variables]
    optimizer.build(variables)
    losses = []
    for _ in range(steps):
        norm = norms[random.random() < 0.5]
        with tape_cls() as tape:
            loss = tf.reduce_mean(tf.square(head(tf.nn.relu(norm(stem(x), training=True))) - y))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients((g, v) for g, v in zip(grads, variables) if g is not None)
        losses.append(float(loss))
    return {"losses": losses, "vars": [v for n in norms for v in n.variables] + variables,
            "optimizer": optimizer.variables()}


def test_tf_keras_fused_batch_norm_branches_coexecute():
    assert_same_as_eager(tf_keras_fused_batch_norm_branches, 16, rtol=1e-4,
                         env={"TF_USE_LEGACY_KERAS": "1"}, expect_fallbacks=(0, None),
                         max_traces=10, min_coexecuted=6)


# -- Keras 3's fit: every step's outputs wrapped in a tf.experimental.Optional --------------


def outputs_in_an_optional(tape_cls, steps):
    """Keras 3's trainer wraps each step's logs in ``tf.experimental.Optional.from_value``
    and reads them back with ``has_value()``/``get_value()``: a variant tensor, which Terra
    once could not stand in for (a fallback at every step; ``fit(run_eagerly=True)`` under
    ``terra.enable()`` never co-executed)."""
    w = tf.Variable(tf.linspace(0.0, 1.0, 12)[None, :] * tf.ones([4, 1]))
    data = tf.reshape(tf.range(steps * 8, dtype=tf.float32), [steps, 2, 4]) / 100.0
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            loss = tf.reduce_mean(tf.square(data[step] @ w - 1.0))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        logs = tf.experimental.Optional.from_value({"loss": loss, "w": w.read_value()})
        if not logs.has_value():
            break
        losses.append(logs.get_value()["loss"])
    return {"losses": losses, "vars": [w]}


def test_outputs_wrapped_in_an_optional_coexecute():
    assert_same_as_eager(outputs_in_an_optional, 12, min_coexecuted=6)


# -- a size computed in Python: the output shape follows a fed value ----------------------


def resize_by_a_drawn_ratio(tape_cls, steps):
    """One ``tf.image.resize`` line after either block, to a size computed in Python from a
    drawn ratio (SDPoint's down-sampling). Traces saw 32->24 and 16->12; a co-executed step
    asking 16->8 once got a stand-in of the recorded 12x12 shape (the sizes are fed values,
    same shape), and ``tf.image.resize``'s own ``set_shape`` raised in user code."""
    plan = [(0, 0.75), (None, 0.75), (1, 0.75), (0, 0.75), (0, 0.75), (1, 0.5), (1, 0.5),
            (0, 0.5), (1, 0.75), (0, 0.25), (1, 0.25), (0, 0.75)]
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((4, 32, 32, 3)).astype(np.float32))
    w1 = tf.Variable(rng.standard_normal((3, 3, 3, 4)).astype(np.float32) * 0.1)
    w2 = tf.Variable(rng.standard_normal((3, 3, 4, 8)).astype(np.float32) * 0.1)
    losses = []
    for block, ratio in plan[:steps]:
        with tape_cls() as tape:
            h = x
            for i, (w, stride) in enumerate([(w1, 1), (w2, 2)]):
                h = tf.nn.relu(tf.nn.conv2d(h, w, stride, "SAME"))
                if i == block:
                    h = tf.image.resize(h, (int(h.shape[1] * ratio),) * 2)
            loss = tf.reduce_mean(h ** 2)
        grads = tape.gradient(loss, [w1, w2])
        w1.assign_sub(0.1 * grads[0])
        w2.assign_sub(0.1 * grads[1])
        losses.append(float(loss))
    return {"losses": losses, "vars": [w1, w2]}


def test_output_shape_following_a_fed_size_is_inferred_from_its_value():
    # new (block, size) pairs keep coming: fallbacks, never a wrong shape in user code
    assert_same_as_eager(resize_by_a_drawn_ratio, 12, expect_fallbacks=(0, None),
                         max_traces=12, min_coexecuted=1)


def sdpoint_benchmark(tape_cls, steps):
    """The SDPoint benchmark program (a pre-activation ResNet down-sampling after a block and
    by a ratio drawn each step) on tf_keras. Its traces' feature maps all ended 6x6; a new
    (block, ratio) ends them 4x4, and the recorded backward pass, whose constants (a mean's
    divisor) every trace saw alike, silently computed the old shape's gradient: losses off by
    0.7% from the first such step, with no fallback."""
    from benchmarks.programs import load, run

    program = load("sdpoint")("quick", 0, tape=tape_cls)
    losses = run(program, steps)
    return {"losses": losses, "vars": program.model.variables}


def test_backward_constants_of_a_new_shape_are_not_taken_from_other_shapes():
    assert_same_as_eager(sdpoint_benchmark, 12, rtol=1e-4, env={"TF_USE_LEGACY_KERAS": "1"},
                         expect_fallbacks=(0, None), max_traces=12, min_coexecuted=1)


def generator_drawn_mask(tape_cls, steps):
    """A dropout-like mask drawn from a ``tf.random.Generator`` (tf_keras' Dropout under
    ``enable_tf_random_generator()``): the graph writes the generator's state with
    ``RngReadAndSkip``, which names no dtype, and building the variable snapshot failed (the
    program never co-executed). A late branch makes a fallback restore that state."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((16, 8)).astype(np.float32))
    w = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32))
    gen = tf.random.Generator.from_seed(1)
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            keep = tf.cast(gen.uniform((16, 4)) > 0.3, tf.float32)
            loss = tf.reduce_mean((tf.matmul(x, w) * keep) ** 2)
            if step == 8:
                loss = loss + tf.reduce_sum(gen.normal((2,)))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        losses.append(float(loss))
    return {"losses": losses, "vars": [w, gen.state]}


def test_generator_state_is_snapshotted_and_restored():
    assert_same_as_eager(generator_drawn_mask, 12,
                         expect_fallbacks=1, max_traces=4, min_coexecuted=4)


# -- shape-varying programs: one shape-polymorphic graph --------------------------------------


def varying_image_size_convnet(tape_cls, steps):
    """Images of a different size every step (24, 32, 28, 20 pixels): a convolution, BatchNorm
    and global pooling take any size, so eager runs every step, as does Terra's one graph."""
    keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.BatchNormalization(),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(5)])
    optimizer = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    losses = []
    for step in range(steps):
        size = (24, 32, 28, 20)[step % 4]
        x = tf.constant(rng.standard_normal((8, size, size, 3)).astype("float32"))
        y = rng.integers(0, 5, 8)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}


def bucketed_sequence_attention(tape_cls, steps):
    """A causal self-attention language model on batches padded to one of three bucket
    lengths (8, 12, 16 tokens), the length drawn at random every step."""
    keras = tf.keras
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(50, 16)(tokens)
    h = h + keras.layers.MultiHeadAttention(2, 8)(h, h, use_causal_mask=True)
    logits = keras.layers.Dense(50)(keras.layers.LayerNormalization()(h))
    model = keras.Model(tokens, logits)
    optimizer = keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        length = int(rng.choice([8, 12, 16]))
        x = rng.integers(1, 50, (4, length + 1)).astype("int32")
        with tape_cls() as tape:
            loss = loss_fn(x[:, 1:], model(x[:, :-1], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return {"losses": losses, **state(model, optimizer)}


SHAPE_VARYING = [varying_image_size_convnet, bucketed_sequence_attention]


@pytest.mark.parametrize("keras_version", ["keras3", "tf_keras"])
@pytest.mark.parametrize("program", SHAPE_VARYING, ids=lambda p: p.__name__)
def test_shape_varying_programs_coexecute_in_one_graph(program, keras_version):
    """Every step a shape the traces may not have had: the graph takes the varying
    dimensions as unknown (one graph, no fallback per new shape), and the numbers are eager's
    (not bit for bit: TF's symbolic gradient, which such regions use, may add the gradient's
    terms in another order than the tape)."""
    env = {"TF_USE_LEGACY_KERAS": "1"} if keras_version == "tf_keras" else None
    # atol: the attention's key bias has a zero gradient in exact arithmetic; Adam turns the
    # rounding noise it gets into updates of ~1e-6, which differ in sign between the two sums
    outcome = assert_same_as_eager(program, 12, env=env, min_coexecuted=8, atol=1e-5)
    assert outcome.stats.graph_generations == 1 and outcome.stats.fallbacks == 0, \
        outcome.report()


def one_step_per_call(tape_cls, steps):
    """The loop's helper is called once per step (a notebook cell, ``train(1)`` in a loop):
    it draws the batch from a generator over a ``tf.data`` iterator, steps, and returns the
    loss as a float. The next call draws the next batch before the next tape: an op of the
    last iteration, issued from a new frame of a function that ran it, at a ``next(...)``
    whose offset CPython reports otherwise once the code is warm. Batches of three widths,
    so the draw's output shape varies and must be one node the traces relaxed."""
    tf.keras.utils.set_random_seed(0)
    dataset = tf.data.Dataset.range(1000).map(
        lambda i: tf.random.stateless_normal([4, 3 + i % 3], [i, 1]) + 1.0)
    iterator = iter(dataset)
    w = tf.Variable([[0.5], [-0.5], [0.25], [1.0]])

    def batches(n):
        for _ in range(n):
            yield next(iterator)

    def train(n):
        losses = []
        for x in batches(n):
            with tape_cls() as tape:
                h = tf.reduce_mean(x, axis=1, keepdims=True) * w
                loss = tf.reduce_mean(tf.square(h - 1.0))
            w.assign_sub(0.1 * tape.gradient(loss, w))
            losses.append(loss)
        return [float(loss) for loss in losses]

    losses = []
    for _ in range(steps):
        losses += train(1)
    return {"losses": losses, "w": w}


def test_a_helper_called_once_per_step_coexecutes():
    """One node for the draw: at most the fallback of a width the recorded gradient region
    had not seen (after which the region is TF's symbolic gradient, for every width). Where
    the draw's stack depended on CPython's frame ids (``test_location``), the GPT-2 benchmark
    driven so took two nodes for it, a branch point no trace could settle: six traces, five
    fallbacks at the draw's shape, and Terra gave up. Here the ids happen to differ either
    way; the stack's own test pins it."""
    outcome = assert_same_as_eager(one_step_per_call, 24, expect_fallbacks=(0, 1),
                                   max_traces=3, min_coexecuted=16)
    assert outcome.stats.graph_generations <= 2, outcome.report()
    assert "output 0 of IteratorGetNext" not in outcome.explain, outcome.report()
