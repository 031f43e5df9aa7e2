"""``TerraGradientTape`` behaves as ``tf.GradientTape`` does, in every phase.

Each behaviour of the documented tape API (``watch``, ``watched_variables``,
``stop_recording``, ``reset``, ``gradient`` and its arguments, ``jacobian``,
``batch_jacobian``, ``persistent``, ``watch_accessed_variables``, re-entry, nesting, and the
errors with their types and messages) runs inside a small training loop, at iterations that
fall in each of Terra's phases: the warm-up step, tracing, co-execution, and the iteration
after a fallback (a behaviour met in co-execution is a new path: it falls back). It runs
*inside* the training step's tape (the training tape open around it) and *between* two
steps (its own tapes start an iteration). Its outcome (values, or the exception's type and
message), the loop's losses and every variable must be the same with both tapes.
"""

import contextlib

import differential
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import record

import terra
from terra import runtime

# iterations at which a behaviour runs: warm-up, tracing, co-execution, the one after the
# fallback it caused, and co-execution again once the graph was rebuilt
AT = (0, 1, 6, 7, 14)
STEPS = 16


def _world():
    v = tf.Variable(2.0, name="v")
    w = tf.Variable([[1.0, -1.0], [0.5, 2.0]], name="w")
    return v, w


# -- the behaviours: ``b(T, v, w, outer)``; ``outer``: the training tape, or None ----------
def watch_variable(T, v, w, outer):
    with T() as t:
        t.watch(v)
    return t.watched_variables()


def watch_without_accessed(T, v, w, outer):
    with T(watch_accessed_variables=False) as t:
        t.watch(v)
        y = v * tf.reduce_sum(w)
    return t.watched_variables(), t.gradient(y, [v, w])


def unwatched_without_accessed(T, v, w, outer):
    with T(watch_accessed_variables=False) as t:
        y = v * v
    return t.gradient(y, v), t.watched_variables()


def watched_after_gradient(T, v, w, outer):
    with T() as t:
        y = v * tf.reduce_sum(w)
    g = t.gradient(y, w)
    return t.watched_variables(), g


def watched_of_two_tapes(T, v, w, outer):
    with T() as t1:
        with T() as t2:
            t2.watch(v)
            y = tf.reduce_sum(w) * 2.0
    return t1.watched_variables(), t2.watched_variables(), t1.gradient(y, w)


def watched_inside_forward(T, v, w, outer):
    """A library's query of its own tape in the middle of a forward pass (tf_keras'
    ``Lambda``), and of the training tape."""
    with T() as t:
        y = tf.matmul(w, w)
    return t.watched_variables(), (outer.watched_variables() if outer else ()), y


def reentered(T, v, w, outer):
    x = tf.constant(3.0)
    g = T()
    with g:
        g.watch(x)
        y = x * x
    z0 = y + 1.0  # not recorded: between the blocks
    with g:
        z = y * y * v + z0
    return g.gradient(z, [x, v])


def reentered_persistent(T, v, w, outer):
    g = T(persistent=True)
    with g:
        y = v * v
    with g:
        z = y * tf.reduce_sum(w)
    return g.gradient(y, v), g.gradient(z, [v, w])


def entered_while_recording(T, v, w, outer):
    t = T()
    with t:
        y = v * v
        try:
            with t:
                pass
        except ValueError as e:
            error = str(e)
        z = y * 3.0
    return error, t.gradient(z, v), outer is not None or record.could_possibly_record()


def watch_numpy_unentered(T, v, w, outer):
    T().watch(np.array(1.0))


def watch_numpy_entered(T, v, w, outer):
    with T() as t:
        t.watch([tf.constant(1.0), np.array(1.0)])


def watch_unentered(T, v, w, outer):
    T().watch(tf.constant(1.0))


def gradient_twice(T, v, w, outer):
    with T() as t:
        y = v * v
    first = t.gradient(y, v)
    return first, t.gradient(y, v)


def gradient_unentered(T, v, w, outer):
    return T().gradient(tf.constant(1.0), v)


def gradient_inside(T, v, w, outer):
    with T() as t:
        y = v * v
        g = t.gradient(y, v)
        z = v * 3.0  # the tape stopped recording at the gradient
    return g, z, t.gradient(z, v)


