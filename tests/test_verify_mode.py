"""Verify mode (``terra.configure(verify=k)``, ``terra.verify``): every k-th co-executed
iteration is run again eagerly and compared with what the graph computed.

1. A program verified every iteration keeps eager's numbers, finds no difference, and
   reports what the checks cost (``terra.stats()``, ``explain()``).
2. A graph made wrong on purpose (the emitter perturbs one op's output as it builds the
   function, so the graph computes it wrongly while Python and the replay do not) gives
   other numbers than eager without verify mode: the fault is real and a differential test
   catches it. With verify mode it raises ``terra.DivergenceError`` at the first co-executed
   iteration, naming the op and the user's line, with eager's variables at the raise; in
   warn mode it warns and the program finishes with eager's numbers. A wrong gradient is
   named where Python sees it: at ``tape.gradient`` if Python keeps the gradients, else at
   the variable the optimizer writes first.
3. The last iteration, which no tape enter closes, is checked where it is closed (an op
   after the loop, ``terra.reset()``); an error only the eager replay raises is a
   difference; ``verify=3`` checks every third co-executed iteration.
"""

import inspect

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, mlp_loop, mlp_task, state

import terra
from terra import emitter, fallback
from terra.config import config

STEPS = 9  # warm-up 1, traces 2, then co-executed from step 4 on (iteration 4)


def program(tape_cls, steps, progress=None, drop_grads=False):
    """The MLP task with the loss written out on one line, the losses kept as tensors and
    read after the loop. ``progress`` gets the model, optimizer and completed steps. The
    data is that of ``STEPS`` steps at least, so a shorter run sees the same batches.
    ``drop_grads``: the gradients are dropped before the next iteration (else they outlive
    it, and the graph returns them)."""
    data, model, optimizer, _ = mlp_task(max(steps, STEPS))
    progress = {} if progress is None else progress
    progress.update(model=model, optimizer=optimizer, completed=0)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))  # loss
        grads = tape.gradient(loss, model.trainable_variables)  # grads
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))  # update
        losses.append(loss)
        if drop_grads:
            del grads
        progress["completed"] = step + 1
    return {"losses": losses, **state(model, optimizer)}


def _line_of(marker):
    """``file:line`` of the line of ``program`` that ends with ``marker``."""
    source, first = inspect.getsourcelines(program)
    (offset,) = [i for i, text in enumerate(source) if text.rstrip().endswith(marker)]
    return f"{inspect.getsourcefile(program)}:{first + offset}"


@pytest.fixture
def verify_every(monkeypatch):
    def every(k, action="raise"):
        monkeypatch.setattr(config, "verify", k)
        monkeypatch.setattr(config, "verify_action", action)

    return every


def _perturb(monkeypatch, which):
    """The emitter makes ``which(step)``'s outputs 1% larger in the graph it builds: a bug in
    the graph that Python's skeleton and the eager replay do not share."""
    original = emitter.Emitter.output

    def output(self, step, k, t, env, last_fetch):
        if which(step) and t.dtype.is_floating:
            t = t * 1.01
        original(self, step, k, t, env, last_fetch)

    monkeypatch.setattr(emitter.Emitter, "output", output)


def _the_loss(step):
    return step.op_type == "Mean" and step.node.location.line == int(
        _line_of("# loss").rsplit(":", 1)[1])


def _a_backward_matmul(step):
    return step.op_type == "MatMul" and step.owner is not step  # inside a gradient region


def test_verified_every_iteration_the_program_keeps_eager_numbers_and_no_difference(
        verify_every):
    verify_every(1)
    outcome = assert_same_as_eager(program, STEPS, exact=("losses", "model", "optimizer0"))
    s = outcome.stats
    assert s.coexecuted >= 5 and s.verified == s.coexecuted, outcome.report()
    assert s.verify_differences == 0 and s.phase == "coexecution", outcome.report()
    # the cost is reported: in the stats, and in explain()'s summary line
    assert s.verify_time > 0, outcome.report()
    (line,) = [x for x in outcome.explain.splitlines() if x.startswith("verify mode")]
    assert f"{s.verified} iteration(s) checked against eager" in line, line
    assert "0 difference(s)" in line and "ms per check" in line, line


def test_every_kth_co_executed_iteration_is_verified(verify_every):
    """``mlp_loop`` reads its loss with ``float()`` in every iteration: a fetched value."""
    verify_every(3)
    outcome = assert_same_as_eager(mlp_loop, 12, exact=("losses", "model", "optimizer0"))
    s = outcome.stats
    assert s.coexecuted >= 6 and s.verified == s.coexecuted // 3, outcome.report()
    assert s.verify_differences == 0, outcome.report()


def test_without_verify_mode_the_perturbed_graph_gives_other_numbers(monkeypatch):
    """The fault the next tests inject is one a differential test sees: the check below is
    what verify mode does inside the run."""
    _perturb(monkeypatch, _the_loss)
    with pytest.raises(AssertionError, match="Terra differs from eager at losses"):
        assert_same_as_eager(program, STEPS)


