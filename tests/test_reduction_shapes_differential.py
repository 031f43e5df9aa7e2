"""Reductions over a tensor whose row count the data decides (``tf.boolean_mask``): a new row
count in most steps, so their output shapes are inferred as Python calls them, in Python from
their axes (``standins.reduction_shape``), and must give eager's numbers."""

import collections

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager

from terra import standins

STEPS = 16


@pytest.fixture
def answered(monkeypatch):
    """How many output shapes ``reduction_shape`` gave in the Terra run, by op type and by
    whether they hold for every call with those input shapes (axes a constant)."""
    counts = collections.Counter()
    original_specs, original_shape = standins.inferred_specs, standins.reduction_shape
    shapes = []

    def reduction_shape(*args):
        shape = original_shape(*args)
        shapes.append(shape)
        return shape

    def inferred_specs(step, *args):
        del shapes[:]
        specs, values = original_specs(step, *args)
        if shapes and shapes[-1] is not None:
            counts[step.op_type, values is None] += 1
        return specs, values

    monkeypatch.setattr(standins, "reduction_shape", reduction_shape)
    monkeypatch.setattr(standins, "inferred_specs", inferred_specs)
    return counts


def masked_reductions_program(tape_cls, steps):
    """The rows of a product whose first column is positive, reduced over constant axes
    (kept or not, negative) and over an axis that alternates between steps (fed)."""
    rng = np.random.default_rng(7)
    w = tf.Variable(rng.normal(size=(4, 3)).astype("float32"))
    xs = rng.normal(size=(steps, 16, 4)).astype("float32")
    losses, counts, argmaxes = [], [], []
    for step in range(steps):
        x = tf.constant(xs[step])
        with tape_cls() as tape:
            h = tf.matmul(x, w)
            rows = tf.boolean_mask(h, h[:, 0] > 0)  # a row count the data decides
            total = tf.reduce_sum(rows, axis=0)
            centre = tf.reduce_mean(rows, axis=[0], keepdims=True)
            peak = tf.reduce_max(rows - centre, axis=-1)
            spread = tf.reduce_sum(tf.square(rows), axis=step % 2)  # (3,) or (rows,)
            loss = tf.reduce_sum(total * total) * 1e-2 + tf.reduce_sum(peak) + \
                tf.reduce_sum(spread) * 1e-2
        w.assign_sub(1e-2 * tape.gradient(loss, w))
        losses.append(float(loss))
        counts.append(int(tf.shape(rows)[0]))
        argmaxes.append(tf.argmax(rows, axis=1).numpy().tolist())
    return {"losses": losses, "counts": counts, "argmaxes": argmaxes, "w": w}


def test_reductions_over_a_new_row_count_keep_eagers_numbers(answered):
    outcome = assert_same_as_eager(masked_reductions_program, STEPS, max_traces=4,
                                   min_coexecuted=STEPS - 6)
    counts = outcome.eager["counts"]
    assert len(set(counts[6:]) - set(counts[:6])) > 2, counts  # the premise: new counts
    for op_type in ("Sum", "Mean", "Max", "ArgMax"):
        assert answered[op_type, True] > 0, answered  # constant axes: for every call
    assert answered["Sum", False] > 0, answered  # the fed axis: for its value
