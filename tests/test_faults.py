"""Faults delivered in the middle of co-execution: Ctrl-C, data that makes the graph fail, the
user's own exception, a graph that never answers.

Terra's promise under a fault is eager's: the exception reaches the user's code as eager would
raise it, the variables are those eager has at that point, nothing Terra started (a thread, a
graph job, a real tape) is left running, and training can go on. Faults that may leave process
state behind (a signal, a stalled GraphRunner, a patched stage) run in a child Python
(``python tests/test_faults.py <scenario> <out.json>``) under a timeout, so a hang fails the
test instead of stalling the suite. Every number is compared with the same program run eagerly.
A fault is delivered when the moment it needs is seen (the graph running, Python in a wait),
never after a fixed delay, which a busy machine overruns: waits for such a moment are bounded
by ``WAIT`` only so that a moment that never comes fails the test.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tensorflow.errors import InvalidArgumentError
from tensorflow.python import pywrap_tfe
from tiny_models import batch, classification_data, mlp, mlp_loop, mlp_task, sparse_xent, state

import terra
from terra import graph_builder, graph_runner

CHILD_TIMEOUT = 240  # seconds a child may take before the test fails as a hang
WAIT = 120  # seconds a child waits for the moment a fault needs before it gives up
STEPS, FAULT_STEP = 8, 5  # warm-up 1 + ~2 traces + generation: FAULT_STEP is co-executed


# ------------------------------------------------------------------------------ the programs


def slow_loop(tape_cls, steps, fault=None, progress=None):
    """An MLP trained with Adam next to a chain of large matmuls (tenths of a second), so the
    graph is still busy when Python gets ahead of it. ``fault(step)`` runs inside the tape after
    the forward pass has been sent to the graph, before the loss is fetched; ``progress`` counts the
    completed steps and holds the model, for a program that is interrupted. The data is that
    of ``STEPS`` steps whatever ``steps`` is, so a shorter run sees the same batches."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(max(steps, STEPS) * 16, 20, 5)
    model, optimizer, loss_fn = mlp(20, (16,), 5), tf.keras.optimizers.Adam(1e-2), sparse_xent()
    big = tf.Variable(tf.random.normal((1024, 1024), stddev=0.03), trainable=False)
    progress = {} if progress is None else progress
    progress.update(completed=0, model=model, optimizer=optimizer)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            h = big
            for _ in range(8):
                h = tf.matmul(h, big)
            loss = loss_fn(y, model(x, training=True)) + 0.0 * tf.reduce_mean(h)
            if fault is not None:
                fault(step)
            losses.append(float(loss))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        progress["completed"] = step + 1
    return {"losses": losses, **state(model, optimizer)}


# ------------------------------------------------------------------------------ child scenarios


def _interrupt_when(ready, note=None):
    """SIGINT to this process (what Ctrl-C does) from another thread as soon as ``ready()``
    holds (polled); after ``WAIT`` seconds without it, it is sent anyway and the test's check
    of the moment fails. ``note`` runs in that thread just before, to observe what the
    runners are doing then."""

    def fire():
        deadline = time.monotonic() + WAIT
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.0005)
        if note is not None:
            note()
        os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=fire, name="interrupter", daemon=True)
    thread.start()
    return thread


def _iteration_job():
    """The graph job of the iteration being co-executed, or None."""
    runtime = terra.runtime.current()
    runner = runtime.runner if runtime is not None else None
    return runner.it.job if runner is not None and runner.it is not None else None


def _graph_started():
    """Whether the co-executed iteration's graph job has entered TF's call (or ended)."""
    job = _iteration_job()
    return job is not None and job.entered.is_set()


