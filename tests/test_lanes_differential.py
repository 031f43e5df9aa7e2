"""Lanes (``terra/lanes.py``): the precompiled way through an op matched before must take the
ops it recognizes, and hand every op it does not to the general path, which then decides as
it always did: each program changes, after some co-executed iterations along lanes, one
thing a lane checks (a Python scalar, a numpy array, a list of scalars, a constant tensor's
value, an input's producer) and must give eager's numbers."""

import collections
import collections.abc

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tensorflow.python.eager import context

from terra import lanes
from terra.config import config

STEPS = 12
CHANGE_AT = 8  # co-execution starts at step 3 (warm-up, two traces): lanes from step 4


@pytest.fixture(autouse=True, params=["native", "python"])
def native(request, monkeypatch):
    """Every test twice: with the lanes' native twins (``terra._native``), and with the
    Python lanes alone, as where the extension was not built."""
    if request.param == "native" and lanes.native is None:
        pytest.skip("terra._native was not built")
    monkeypatch.setattr(config, "native", request.param == "native")
    return request.param == "native"


class _Followed(collections.abc.Mapping):
    """Ops answered by lanes, by (op type, whether the lane looks its output shapes up):
    by the Python lane's ``follow`` or by its native twin."""

    def __init__(self):
        self.python = collections.Counter()
        self.lanes = []  # (kind, lane)

    def _counts(self):
        counts = collections.Counter(self.python)
        for kind, lane in self.lanes:
            if lane.native is not None:
                counts[kind] += lane.native.answered
        return counts

    def __getitem__(self, kind):
        return self._counts()[kind]

    def __iter__(self):
        return iter(self._counts())

    def __len__(self):
        return len(self._counts())


@pytest.fixture
def followed(monkeypatch):
    """How many ops lanes answered (not ``MISS``) in the Terra run, by op type and by whether
    the lane looks its output shapes up (``shaped``)."""
    answered = _Followed()
    original = lanes.build

    def build(runner, cur, step, *args):
        lane = original(runner, cur, step, *args)
        if lane:
            follow, kind = lane.follow, (step.op_type, step.check_shapes)

            def counted(call_args):
                result = follow(call_args)
                answered.python[kind] += result is not lanes.MISS
                return result

            lane.follow = counted
            answered.lanes.append((kind, lane))
        return lane

    monkeypatch.setattr(lanes, "build", build)
    return answered


def chain_program(change):
    """A chain of small ops with a variable, trained on two batches in turn (fed); from
    ``CHANGE_AT`` on, ``change`` says which input differs."""

    def program(tape_cls, steps):
        w = tf.Variable(tf.fill((4, 4), 0.5))
        x = tf.constant(np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
        batches = [x, x * 0.5]
        row = x[:1]  # a batch of another shape: broadcast against w, the rest is alike
        losses, held = [], None
        for step in range(steps):
            late = step >= CHANGE_AT
            x = row if late and change == "fed shape" else batches[step % 2]
            scalar = 2.0 if late and change == "scalar" else 1.0
            perm = np.array([0, 1] if late and change == "array" else [1, 0])
            cut = 2 if late and change == "const" else 1
            axis = [1] if late and change == "list" else [0]
            # an array converted to a new tensor every step; "converted array": converted
            # from [1], then the array set back to the [0] of every other step
            dims = np.array([1 if late and change == "converted array" else 0])
            with tape_cls() as tape:
                dims_t = tf.constant(dims)
                dims[0] = 0
                y = tf.add(x, scalar) * w
                y = tf.concat([y[cut:], y[:cut]], 0)
                y = tf.transpose(y, perm)
                y = tf.reverse(y, axis)
                z = tf.multiply(y, held if late and change == "producer" else y)
                loss = tf.reduce_sum(tf.reduce_max(z, dims_t))  # the axis matters
            grad = tape.gradient(loss, w)
            w.assign_sub(1e-3 * grad)
            held = y
            losses.append(loss)
        return {"losses": [float(v) for v in losses], "w": w.numpy()}

    return program


@pytest.mark.parametrize("change", ["none", "scalar", "array", "list", "const", "producer",
                                    "fed shape", "converted array"])
def test_a_changed_input_leaves_the_lane_for_the_general_path(change, followed):
    changed = change != "none"  # a fallback, then traces of the new path
    assert_same_as_eager(chain_program(change), STEPS, expect_fallbacks=(changed, None),
                         max_traces=2 + 2 * changed)
    assert sum(followed.values()) > 0
    if not changed:
        assert followed[("AddV2", False)] > 0, followed  # the batch, fed by the lane
        assert followed[("Sum", False)] > 0, followed  # axes converted from arrays


def forms_program(tape_cls, steps):
    """Ops of the lane forms the chain has not: several outputs packed as a list (``Unpack``),
    a captured tensor (the same object every step) read by two ops, a constant tensor made
    once a step and read by two ops, an op without outputs mid-step (a variable's update),
    and batches of two sizes (output shapes looked up by input shapes)."""
    rng = np.random.default_rng(5)
    w = tf.Variable(rng.normal(size=(3, 4)).astype("float32"))
    big = tf.constant(rng.normal(size=(100, 4)).astype("float32"))  # captured
    xs = [tf.constant(rng.normal(size=(n, 3)).astype("float32")) for n in (6, 4)]
    count = tf.Variable(0.0)
    losses = []
    for step in range(steps):
        x = xs[step % 2]
        with tape_cls() as tape:
            scale = tf.constant([1.5, 0.5, 1.0, 2.0])  # a fresh tensor, read twice
            h = tf.matmul(x, w) * scale
            a, b = tf.unstack(tf.reshape(h, [-1, 2, 2]), axis=1)  # two outputs
            count.assign_add(tf.reduce_sum(scale))
            m = tf.reduce_mean(big, 0) + scale * count  # the capture and the constant again
            loss = tf.reduce_sum(a * b) + tf.reduce_sum(m * tf.reduce_mean(big * 0.5, 0))
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss))
    return {"losses": losses, "w": w, "count": count}


