"""Region lanes (``terra/region_lanes.py``): a region call skipped before (a tensor's slicing,
a built-in Keras layer) is skipped again along its lane, and every call the lane does not
recognize goes to the general path, which decides as it always did. Each program changes,
after some co-executed iterations along region lanes, one thing a region lane checks (the
slice, the input's producer, the input's shape) and must give eager's numbers."""

import collections

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager

from terra import lanes, region_lanes

STEPS = 12
CHANGE_AT = 8  # co-execution starts at step 3 (warm-up, two traces): region lanes from 4


@pytest.fixture
def answered(monkeypatch):
    """How many calls region lanes answered (not ``MISS``) in the Terra run, by the region's
    name."""
    counts = collections.Counter()
    original = region_lanes.RegionLane.__call__

    def counted(self, attrs, *args):
        result = original(self, attrs, *args)
        counts[attrs[0]] += result is not lanes.MISS
        return result

    monkeypatch.setattr(region_lanes.RegionLane, "__call__", counted)
    return counts


def slicing_program(change):
    """Slices of a stand-in in a chain of ops, two batch sizes alternately; from ``CHANGE_AT`` on,
    ``change`` says what differs at the slices."""

    def program(tape_cls, steps):
        w = tf.Variable(tf.fill((4, 4), 0.5))
        xs = [tf.constant(np.arange(n * 4, dtype=np.float32).reshape(n, 4) / 16) for n in (6, 4)]
        losses = []
        for step in range(steps):
            late = step >= CHANGE_AT
            x = xs[step % 2]
            if late and change == "shape":
                x = tf.concat([x, x], 0)  # rows never seen: new shapes at the slices
            cut = 2 if late and change == "slice" else 1
            with tape_cls() as tape:
                y = tf.matmul(x, w)
                y = tf.math.cumsum(tf.concat([y[cut:], y[:cut]], 0), axis=0) * 0.5  # rows' order
                u = y + 1.0
                z = (u if late and change == "producer" else y)[:, 1:]
                loss = tf.reduce_sum(z * z) + tf.reduce_sum(u)
            w.assign_sub(1e-2 * tape.gradient(loss, w))
            losses.append(float(loss))
        return {"losses": losses, "w": w}

    return program


@pytest.mark.parametrize("change", ["none", "slice", "producer", "shape"])
def test_a_changed_call_leaves_the_region_lane_for_the_general_path(change, answered):
    changed = change in ("slice", "producer")  # a fallback, then traces of the new path
    assert_same_as_eager(slicing_program(change), STEPS,
                         expect_fallbacks=(changed, None), max_traces=2 + 2 * changed)
    assert answered["Tensor.__getitem__"] > 0, answered


def keras_program(tape_cls, steps):
    """A Keras 3 model (Dense, BatchNormalization in training mode) called on a stand-in,
    batches of two sizes alternately: its call is skipped along a lane (a model called on the
    fed batch itself, or with Dropout, whose seeds are fed, takes the general path)."""
    tf.keras.utils.set_random_seed(3)
    model = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu"),
                                 tf.keras.layers.BatchNormalization(),
                                 tf.keras.layers.Dense(1)])
    rng = np.random.default_rng(3)
    xs = [tf.constant(rng.normal(size=(n, 5)).astype("float32")) for n in (8, 6)]
    ys = [tf.constant(rng.normal(size=(n, 1)).astype("float32")) for n in (8, 6)]
    opt = tf.keras.optimizers.SGD(0.05)
    losses = []
    for step in range(steps):
        x, y = xs[step % 2], ys[step % 2]
        with tape_cls() as tape:
            loss = tf.reduce_mean(tf.square(model(x * 1.0, training=True) - y))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return {"losses": losses, "variables": [v.numpy() for v in model.variables]}


def test_keras_layer_calls_along_region_lanes_keep_eagers_numbers(answered):
    assert_same_as_eager(keras_program, STEPS, max_traces=3)
    assert sum(answered.values()) > 0, answered