def _main_thread_waits():
    """Whether the main thread is blocked in the PythonRunner's wait for a fetch."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "_wait":
            return True
        frame = frame.f_back
    return False


def _job_running(seen):
    """Whether the graph job of the co-executed iteration is still running (read at the
    moment the interrupt is sent)."""
    job = _iteration_job()
    seen["graph_running"] = job is not None and not job.done.is_set()


def _interrupted_run(fault, prepare=None):
    """Run ``slow_loop`` under Terra with ``fault``; the program catches KeyboardInterrupt. Then
    check what is left and run the next loop. Returns the facts for the parent to judge."""
    seen, progress = {}, {}
    if prepare is not None:
        prepare(seen)
    began = time.monotonic()
    try:
        slow_loop(terra.TerraGradientTape, STEPS, fault, progress)
        seen["caught"] = False
    except KeyboardInterrupt as interrupt:
        seen["caught"] = True
        seen["frames"] = [frame.name for frame in traceback.extract_tb(interrupt.__traceback__)]
    seen["seconds_to_catch"] = time.monotonic() - began
    seen["completed"] = progress["completed"]
    seen["at_catch"] = state(progress["model"], progress["optimizer"])
    seen["tape_stack_empty"] = bool(pywrap_tfe.TFE_Py_TapeSetIsEmpty())
    seen.update(_left_behind())
    # the variables at the catch are eager's after the steps that completed
    reference = slow_loop(tf.GradientTape, seen["completed"])
    seen["eager_after_completed"] = {key: reference[key] for key in seen["at_catch"]}
    # the next loop under Terra co-executes and gives eager's numbers (raises here otherwise)
    outcome = assert_same_as_eager(mlp_loop, 12)
    seen["next_coexecuted"] = outcome.stats.coexecuted
    return seen


def _left_behind():
    """``terra.reset()``'s duration and the threads still alive after it: each is waited for
    (at most ``WAIT`` seconds in all), so only one that does not end is left."""
    began = time.monotonic()
    terra.reset()
    facts = {"reset_seconds": time.monotonic() - began}
    deadline = time.monotonic() + WAIT
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    facts["threads"] = [t.name for t in others]
    facts["non_daemon_threads"] = [t.name for t in others if not t.daemon]
    return facts


def child_interrupt_fetch():
    """Ctrl-C while Python waits for the loss the graph has not computed yet."""
    seen = {}

    def fault(step):
        if step == FAULT_STEP:
            seen["phase_at_fault"] = terra.stats().phase
            _interrupt_when(_main_thread_waits, lambda: _job_running(seen))

    return {**_interrupted_run(fault), **seen}


def child_interrupt_graph_running():
    """Ctrl-C while the graph runs and Python is busy in its own code (not waiting): sent
    once the graph is seen in its call; Python's work goes on until the interrupt ends it."""
    seen = {}

    def fault(step):
        if step == FAULT_STEP:
            seen["phase_at_fault"] = terra.stats().phase
            _interrupt_when(_graph_started, lambda: _job_running(seen))
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline:  # the user's Python work, e.g. logging
                pass

    return {**_interrupted_run(fault), **seen}


def child_interrupt_generation_raises():
    """Graph generation raises KeyboardInterrupt (Ctrl-C inside Terra's builder)."""
    original = terra.lifecycle.generate

    def interrupted(*args, **kwargs):
        terra.lifecycle.generate = original
        raise KeyboardInterrupt

    def prepare(seen):
        terra.lifecycle.generate = interrupted

    seen = _interrupted_run(None, prepare)
    seen["phase_at_fault"] = "generation"
    return seen


def child_interrupt_during_generation():
    """A real SIGINT that arrives while the graph is being generated: sent to the process
    from inside generation (its first pass), so it arrives there whatever the machine's
    speed; Python raises it in the main thread at its next instruction."""
    original = graph_builder.plan_steps

    def interrupted_pass(*args, **kwargs):
        graph_builder.plan_steps = original
        seen_by_pass["generating"] = True
        os.kill(os.getpid(), signal.SIGINT)
        return original(*args, **kwargs)

    seen_by_pass = {}

    def prepare(seen):
        graph_builder.plan_steps = interrupted_pass
        seen_by_pass.clear()
        seen["generating"] = seen_by_pass  # filled if generation began

    seen = _interrupted_run(None, prepare)
    seen["phase_at_fault"] = "generation"
    return seen


