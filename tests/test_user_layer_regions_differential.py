"""The user's own layer subclasses as layer regions (``terra.user_layers``): a pure user
layer's call is skipped whole with eager's numbers, and every user layer whose Python does
something a skipped call would leave out keeps running it.

Each program runs eagerly and under Terra (``differential``): losses, gradients' effect on
every variable and optimizer slot, and what the user's Python counted must be eager's;
``skipped_layer_calls`` tells whether co-execution skipped the calls, so a guard that let a
call through where it must not (or a region that never engaged) fails here."""

import contextlib
import inspect
import io

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, classification_data, sparse_xent, state

from terra import user_layers

keras = tf.keras
EXACT = ("losses", "model", "optimizer0")
SHIFT = 0.0  # a module global a layer's call reads (``test_a_global_changed...``)
SEEN = []  # a module list a layer's call appends to


class Inner(keras.layers.Layer):
    """A pure user layer: built-in layers, TF ops, attribute reads."""

    def __init__(self, units, scale=1.0, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(units, activation="relu")
        self.norm = keras.layers.LayerNormalization()
        self.scale = scale

    def call(self, x):
        h = self.dense(x) * self.scale
        return self.norm(h + tf.reduce_mean(h, axis=-1, keepdims=True))


class Outer(keras.Model):
    """Nested user layers: a model of the user's holding two of its ``Inner`` layers."""

    def __init__(self, inner=Inner, **kwargs):
        super().__init__(**kwargs)
        self.blocks = [inner(8), inner(8)]
        self.head = keras.layers.Dense(3)

    def call(self, x, training=False):
        for block in self.blocks:
            x = block(x)
        return self.head(x + SHIFT)


class Printing(Inner):
    def call(self, x):
        print("inner called", x.shape)  # a Python side effect: must print every step
        return super().call(x)


class Appending(Inner):
    def call(self, x):
        SEEN.append(x.shape[0])  # a list the loop reads: must grow by every call
        return super().call(x)


class NumpyReading(Inner):
    def call(self, x):
        h = super().call(x)
        self.last = np.asarray(h.numpy()).mean()  # a value read, and a NumPy call
        return h


def _loop(tape_cls, steps, model_fn=Outer, change=None):
    """An MLP classifier of the user's model; ``change(step, model)`` may change it from
    Python before a step."""
    global SHIFT
    tf.keras.utils.set_random_seed(0)
    SEEN.clear()
    SHIFT = 0.0
    data = classification_data(steps * 8, 6, 3)
    model = model_fn()
    model(tf.zeros((8, 6)))  # build
    optimizer = keras.optimizers.Adam(1e-2)
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        if change is not None:
            change(step, model)
        x, y = batch(data, step, 8)
        with tape_cls() as tape:
            loss = loss_fn(y, model(tf.constant(x), training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, "seen": list(SEEN), **state(model, optimizer)}


def test_a_pure_user_model_with_nested_user_layers_is_one_skipped_call():
    outcome = assert_same_as_eager(_loop, 10, exact=EXACT, min_coexecuted=4)
    # the user's model, its two user layers and their built-in layers: one call a step
    assert outcome.stats.skipped_layer_calls == outcome.stats.coexecuted, outcome.report()
    assert "region off" not in outcome.explain, outcome.report()


def _printing_loop(tape_cls, steps):
    """``_loop`` of a model whose layers print; returns how many lines they printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = _loop(tape_cls, steps, lambda: Outer(Printing))
    return {**results, "printed": out.getvalue().count("inner called")}


def test_a_user_layer_that_prints_prints_every_call():
    outcome = assert_same_as_eager(_printing_loop, 10, exact=EXACT, min_coexecuted=3,
                                   max_traces=4)
    assert outcome.terra["printed"] >= 2 * 10, outcome.report()  # (eager's: compared)
    assert "side effect: calls print" in outcome.explain, outcome.report()
    line = inspect.getsourcelines(Printing.call)[1] + 1  # the line of the print
    assert f"test_user_layer_regions_differential.py:{line}" in outcome.explain, \
        outcome.report()


def test_a_user_layer_appending_to_a_global_list_appends_every_call():
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, lambda: Outer(Appending)), 10,
                                   exact=EXACT, min_coexecuted=3, max_traces=4)
    assert len(outcome.terra["seen"]) >= 2 * 10, outcome.report()  # (eager's: compared)
    assert "side effect: calls append" in outcome.explain, outcome.report()


def test_a_user_layer_reading_a_value_runs_its_python():
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, lambda: Outer(NumpyReading)), 10,
                                   min_coexecuted=0, max_traces=6, expect_fallbacks=(0, 2))
    assert "its call assigns the attribute last" in outcome.explain, outcome.report()


def _rescaled(step, model):
    if step == 6:
        model.blocks[1].scale = 0.5  # a Python attribute a skipped call's graph holds


def test_an_attribute_changed_between_steps_turns_the_region_off():
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, change=_rescaled), 10,
                                   exact=EXACT, expect_fallbacks=(0, 2), max_traces=6,
                                   min_coexecuted=2)
    assert "attributes changed" in outcome.explain and "scale" in outcome.explain, \
        outcome.report()


def _shifted(step, model):
    global SHIFT
    if step == 6:
        SHIFT = 0.25


def test_a_global_changed_between_steps_turns_the_region_off():
    outcome = assert_same_as_eager(lambda t, s: _loop(t, s, change=_shifted), 10,
                                   exact=EXACT, expect_fallbacks=(0, 2), max_traces=6,
                                   min_coexecuted=2)
    assert "the global SHIFT it reads changed" in outcome.explain, outcome.report()


def test_the_static_check_names_the_write_and_its_line():
    class Counting(keras.layers.Layer):
        def call(self, x):
            self.n = getattr(self, "n", 0) + 1
            return x

    why = user_layers.ineligible(Counting())
    assert why is not None and "assigns the attribute n" in why and ".py:" in why
    assert user_layers.ineligible(Inner(2)) is None


def test_the_monitor_tells_pure_python_from_side_effects():
    def pure(x):
        parts = []
        parts.append(x)  # a list of its own
        return tf.concat(parts * 2, 0) + len(parts)

    def numpy_call(x):
        return np.mean(x)

    def cond_on_a_tensor(x):  # eager tf.cond reads the predicate: a branch in Python
        return tf.cond(x[0] > 0, lambda: x, lambda: -x)

    def cond_on_a_bool(x):  # a Python bool: no value read, one branch in every call
        return tf.cond(True, lambda: x, lambda: -x)

    for fn, bad in ((pure, None), (numpy_call, "numpy"), (lambda x: x.numpy(), "value"),
                    (lambda x: float(x[0]), "value"), (cond_on_a_tensor, "tf.cond"),
                    (cond_on_a_bool, None)):
        with user_layers.Monitor() as monitor:
            fn(tf.ones((2,)))
        assert (monitor.why is None) == (bad is None), (fn, monitor.why)
        if bad is not None:
            assert bad in monitor.why[0], monitor.why


tf_keras = pytest.importorskip("tf_keras")


class KerasTwoInner(tf_keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = tf_keras.layers.Dense(8, activation="tanh")

    def call(self, x):
        return self.dense(x) + tf.reduce_mean(x, axis=-1, keepdims=True)


class KerasTwoOuter(tf_keras.Model):
    def __init__(self, calls=None, **kwargs):
        super().__init__(**kwargs)
        self.inner = [KerasTwoInner(), KerasTwoInner()]
        self.head = tf_keras.layers.Dense(3)
        self.calls = calls

    def call(self, x, training=False):
        if self.calls is not None:
            self.calls.append(1)  # a list the loop made: must grow by every call
        for inner in self.inner:
            x = inner(x)
        return self.head(x)


def _tf_keras_loop(tape_cls, steps, calls=None):
    tf_keras.utils.set_random_seed(0)
    data = classification_data(steps * 8, 6, 3)
    model = KerasTwoOuter(calls)
    model(tf.zeros((8, 6)))
    optimizer = tf_keras.optimizers.Adam(1e-2)
    loss_fn = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 8)
        with tape_cls() as tape:
            loss = loss_fn(y, model(tf.constant(x), training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return {"losses": losses, "model": model.variables, "optimizer0": optimizer.variables(),
            "calls": len(calls) if calls is not None else None}


def test_a_tf_keras_user_model_is_one_skipped_call():
    outcome = assert_same_as_eager(_tf_keras_loop, 10, exact=EXACT, min_coexecuted=4)
    assert outcome.stats.skipped_layer_calls == outcome.stats.coexecuted, outcome.report()


def test_a_tf_keras_user_model_appending_to_its_list_keeps_appending():
    outcome = assert_same_as_eager(lambda t, s: _tf_keras_loop(t, s, []), 10, exact=EXACT,
                                   min_coexecuted=3, max_traces=4)
    assert outcome.terra["calls"] >= 10, outcome.report()  # (eager's: compared)
    # its inner layers, pure, are regions of their own
    assert outcome.stats.skipped_layer_calls >= 2 * outcome.stats.coexecuted, outcome.report()


def test_under_another_profile_function_a_user_layer_runs_its_python():
    """cProfile's profile function is none Python can pass events on to: the call is not
    watched, so it counts as having a side effect (the numbers stay eager's either way)."""
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    try:
        with user_layers.Monitor() as monitor:
            tf.reduce_sum(tf.ones((2,)))
    finally:
        profile.disable()
    assert monitor.why is not None and "profile function" in monitor.why[0]
    with user_layers.Monitor() as monitor:
        tf.reduce_sum(tf.ones((2,)))
    assert monitor.why is None