def test_lanes_of_every_form_keep_eagers_numbers(followed):
    assert_same_as_eager(forms_program, STEPS, max_traces=3)
    assert followed[("Unpack", True)] > 0, followed  # packed outputs, shapes looked up
    assert followed[("Mean", False)] > 0, followed  # the captured tensor
    assert followed[("Mul", True)] > 0, followed  # the step's constant, read again later
    assert followed[("AssignAddVariableOp", False)] > 0, followed  # no outputs
    assert followed[("MatMul", True)] > 0, followed  # batches of two sizes, fed


def zero_sign_program(how):
    """0.0 until ``CHANGE_AT``, then -0.0, given to an op ``how``: a Python float as it is
    (``tf.maximum`` hands it to the op), converted by the op's wrapper (``y + z``), or in a
    list converted to a constant. -0.0 == 0.0 in Python and in a dict, but ``1 / (c + z)``
    at ``c == -0.0`` is -inf with -0.0 and inf with 0.0. In a list the constant changed; a
    scalar TF converts through its cache of constants, where 0.0 and -0.0 are one key: eager
    adds the 0.0 it converted first, and so must Terra."""

    def program(tape_cls, steps):
        w = tf.Variable([1.0, 2.0, 3.0])
        x = tf.constant([0.5, 1.0, -2.0])
        c = tf.constant([-0.0, 1.0])
        losses, signs = [], []
        for step in range(steps):
            z = -0.0 if step >= CHANGE_AT else 0.0
            with tape_cls() as tape:
                if how == "python":
                    y = tf.minimum(c, z) + tf.maximum(c, z)
                elif how == "converted":
                    y = c + z
                else:
                    y = c + tf.constant([z, z])
                sign = tf.atan(1.0 / y)  # pi/2 or -pi/2 at the first element
                loss = tf.reduce_sum(x * w) * tf.reduce_sum(sign)
            grad = tape.gradient(loss, w)
            w.assign_sub(1e-2 * grad)
            losses.append(float(loss))
            signs.append(sign.numpy().tolist())
        return {"losses": losses, "w": w, "signs": signs}

    return program


@pytest.mark.parametrize("how", ["python", "converted", "list"])
def test_a_zero_that_turns_negative_is_the_constant_eager_has(how):
    changed = how == "list"
    assert_same_as_eager(zero_sign_program(how), STEPS, expect_fallbacks=int(changed),
                         max_traces=2 + 2 * changed)