def _stall_graph(until):
    """Make the GraphRunner hold the second co-executed iteration's job back until
    ``until(job)`` returns, as a graph that hangs would."""
    original = graph_runner.GraphRunner._run
    jobs = [0]

    def stalled(self, job, ctx):
        jobs[0] += 1
        if jobs[0] == 2:
            until(job)
        return original(self, job, ctx)

    graph_runner.GraphRunner._run = stalled


def _given_up(job):
    """Until Terra gave ``job`` up (the fetch timed out and the iteration fell back)."""
    deadline = time.monotonic() + WAIT
    while not job.cancelled and time.monotonic() < deadline:
        time.sleep(0.01)


def child_timeout_graph_late():
    """The graph runs only once the fetch waiting for it timed out and Terra gave its job
    up: Terra falls back, puts back what the late graph writes, and the run ends with
    eager's numbers; ``explain()`` names the line."""
    _stall_graph(_given_up)
    began = time.monotonic()
    results = slow_loop(terra.TerraGradientTape, STEPS)
    facts = {"seconds": time.monotonic() - began, "explain": terra.explain(),
             "fallbacks": terra.stats().fallbacks, "terra": results}
    terra.reset()
    facts["eager"] = slow_loop(tf.GradientTape, STEPS)
    return facts


def child_timeout_graph_hung():
    """The graph never answers: the program gets a TimeoutError within a bounded time."""
    _stall_graph(lambda job: threading.Event().wait())
    began = time.monotonic()
    try:
        slow_loop(terra.TerraGradientTape, STEPS)
        facts = {"raised": None}
    except Exception as error:  # noqa: BLE001 - which exception it is, is what is checked
        facts = {"raised": type(error).__name__, "message": str(error),
                 "is_timeout": isinstance(error, TimeoutError)}
    facts["seconds"] = time.monotonic() - began
    began = time.monotonic()
    try:
        terra.reset()
        facts["reset_raised"] = None
    except Exception as error:  # noqa: BLE001
        facts["reset_raised"] = f"{type(error).__name__}: {error}"
    facts["reset_seconds"] = time.monotonic() - began
    return facts


CHILDREN = {
    "interrupt_fetch": child_interrupt_fetch,
    "interrupt_graph_running": child_interrupt_graph_running,
    "interrupt_generation_raises": child_interrupt_generation_raises,
    "interrupt_during_generation": child_interrupt_during_generation,
    "timeout_graph_late": child_timeout_graph_late,
    "timeout_graph_hung": child_timeout_graph_hung,
}


def _child_main(scenario, out):
    # A child of a shell's background job (``pytest ... &`` in a script) inherits SIGINT
    # ignored, and Python then leaves it ignored: the scenarios' SIGINT would never become a
    # KeyboardInterrupt. A user's Ctrl-C reaches Python's own handler, as here.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import differential

    facts = differential._to_python(CHILDREN[scenario]())
    facts["finished_at"] = time.time()
    Path(out).write_text(json.dumps(differential._encode(facts), allow_nan=True))


def run_child(scenario, tmp_path, **env):
    """Run ``scenario`` in a child Python; return its facts and the seconds from its last
    statement to the end of the process."""
    tests = Path(__file__).resolve().parent
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests)])
    out = tmp_path / f"{scenario}.json"
    try:
        done = subprocess.run([sys.executable, __file__, scenario, str(out)], env=child_env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{scenario} hung for {CHILD_TIMEOUT}s:\n{_tail(hung.stderr)}")
    exited = time.time()
    if done.returncode != 0 or not out.exists():
        pytest.fail(f"{scenario} failed (exit {done.returncode}):\n{_tail(done.stdout)}\n"
                    f"{_tail(done.stderr)}")
    import differential

    facts = json.loads(out.read_text(), object_hook=differential._decode)
    return facts, exited - facts["finished_at"]


def _tail(text, size=6000):
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-size:]


# ------------------------------------------------------------------------------ KeyboardInterrupt


