"""Lanes (``terra/lanes.py``): the precompiled way through an op matched before must take the
ops it recognizes, and hand every op it does not to the general path, which then decides as
it always did: each program changes, after some co-executed iterations along lanes, one
thing a lane checks (a Python scalar, a numpy array, a list of scalars, a constant tensor's
value, an input's producer) and must give eager's numbers."""

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager

from terra import lanes

STEPS = 12
CHANGE_AT = 8  # co-execution starts at step 3 (warm-up, two traces): lanes from step 4


@pytest.fixture
def followed(monkeypatch):
    """How many ops lanes answered (not ``MISS``) in the Terra run."""
    answered = [0]
    original = lanes.follow

    def follow(runner, lane, args):
        result = original(runner, lane, args)
        answered[0] += result is not lanes.MISS
        return result

    monkeypatch.setattr(lanes, "follow", follow)
    return answered


def chain_program(change):
    """A chain of small ops with a variable, trained; from ``CHANGE_AT`` on, ``change(step)``
    says which input differs."""

    def program(tape_cls, steps):
        w = tf.Variable(tf.fill((4, 4), 0.5))
        x = tf.constant(np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
        losses, held = [], None
        for step in range(steps):
            late = step >= CHANGE_AT
            scalar = 2.0 if late and change == "scalar" else 1.0
            perm = np.array([0, 1] if late and change == "array" else [1, 0])
            cut = 2 if late and change == "const" else 1
            axis = [1] if late and change == "list" else [0]
            with tape_cls() as tape:
                y = tf.add(x, scalar) * w
                y = tf.concat([y[cut:], y[:cut]], 0)
                y = tf.transpose(y, perm)
                y = tf.reverse(y, axis)
                z = tf.multiply(y, held if late and change == "producer" else y)
                loss = tf.reduce_sum(z)
            grad = tape.gradient(loss, w)
            w.assign_sub(1e-3 * grad)
            held = y
            losses.append(loss)
        return {"losses": [float(v) for v in losses], "w": w.numpy()}

    return program


@pytest.mark.parametrize("change", ["none", "scalar", "array", "list", "const", "producer"])
def test_a_changed_input_leaves_the_lane_for_the_general_path(change, followed):
    changed = change != "none"  # a fallback, then traces of the new path
    assert_same_as_eager(chain_program(change), STEPS, expect_fallbacks=(changed, None),
                         max_traces=2 + 2 * changed)
    assert followed[0] > 0