def persistent_tape(T, v, w, outer):
    with T(persistent=True) as t:
        y = v * v
        z = y * tf.reduce_sum(w)
    return t.gradient(y, v), t.gradient(z, [v, w]), t.gradient(z, {"w": w})


def persistent_gradient_inside(T, v, w, outer):
    with T(persistent=True) as t:
        y = v * v * v
        g = t.gradient(y, v)
    return g, t.gradient(g, v)


def output_gradients(T, v, w, outer):
    with T() as t:
        y = tf.matmul(w, [[1.0], [2.0]]) * v
    return t.gradient(y, [v, w], output_gradients=tf.constant([[3.0], [4.0]]))


def unconnected_zero(T, v, w, outer):
    with T() as t:
        y = v * 2.0
    return t.gradient(y, [v, w], unconnected_gradients=tf.UnconnectedGradients.ZERO)


def unconnected_none(T, v, w, outer):
    with T() as t:
        y = v * 2.0
    return t.gradient(y, [v, w], unconnected_gradients="none")


def unconnected_unknown(T, v, w, outer):
    with T() as t:
        y = v * 2.0
    try:
        t.gradient(y, v, unconnected_gradients="bogus")
    except ValueError as e:
        error = str(e)
    return error, t.gradient(y, v)


def target_none(T, v, w, outer):
    with T() as t:
        v * 2.0
    try:
        t.gradient(None, v)
    except TypeError as e:
        return str(e)


def indexed_slices(T, v, w, outer):
    with T() as t:
        y = tf.reduce_sum(tf.gather(w, [1, 1]))
    return t.gradient(y, w)


def stop_recording(T, v, w, outer):
    with T() as t:
        with t.stop_recording():
            y = v * v
        z = v * 3.0
    return t.gradient([y, z], v)


def stop_recording_unentered(T, v, w, outer):
    with T().stop_recording():
        pass


def reset(T, v, w, outer):
    with T() as t:
        y = v * v
        t.reset()
        z = v * 3.0 + y
    return t.gradient(z, v)


def reset_unentered(T, v, w, outer):
    T().reset()


def jacobian(T, v, w, outer):
    x = tf.constant([1.0, 2.0])
    with T() as t:
        t.watch(x)
        y = x * x * v
    return t.jacobian(y, [x, v])


def jacobian_twice(T, v, w, outer):
    with T() as t:
        y = tf.reshape(w * v, [-1])
    first = t.jacobian(y, v)
    return first, t.jacobian(y, v)


def batch_jacobian(T, v, w, outer):
    x = tf.constant([[1.0, 2.0], [3.0, 4.0]])
    with T() as t:
        t.watch(x)
        y = tf.matmul(x, w)
    return t.batch_jacobian(y, x)


def second_order(T, v, w, outer):
    with T() as t1:
        with T() as t2:
            y = v * v * v
        g = t2.gradient(y, v)
    return g, t1.gradient(g, v)


def properties(T, v, w, outer):
    t = T(persistent=True, watch_accessed_variables=False)
    return t._persistent, t._watch_accessed_variables, isinstance(t, tf.GradientTape)


BEHAVIOURS = [watch_variable, watch_without_accessed, unwatched_without_accessed,
              watched_after_gradient, watched_of_two_tapes, watched_inside_forward, reentered,
              reentered_persistent, entered_while_recording, watch_numpy_unentered,
              watch_numpy_entered, watch_unentered, gradient_twice, gradient_unentered,
              gradient_inside, persistent_tape, persistent_gradient_inside, output_gradients,
              unconnected_zero, unconnected_none, unconnected_unknown, target_none,
              indexed_slices, stop_recording, stop_recording_unentered, reset,
              reset_unentered, jacobian, jacobian_twice, batch_jacobian, second_order,
              properties]


def _plain(x):
    """An outcome as plain Python: tensors as lists, variables by name, slices by parts."""
    if isinstance(x, tf.Variable):
        return ("variable", x.name)
    if isinstance(x, tf.IndexedSlices):
        return ("slices", _plain(x.values), _plain(x.indices), _plain(x.dense_shape))
    if isinstance(x, dict):
        return {k: _plain(y) for k, y in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(y) for y in x]
    if hasattr(x, "numpy"):
        return x.numpy().tolist()
    return x