def assert_numbers_equal(terra_values, eager_values, what):
    """Nested dicts/lists of arrays from a child: Terra's equal eager's (float tolerance)."""
    if isinstance(eager_values, dict):
        assert sorted(terra_values) == sorted(eager_values), what
        for key in eager_values:
            assert_numbers_equal(terra_values[key], eager_values[key], f"{what}[{key!r}]")
    elif isinstance(eager_values, list) and not np.isscalar(eager_values[0]):
        assert len(terra_values) == len(eager_values), what
        for index, (left, right) in enumerate(zip(terra_values, eager_values, strict=True)):
            assert_numbers_equal(left, right, f"{what}[{index}]")
    else:
        np.testing.assert_allclose(terra_values, eager_values, rtol=1e-5, atol=1e-6,
                                   err_msg=what)


def assert_clean_after_interrupt(facts, exit_seconds):
    """What every interrupt must leave: the program caught it, the variables are eager's after
    the steps that completed, no real tape records, ``terra.reset()`` returns at once, no thread
    of Terra's survives it, the process exits promptly and the next loop co-executes with
    eager's numbers (checked in the child by ``assert_same_as_eager``)."""
    context = {key: value for key, value in facts.items()
               if key not in ("at_catch", "eager_after_completed")}
    assert facts["caught"], f"the KeyboardInterrupt never reached the program: {context}"
    assert_numbers_equal(facts["at_catch"], facts["eager_after_completed"],
                         f"the variables at the catch, {context}")
    assert facts["tape_stack_empty"], f"a real GradientTape was left recording: {context}"
    # a reset that waited for the interrupted job would take TERRA_TIMEOUT (120 s)
    assert facts["reset_seconds"] < 60.0, f"terra.reset() took long: {context}"
    assert facts["threads"] == [], f"threads left after terra.reset(): {context}"
    assert facts["next_coexecuted"] >= 1, context
    # a thread left running keeps the process alive until the child's timeout
    assert exit_seconds < 120.0, f"the process took {exit_seconds:.1f}s to exit: {context}"


def test_interrupt_while_python_waits_for_a_fetch(tmp_path):
    """Ctrl-C lands while ``float(loss)`` blocks on the graph (the traceback passes through
    the PythonRunner's wait). Fails if the interrupt is swallowed or turned into another
    exception, if the variables at the catch differ from eager's after the completed steps, if
    the GraphRunner keeps running the job or a thread outlives ``terra.reset()``, or if the next
    loop does not co-execute with eager's numbers."""
    facts, exit_seconds = run_child("interrupt_fetch", tmp_path)
    assert facts["phase_at_fault"] == "coexecution", facts["phase_at_fault"]
    assert facts["graph_running"], "the graph had finished before the interrupt: too fast"
    assert "_wait" in facts.get("frames", []), f"not interrupted in a fetch: {facts}"
    assert_clean_after_interrupt(facts, exit_seconds)


def test_interrupt_while_the_graph_runs_and_python_does_not_wait(tmp_path):
    """Ctrl-C lands in the user's own Python work while the graph computes the iteration.
    Fails like the fetch case; in addition the graph must have been running then."""
    facts, exit_seconds = run_child("interrupt_graph_running", tmp_path)
    assert facts["phase_at_fault"] == "coexecution", facts["phase_at_fault"]
    assert facts["graph_running"], "the graph had finished before the interrupt: too fast"
    assert "_wait" not in facts.get("frames", []), f"Python was waiting: {facts}"
    assert_clean_after_interrupt(facts, exit_seconds)


@pytest.mark.parametrize("scenario", ["interrupt_generation_raises",
                                      "interrupt_during_generation"])
def test_interrupt_during_graph_generation(scenario, tmp_path):
    """KeyboardInterrupt out of graph generation (raised by the builder, or a SIGINT that
    arrives while it runs) reaches the program at the tape's ``with``. Fails if Terra swallows
    it (generation's failures become eager execution, but an interrupt is the user's), if a
    half-built state breaks the variables or the next loop, or if a thread is left."""
    facts, exit_seconds = run_child(scenario, tmp_path)
    assert "generate" in facts.get("frames", []), f"not interrupted in generation: {facts}"
    assert_clean_after_interrupt(facts, exit_seconds)



