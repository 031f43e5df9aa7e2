"""The lanes' native twins (``terra/_native*.c``): the C door answers an op along a lane of a
common form exactly as the Python lane would, and defers anything else to it. Each program
runs eagerly and under Terra with the twins on and off, and must give eager's numbers both
ways; with the twins on, they must have answered the ops of every form they know (else
these tests would only test the Python lanes)."""

import collections
import os

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager

from terra import lanes, runtime
from terra.config import config

STEPS = 12


@pytest.mark.skipif(os.environ.get("TERRA_NATIVE", "1") == "0", reason="TERRA_NATIVE=0")
def test_the_native_twins_were_built():
    """``pip install -e .`` builds ``terra._native`` where a C compiler is (it is optional
    for users): the suite must not pass on the Python lanes alone without saying so."""
    assert lanes.native is not None, "terra._native did not build: see pip's output"


@pytest.fixture
def twins(monkeypatch):
    """Every native twin built in the Terra run, by op type; and the door the runtime used."""
    built = collections.defaultdict(list)
    doors = []
    original = lanes.build

    def build(runner, cur, step, *args):
        lane = original(runner, cur, step, *args)
        if lane and lane.native is not None:
            built[step.op_type].append(lane.native)
        if not doors and runtime.current() is not None:
            doors.append(type(runtime.current().coexec_door.fast_entry).__name__)
        return lane

    monkeypatch.setattr(lanes, "build", build)
    return built, doors


def forms_program(tape_cls, steps):
    """One op or more of each form a twin knows: inputs from one producer or from one output
    of several, a Python float (converted by the op wrapper, and made anew each step), a
    shape list made anew, an array converted to the axes of a reduction, a captured tensor;
    outputs several (packed as a list), none (a variable's update), looked up by the input
    shapes (batches of two sizes), fetched mid-step (``.numpy()`` of an intermediate); a
    list argument (``tf.concat``)."""
    rng = np.random.default_rng(11)
    w = tf.Variable(rng.normal(size=(3, 4)).astype("float32"))
    big = tf.constant(rng.normal(size=(5, 4)).astype("float32"))  # captured: the same tensor
    xs = [tf.constant(rng.normal(size=(n, 3)).astype("float32")) for n in (6, 4)]
    count = tf.Variable(0.0)
    losses, peeks = [], []
    for step in range(steps):
        x = xs[step % 2]
        half = float(step % 1) + 0.5  # a new float object each step, equal to the last
        with tape_cls() as tape:
            h = tf.matmul(x, w) * 2.0
            a, b = tf.split(h, 2, axis=1)  # two outputs
            c = tf.concat([b * half, a], 1)  # a list argument; one output of two read
            r = tf.reshape(c, [-1, 2])  # a shape list made anew
            peek = tf.reduce_max(r)
            peeks.append(float(peek.numpy()))  # fetched mid-step
            m = tf.reduce_mean(big, 0) + tf.reduce_sum(r)  # the capture; axes from an array
            count.assign_add(tf.reduce_sum(m))  # no outputs
            loss = tf.reduce_sum(r * r) + tf.reduce_sum(m) * 1e-3
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss))
    return {"losses": losses, "peeks": peeks, "w": w, "count": count}


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_every_twin_form_keeps_eagers_numbers(native, twins, monkeypatch):
    if native and lanes.native is None:
        pytest.skip("terra._native was not built")
    monkeypatch.setattr(config, "native", native)
    built, doors = twins
    assert_same_as_eager(forms_program, STEPS, exact=("losses", "peeks"), max_traces=3)
    answered = {op: sum(t.answered for t in ts) for op, ts in built.items()}
    if not native:
        assert not built and doors == ["function"], (answered, doors)
        return
    assert doors == ["Door"], doors
    for op in ("Mul", "Split", "ConcatV2", "Reshape", "Max", "Sum", "Mean",
               "AssignAddVariableOp"):
        assert answered.get(op, 0) > 0, (op, answered)


def broken_entry_program(tape_cls, steps):
    """Batches of two sizes (the lanes look their output shapes up), and at step 8 the
    entry of a stand-in Python holds gets the other batch's shape, one its consumers' lanes
    know: under ``TERRA_CHECK`` the next lane reading it raises Terra's own assertion, which
    must become eager execution (a fallback), never the user's error or another number."""
    from terra import hooks, standins

    rng = np.random.default_rng(3)
    w = tf.Variable(rng.normal(size=(3, 4)).astype("float32"))
    xs = [tf.constant(rng.normal(size=(n, 3)).astype("float32")) for n in (6, 4)]
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            h = tf.matmul(xs[step % 2], w)
            entry = hooks.tensors.get(h._id)
            if step == 8 and type(entry) is standins.Entry:
                entry.shape = (4, 4)  # h is (6, 4) at even steps
            loss = tf.reduce_sum(tf.tanh(h * 2.0))
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss))
    return {"losses": losses, "w": w}


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
def test_a_twins_own_error_becomes_eager_execution(native, monkeypatch):
    if native and lanes.native is None:
        pytest.skip("terra._native was not built")
    monkeypatch.setattr(config, "native", native)
    monkeypatch.setattr(config, "check", True)
    outcome = assert_same_as_eager(broken_entry_program, STEPS, exact=("losses",),
                                   expect_fallbacks=(1, None), max_traces=4)
    assert "an entry has another shape than its tensor" in outcome.explain, outcome.explain