@pytest.mark.parametrize("fault, marker, what, drop_grads", [
    (_the_loss, "# loss", "output 0 of Mean", False),
    # the gradients outlive their iteration: the graph returns them, and they are compared
    (_a_backward_matmul, "# grads", "gradient result 0 of tape.gradient", False),
    # a wrong gradient Python drops shows in the variables the optimizer's update writes
    (_a_backward_matmul, "# update", "a variable of shape", True),
])
def test_a_graph_that_computes_wrongly_raises_naming_the_op_and_the_line(
        verify_every, monkeypatch, fault, marker, what, drop_grads):
    verify_every(1)
    _perturb(monkeypatch, fault)
    terra.reset()
    tf.keras.backend.clear_session()
    progress = {}
    try:
        with pytest.raises(terra.DivergenceError) as caught:
            program(terra.TerraGradientTape, STEPS, progress, drop_grads)
        s, explained = terra.stats(), terra.explain()
        at_raise = {k: [v.numpy() for v in vs] for k, vs in
                    state(progress["model"], progress["optimizer"]).items()}
    finally:
        terra.reset()
    message = str(caught.value)
    assert f"{what}" in message and f"issued at {_line_of(marker)}" in message, message
    assert "in iteration 4" in message, message  # the first co-executed one
    assert caught.value.difference.location is not None
    # raised at the next tape enter; Terra runs eagerly from there, on eager's variables
    assert progress["completed"] == 4 and s.phase == "eager", explained
    assert s.verified == 1 and s.verify_differences >= 1, explained
    assert "verify mode: Terra's graph and eager differ" in explained, explained
    tf.keras.backend.clear_session()
    reference = program(tf.GradientTape, 4, drop_grads=drop_grads)
    for key, values in at_raise.items():
        for value, expected in zip(values, reference[key], strict=True):
            np.testing.assert_array_equal(value, expected.numpy())


@pytest.mark.parametrize("fault, marker, what", [
    (_the_loss, "# loss", "output 0 of Mean"),
    (_a_backward_matmul, "# grads", "gradient result 0 of tape.gradient"),  # wrong updates
])
def test_in_warn_mode_the_program_finishes_with_eager_numbers(
        verify_every, monkeypatch, fault, marker, what):
    verify_every(1, "warn")
    _perturb(monkeypatch, fault)
    with pytest.warns(terra.DivergenceWarning, match=what) as warned:
        outcome = assert_same_as_eager(program, STEPS, exact=("losses", "model", "optimizer0"))
    (warning,) = [w for w in warned if w.category is terra.DivergenceWarning]
    assert f"{warning.filename}:{warning.lineno}" == _line_of(marker), warning
    s = outcome.stats  # one check found it; Terra ran eagerly from there
    assert s.phase == "eager" and s.verified == 1 and s.verify_differences >= 1, \
        outcome.report()


def test_a_wrong_verify_action_is_refused():
    with pytest.raises(ValueError, match="verify_action"):
        terra.configure(verify_action="ignore")


@pytest.mark.parametrize("closed_by", ["a read after the loop", "terra.reset()"])
def test_a_difference_in_the_last_iteration_is_raised_where_it_is_closed(
        verify_every, monkeypatch, closed_by):
    """The last iteration never ends at a tape enter: an op after the loop closes it (the
    variable's read raises), or ``terra.reset()`` does (which still stops the runtime)."""
    verify_every(1)
    _perturb(monkeypatch, _the_loss)
    terra.reset()
    tf.keras.backend.clear_session()
    try:
        results = program(terra.TerraGradientTape, 4)  # iteration 4: the only co-executed one
        with pytest.raises(terra.DivergenceError, match="output 0 of Mean"):
            if closed_by == "terra.reset()":
                terra.reset()
            else:
                results["model"][0].numpy()
        if closed_by == "terra.reset()":
            assert terra.stats().iterations == 0  # the runtime is gone
        else:
            assert terra.stats().phase == "eager", terra.explain()
        kernel = results["model"][0].numpy()  # eager's, read eagerly now
    finally:
        terra.reset()
    tf.keras.backend.clear_session()
    np.testing.assert_array_equal(kernel, program(tf.GradientTape, 4)["model"][0].numpy())


def test_an_error_only_the_eager_run_raises_is_a_difference(verify_every, monkeypatch):
    """The replay's loss op fails as TF fails it (a reduction over an axis the loss has
    not): eager would raise where the graph did not. The graph's variables stand, since
    eager has none past its error."""
    verify_every(1)
    original = fallback._execute

    def failing(node, args, *rest):
        if node.op_type == "Mean":
            args = [args[0], tf.constant([5])]
        return original(node, args, *rest)

    monkeypatch.setattr(fallback, "_execute", failing)
    terra.reset()
    tf.keras.backend.clear_session()
    progress = {}
    try:
        with pytest.raises(terra.DivergenceError) as caught:
            program(terra.TerraGradientTape, STEPS, progress)
        at_raise = [v.numpy() for v in progress["model"].variables]
        phase = terra.stats().phase
    finally:
        terra.reset()
    message = str(caught.value)
    assert "iteration 4: the eager run of the iteration: raised InvalidArgumentError" in \
        message and f"issued at {_line_of('# loss')}" in message, message
    assert progress["completed"] == 4 and phase == "eager"
    tf.keras.backend.clear_session()
    reference = program(tf.GradientTape, 4)["model"]
    for value, expected in zip(at_raise, reference, strict=True):
        np.testing.assert_array_equal(value, expected.numpy())