# ------------------------------------------------------------------------------ timeouts


def slow_loop_lines():
    """``file:line`` of the loss line (the op a fetch waits for) and of the fetch itself."""
    lines, first = inspect.getsourcelines(slow_loop)
    name = os.path.basename(__file__)
    return [f"{name}:{first + i}" for i, line in enumerate(lines)
            if "loss = loss_fn(" in line or "float(loss)" in line]


def test_graph_late_beyond_the_timeout_falls_back_naming_the_line(tmp_path):
    """``TERRA_TIMEOUT=10`` and a GraphRunner that starts a job only once Terra gave it up:
    the fetch times out, Terra's fallback (``explain()``) names the user's line, the run
    finishes with eager's numbers. The timeout also bounds the wait for the late job to stop,
    which runs its whole graph then: ten seconds leave a busy machine room for it. Fails on a
    hang, on an exception reaching the program, on an ``explain()`` entry without the line,
    or on numbers other than eager's."""
    facts, _ = run_child("timeout_graph_late", tmp_path, TERRA_TIMEOUT="10")
    entries = [line for line in facts["explain"].splitlines() if "TimeoutError" in line]
    assert entries and any(where in entries[0] for where in slow_loop_lines()), facts["explain"]
    assert facts["fallbacks"] >= 1, facts["explain"]
    assert facts["seconds"] < 120, facts["seconds"]
    assert_numbers_equal(facts["terra"], facts["eager"], "the run after the timeout")


def test_graph_hung_raises_timeout_naming_the_line(tmp_path):
    """``TERRA_TIMEOUT=2`` and a GraphRunner that never runs the job: the program gets a
    TimeoutError naming its own line within a few timeouts. Fails on a hang (the child's
    timeout), on no error or another type, or on a message that names no line of the loop."""
    facts, _ = run_child("timeout_graph_hung", tmp_path, TERRA_TIMEOUT="2")
    assert facts["raised"] is not None and facts["is_timeout"], facts
    assert facts["seconds"] < 60, facts
    assert any(where in facts["message"] for where in slow_loop_lines()), facts



def test_reset_after_a_hung_graph_returns_promptly(tmp_path):
    """After the TimeoutError, ``terra.reset()`` must drop the runtime (the hung job runs in a
    daemon thread and is abandoned) rather than wait for it again and raise. Fails if reset
    raises, or takes as long as waiting on a job that never ends would."""
    facts, _ = run_child("timeout_graph_hung", tmp_path, TERRA_TIMEOUT="2")
    assert facts["reset_raised"] is None, facts
    assert facts["reset_seconds"] < 30, facts


# ---------------------------------------------------------------------- data and user errors

FAULT_INDEX = 99  # out of range of the 5 class weights
GATHER_CALL = "weights = tf.gather("  # the failing line of gather_from_batch