def cleared_zero_program(tape_cls, steps):
    """``c + z`` with ``z`` the Python float 0.0 at every step but ``CHANGE_AT``, where TF's
    cache of converted scalars is cleared and ``z`` is -0.0: from then on eager's cache gives
    every zero as -0.0 (``1 / (c + z)`` at ``c == -0.0`` is -inf), and Terra's note of the
    zero the cache holds must be dropped with the cache."""
    w = tf.Variable([1.0, 2.0, 3.0])
    x = tf.constant([0.5, 1.0, -2.0])
    c = tf.constant([-0.0])  # a list: not through the cache
    losses, signs = [], []
    for step in range(steps):
        z = 0.0
        if step in (0, CHANGE_AT):  # both runs start from the same cache
            context.context()._clear_caches()  # noqa: SLF001 - as a context reset does
        if step == CHANGE_AT:
            z = -0.0
        with tape_cls() as tape:
            sign = tf.atan(1.0 / (c + z))  # pi / 2 with the zero +0.0, -pi / 2 with -0.0
            loss = tf.reduce_sum(x * w) * tf.reduce_sum(sign)
        w.assign_sub(1e-2 * tape.gradient(loss, w))
        losses.append(float(loss))
        signs.append(sign.numpy().tolist())
    return {"losses": losses, "w": w, "signs": signs}


def test_a_zero_after_tf_cleared_its_scalar_cache_is_the_one_eager_has():
    assert_same_as_eager(cleared_zero_program, STEPS, expect_fallbacks=(True, None),
                         max_traces=4)


def retyped_program(how):
    """A Python list or tuple made anew at every step (a lane knows it by equality with the
    last one matched), which at the step ``CHANGE_AT`` holds an element of another type but
    an equal value: eager cannot convert it and raises (``how``: a ``True`` in a reshape's
    shape, a float among a tile's multiples, an int among a bool op's), and the program
    goes on."""

    def program(tape_cls, steps):
        w = tf.Variable(tf.fill((4, 4), 0.5))
        x = tf.constant(np.arange(16, dtype=np.float32).reshape(4, 4) / 16)
        losses, errors = [], []
        for step in range(steps):
            late = step == CHANGE_AT
            with tape_cls() as tape:
                y = x * w
                try:
                    if how == "bool in a shape":
                        y = tf.reshape(y, (True if late else 1, 4 * 4))
                    elif how == "float among ints":
                        y = tf.tile(y, [2.0 if late else 2, 1])[2:]
                    else:
                        m = tf.logical_and(y > 0.3, [1 if late else True, False, True, True])
                        y = tf.where(m, y, -y)
                except (ValueError, TypeError, tf.errors.InvalidArgumentError) as error:
                    errors.append((step, type(error).__name__))
                loss = tf.reduce_sum(tf.sin(y))
            w.assign_sub(1e-2 * tape.gradient(loss, w))
            losses.append(float(loss))
        return {"losses": losses, "w": w, "errors": errors}

    return program


@pytest.mark.parametrize("how", ["bool in a shape", "float among ints", "int among bools"])
def test_a_list_equal_in_value_but_not_in_type_is_another_constant(how, followed):
    assert_same_as_eager(retyped_program(how), STEPS, expect_fallbacks=(True, None),
                         max_traces=4)
    op = {"bool in a shape": "Reshape", "float among ints": "Tile"}.get(how, "LogicalAnd")
    assert followed[(op, False)] > 0, followed  # the fresh list, along the lane


def empty_shape_program(tape_cls, steps):
    """A scalar's reshape to the empty shape ``()`` at every step (Keras 3 broadcasts to
    one): numpy makes float64 of an empty tuple, which has no float in it."""
    w = tf.Variable(tf.fill((4, 4), 0.5))
    losses = []
    for _ in range(steps):
        with tape_cls() as tape:
            loss = tf.reshape(tf.reduce_sum(w * w), ())
            loss = tf.broadcast_to(loss, ()) * 2.0
        w.assign_sub(1e-2 * tape.gradient(loss, w))
        losses.append(float(loss))
    return {"losses": losses, "w": w}


def test_an_empty_shape_is_the_same_constant_at_every_step():
    assert_same_as_eager(empty_shape_program, STEPS)