def _outcome(behaviour, *args):
    try:
        return ("returned", _plain(behaviour(*args)))
    except Exception as e:  # noqa: BLE001 - the error is the outcome compared
        return ("raised", type(e).__name__, str(e))


def _program(T, behaviour, inside):
    """A linear model trained by SGD for ``STEPS`` steps; ``behaviour`` runs at the
    iterations ``AT``, inside the step's tape or after its update."""
    tf.random.set_seed(0)
    v, w = _world()
    b = tf.Variable([0.1, -0.2], name="b")
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((STEPS, 4, 2)).astype("float32")
    ys = rng.standard_normal((STEPS, 4, 2)).astype("float32")
    losses, outcomes, phases = [], [], []
    for i in range(STEPS):
        with T() as tape:
            pred = tf.matmul(xs[i], w) * v + b
            if inside and i in AT:
                phases.append(runtime.get().phase)
                outcomes.append(_outcome(behaviour, T, v, w, tape))
            loss = tf.reduce_mean((pred - ys[i]) ** 2)
        grads = tape.gradient(loss, [v, w, b])
        for var, g in zip((v, w, b), grads):
            var.assign_sub(0.05 * g)
        if not inside and i in AT:
            phases.append(runtime.get().phase)
            outcomes.append(_outcome(behaviour, T, v, w, None))
        losses.append(loss.numpy().tolist())
    return {"losses": losses, "outcomes": outcomes,
            "variables": [x.numpy().tolist() for x in (v, w, b)]}, phases


_EAGER = {}


@pytest.mark.parametrize("inside", [True, False], ids=["inside_step", "between_steps"])
@pytest.mark.parametrize("behaviour", BEHAVIOURS, ids=lambda b: b.__name__)
def test_terra_tape_behaves_as_tf_tape(behaviour, inside):
    key = (behaviour.__name__, inside)
    if key not in _EAGER:
        _EAGER[key] = _program(tf.GradientTape, behaviour, inside)[0]
    terra.reset()
    got, phases = _program(terra.TerraGradientTape, behaviour, inside)
    stats, explained = terra.stats(), terra.explain()
    terra.reset()
    expected = _EAGER[key]
    for i, (a, b) in enumerate(zip(got["outcomes"], expected["outcomes"])):
        assert a == b, f"at iteration {AT[i]} ({phases[i]}):\n terra {a}\n tf    {b}"
    assert got == expected
    # the behaviour met each phase, or the comparison would not be what it says
    assert phases[0] == "warmup" and "tracing" in phases, phases
    if inside:
        assert "coexecution" in phases, (phases, explained)
    assert stats.coexecuted > 0, explained


def _tf_keras_functional(tape_cls, steps):
    """A tf_keras functional model whose ``Lambda`` and ``TFOpLambda`` layers open a tape of
    their own in every call and ask it ``watched_variables()``, under ``terra.enable()``."""
    import tf_keras

    tf_keras.utils.set_random_seed(0)
    inp = tf_keras.Input((8,))
    h = tf_keras.layers.Dense(16)(inp)
    h = tf_keras.layers.Lambda(lambda t: t * 0.5)(h)
    h = tf.nn.relu(h)  # a TFOpLambda layer
    model = tf_keras.Model(inp, tf_keras.layers.Dense(1)(h))
    opt = tf_keras.optimizers.SGD(0.05)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((steps, 16, 8)).astype("float32")
    ys = rng.standard_normal((steps, 16, 1)).astype("float32")
    losses = []
    with terra.enabled() if tape_cls is terra.TerraGradientTape else contextlib.nullcontext():
        for i in range(steps):
            with tape_cls() as tape:
                loss = tf.reduce_mean((model(xs[i], training=True) - ys[i]) ** 2)
            grads = tape.gradient(loss, model.trainable_variables)
            opt.apply_gradients(zip(grads, model.trainable_variables))
            losses.append(loss)
    return {"losses": losses, "variables": model.variables}


def test_a_library_asking_its_tape_inside_the_forward_pass_coexecutes():
    outcome = differential.assert_same_as_eager(_tf_keras_functional, steps=12,
                                                exact=("losses", "variables"),
                                                min_coexecuted=8)
    assert "watched_variables" not in outcome.explain, outcome.explain