def gather_from_batch(tape_cls, steps):
    """Per-example class weights looked up with indices that come with the numpy batch; one
    index of step ``FAULT_STEP`` is out of range, so the gather fails inside the graph. The
    program catches the error and records its type, whether it names the gather's line, and
    every variable at that point, then trains on."""
    data, model, optimizer, _ = mlp_task(steps)
    indices = (np.arange(steps * 16) % 5).astype(np.int32)
    indices[FAULT_STEP * 16 + 3] = FAULT_INDEX
    class_weights = tf.constant([1.0, 0.5, 2.0, 1.5, 0.75])
    losses, caught = [], []
    for step in range(steps):
        record_stats(f"step{step}")
        x, y, index = batch((*data, indices), step, 16)
        try:
            with tape_cls() as tape:
                logits = model(x, training=True)
                weights = tf.gather(class_weights, index)
                loss = tf.reduce_mean(weights * tf.keras.losses.sparse_categorical_crossentropy(
                    y, logits, from_logits=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(float(loss))
        except InvalidArgumentError as error:
            caught.append({"step": step, "type": type(error).__name__,
                           "names_line": _names_line(error, gather_from_batch, GATHER_CALL),
                           **state(model, optimizer)})
    return {"losses": losses, "caught": caught, **state(model, optimizer)}


def _names_line(error, function, call):
    """Whether ``error``'s message or traceback names the line of ``function`` with ``call``."""
    lines, first = inspect.getsourcelines(function)
    [line] = [first + i for i, text in enumerate(lines) if call in text]
    path = os.path.abspath(inspect.getsourcefile(function))
    frames = [(os.path.abspath(f.filename), f.lineno)
              for f in traceback.extract_tb(error.__traceback__)]
    return f"{os.path.basename(path)}:{line}" in str(error) or (path, line) in frames


def test_out_of_range_index_from_the_batch_raises_like_eager(tmp_path):
    """A data-dependent InvalidArgumentError in the graph (an index fed from the numpy batch)
    while co-executing: the program catches the same exception type as eager, naming the
    gather's line, with eager's variables at that point, and training goes on with eager's
    numbers. Fails if Terra raises another type (or nothing), names no line, leaves the graph's
    partial updates in the variables, or stops co-executing for good."""
    outcome = assert_same_as_eager(gather_from_batch, 12, expect_fallbacks=(1, 2), max_traces=4,
                                   env={})
    [caught] = outcome.terra["caught"]
    assert caught["step"] == FAULT_STEP and caught["names_line"], caught
    assert outcome.stats_at(f"step{FAULT_STEP}").phase == "coexecution", outcome.report()
    assert outcome.stats.coexecuted > outcome.stats_at(f"step{FAULT_STEP + 1}").coexecuted, (
        f"co-execution did not resume\n{outcome.report()}")


class BadRecord(ValueError):
    """The user's own error."""


def user_error(where):
    """Raise ``BadRecord`` at ``FAULT_STEP``, ``where`` in the iteration: between the two
    layers of the forward pass (inside the tape) or between the gradient and the update
    (outside it, while the graph may already have applied the update). The program catches it,
    records every variable, and trains on."""

    def program(tape_cls, steps):
        data, model, optimizer, loss_fn = mlp_task(steps)
        hidden, head = model.layers
        losses, caught = [], []
        for step in range(steps):
            record_stats(f"step{step}")
            x, y = batch(data, step, 16)
            try:
                with tape_cls() as tape:
                    h = hidden(x, training=True)
                    if step == FAULT_STEP and where == "mid_forward":
                        raise BadRecord(f"bad record at step {step}")
                    loss = loss_fn(y, head(h, training=True))
                grads = tape.gradient(loss, model.trainable_variables)
                if step == FAULT_STEP and where == "before_update":
                    raise BadRecord(f"gradient check failed at step {step}")
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                losses.append(float(loss))
            except BadRecord as error:
                caught.append({"message": str(error), **state(model, optimizer)})
        return {"losses": losses, "caught": caught, **state(model, optimizer)}

    return program


def user_error_mid_forward(tape_cls, steps):
    return user_error("mid_forward")(tape_cls, steps)


def user_error_before_update(tape_cls, steps):
    return user_error("before_update")(tape_cls, steps)


@pytest.mark.parametrize("program", [user_error_mid_forward, user_error_before_update])
def test_user_exception_while_coexecuting_keeps_eager_variables(program):
    """The user's ValueError while co-executing: the variables read right after the catch and
    at the end equal eager's. Fails if the graph's work of the abandoned iteration (its update,
    run ahead of Python) stays in the variables, or if the exception is lost or changed."""
    outcome = assert_same_as_eager(program, 12, expect_fallbacks=(1, 2), max_traces=4, env={})
    assert len(outcome.terra["caught"]) == 1, outcome.report()
    assert outcome.stats_at(f"step{FAULT_STEP}").phase == "coexecution", outcome.report()


if __name__ == "__main__":
    _child_main(*sys.argv[1:])
