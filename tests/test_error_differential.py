"""Errors inside an iteration: Terra raises what eager raises, where eager raises it, leaves the
variables as eager leaves them, and keeps co-executing afterwards.
"""

import inspect
import os
import traceback
from contextlib import nullcontext

import pytest
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tensorflow.errors import InvalidArgumentError
from tensorflow.python import pywrap_tfe
from tiny_models import batch, mlp_task, state

STEPS, FAILING_STEP = 12, 6  # warm-up 1 + ~2 traces, so FAILING_STEP is co-executed


def assert_coexecution_resumed(outcome):
    before = outcome.stats_at(f"step{FAILING_STEP}")
    after = outcome.stats_at(f"step{FAILING_STEP + 1}")
    assert before.coexecuted >= 1, f"the failing step was not co-executed\n{outcome.report()}"
    assert outcome.stats.coexecuted > after.coexecuted, (
        f"co-execution did not resume after the error\n{outcome.report()}"
    )


# ------------------------------------------------------------------------------------ user code


class BadBatch(ValueError):
    """The user's own error (a subclass, so that an unrelated ValueError is not swallowed)."""


def user_error_program(where):
    """``raise ValueError`` in user code at one step, caught around that iteration."""

    def program(tape_cls, steps):
        data, model, optimizer, loss_fn = mlp_task(steps)
        losses, caught = [], []
        for step in range(steps):
            record_stats(f"step{step}")
            x, y = batch(data, step, 16)
            try:
                with tape_cls() as tape:
                    loss = loss_fn(y, model(x, training=True))
                    if step == FAILING_STEP and where == "after_forward":
                        raise BadBatch(f"bad batch at step {step}")
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                if step == FAILING_STEP and where == "after_update":
                    raise BadBatch(f"logging failed at step {step}")
                losses.append(float(loss))
            except BadBatch as error:
                caught.append(str(error))
        return {"caught": caught, "losses": losses, **state(model, optimizer)}

    return program


@pytest.mark.parametrize("where", ["after_forward", "after_update"])
def test_user_exception_mid_iteration(where):
    """after_forward: the update must not happen (the graph may already be running ahead);
    after_update: it must happen although Python never fetched anything of that step."""
    outcome = assert_same_as_eager(
        user_error_program(where), STEPS, expect_fallbacks=(0, 2), max_traces=4
    )
    assert len(outcome.eager["caught"]) == 1  # the program's premise
    assert_coexecution_resumed(outcome)


# ------------------------------------------------------------------------------------ graph side


def lookup_weight(class_weights, index):
    return tf.gather(class_weights, index)


def checked(loss):
    return tf.debugging.check_numerics(loss, "loss")


FAILING_OP = {
    "gather": (lookup_weight, "tf.gather("),
    "check_numerics": (checked, "check_numerics("),
}


def failing_line(kind):
    """``(file, line)`` of the op that fails, found in the source rather than hard-coded."""
    function, call = FAILING_OP[kind]
    lines, first = inspect.getsourcelines(function)
    [offset] = [i for i, line in enumerate(lines) if call in line]
    return os.path.abspath(inspect.getsourcefile(function)), first + offset


def graph_error_program(kind, errors, used=True):
    """At one step, fed data makes an op fail: an out-of-range index from a Python int
    (gather) or a NaN loss scale from a Python float (check_numerics). The NaN is applied to
    the loss itself: a NaN *input* may not survive the graph (grappler fuses MatMul+BiasAdd+Relu
    and the fused Relu maps NaN to 0). ``errors`` collects (tape class, ExceptionInfo).
    ``used=False``: the failing ops' values are never used (eager still runs them, and
    fails), so only their errors make the graph run them."""

    def program(tape_cls, steps):
        data, model, optimizer, loss_fn = mlp_task(steps)
        class_weights = tf.constant([1.0, 0.5, 2.0, 1.5, 0.75])
        losses = []
        for step in range(steps):
            record_stats(f"step{step}")
            x, y = batch(data, step, 16)
            index, scale = step % 5, 1.0 + 0.01 * step
            if step == FAILING_STEP:
                if kind == "gather":
                    index = 99
                else:
                    scale = float("nan")
            expect_error = step == FAILING_STEP
            with pytest.raises(InvalidArgumentError) if expect_error else nullcontext() as info:
                with tape_cls() as tape:
                    loss = loss_fn(y, model(x, training=True))
                    if used:
                        loss = checked(loss * lookup_weight(class_weights, index) * scale)
                    else:  # the values are dropped at once: nothing fetches them
                        lookup_weight(class_weights, index)
                        checked(loss * scale)
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                losses.append(float(loss))
            if info is not None:
                errors.append((tape_cls, info))
        return {"losses": losses, **state(model, optimizer)}

    return program


@pytest.mark.parametrize("used", [True, False], ids=["used", "unused"])
@pytest.mark.parametrize("kind", ["gather", "check_numerics"])
def test_graph_side_error_raised_like_eager_with_user_line(kind, used):
    errors = []
    outcome = assert_same_as_eager(
        graph_error_program(kind, errors, used), STEPS, expect_fallbacks=(0, 2), max_traces=4
    )
    [(eager_tape, eager), (terra_tape, terra_info)] = errors
    assert eager_tape is tf.GradientTape and terra_tape is not tf.GradientTape
    # both runs raised InvalidArgumentError (pytest.raises in the program): the very same class
    assert terra_info.type is eager.type, f"{terra_info.value!r}\n{outcome.report()}"

    path, line = failing_line(kind)
    # eager's own traceback passes through the failing op's line: that is the line to name
    assert (path, line) in [
        (os.path.abspath(frame.filename), frame.lineno) for frame in traceback.extract_tb(eager.tb)
    ]
    where = f"{os.path.basename(path)}:{line}"
    assert where in str(terra_info.value), (
        f"the error does not name {where}:\n{terra_info.value}\n{outcome.report()}"
    )
    assert_coexecution_resumed(outcome)
    # the replay that reproduced the error re-entered a real tape of an iteration whose `with`
    # Python had already left: left open, it would record (and keep alive) every later op
    assert pywrap_tfe.TFE_Py_TapeSetIsEmpty(), "a real GradientTape was left recording"
