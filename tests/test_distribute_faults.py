"""Faults under ``tf.distribute``: Ctrl-C and the user's exception while a ``MirroredStrategy``
loop co-executes, and a worker of a ``MultiWorkerMirroredStrategy`` killed mid-step.

As in ``test_faults.py``, a fault that may leave process state behind runs in a child Python
(``python tests/test_distribute_faults.py <scenario> <out.json>``) under a timeout, so a hang
fails the test instead of stalling the suite; a fault is delivered when the moment it needs
is seen (a replica thread waiting for the graph), never after a fixed delay, and every wait
for such a moment is bounded (``WAIT``). Numbers are compared bit for bit with the same
program run eagerly.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import tensorflow as tf
from differential import _compare_value, _decode, assert_same_as_eager, record_stats
from distribute_worker import GLOBAL_BATCH, two_cpus
from tensorflow.python import pywrap_tfe
from test_faults import CHILD_TIMEOUT, WAIT, _left_behind, _tail
from tiny_models import classification_data, mlp, state

import terra

STEPS, FAULT_STEP = 10, 5  # warm-up 1 + traces + generation: FAULT_STEP is co-executed
TESTS = Path(__file__).resolve().parent
BUILD_AT_ONCE = {"TERRA_MIN_SAVING": "-inf", "TERRA_BUDGET": "1e9", "TERRA_TIMEOUT": "60"}
EVERY_VALUE = ("losses", "model", "optimizer0", "replicas")
USER_FAULT_STEP = 8  # after the first co-executed iteration's fallback (a new fetch point)


# ------------------------------------------------------------------------------ the programs


def slow_mirrored(tape_cls, steps, fault=None, progress=None):
    """The custom-loop recipe under ``MirroredStrategy`` on two logical CPUs, each replica's
    step next to a chain of large matmuls (tenths of a second, longer in the second replica,
    so that it still waits when the first replica's turn is over) whose result joins its loss, and
    reading its loss in Python (``float``): a replica waits for the graph in its turn.
    ``fault(step, replica)`` runs at the start of the replica's step; ``progress`` counts
    the completed steps and holds the model, for a program that is interrupted."""
    two_cpus()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = mlp(20, (16,), 5)
        optimizer = tf.keras.optimizers.Adam(1e-2)
    big = tf.constant(tf.random.normal((768, 768), stddev=0.03))
    data = classification_data(max(steps, STEPS) * GLOBAL_BATCH, 20, 5)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH).take(steps)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    progress = {} if progress is None else progress
    progress.update(completed=0, model=model, optimizer=optimizer)
    losses = []

    def step_fn(x, y):
        replica = tf.distribute.get_replica_context()._replica_id_in_sync_group  # an int
        if fault is not None:
            fault(len(losses), replica)
        with tape_cls() as tape:
            h = big
            for _ in range(4 + 12 * replica):  # the second replica's graph is the slower
                h = tf.matmul(h, big)
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            loss += 0.0 * tf.reduce_mean(h)
        float(loss)  # the replica waits for the graph here
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    for x, y in strategy.experimental_distribute_dataset(dataset):
        per_replica = strategy.run(step_fn, args=(x, y))
        losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
        progress["completed"] = len(losses)
    copies = [list(strategy.experimental_local_results(v)) for v in model.variables]
    return {"losses": losses, **state(model, optimizer), "replicas": copies}


class BadRecord(ValueError):
    """The user's own error."""


def mirrored_user_error(where):
    """The custom-loop recipe under ``MirroredStrategy`` on two logical CPUs; in step
    ``USER_FAULT_STEP`` the second replica raises ``BadRecord``, ``where`` in its step: in the
    forward pass inside the tape (while the first replica waits in its ``merge_call``), or
    after its update (both replicas' updates applied). The program catches it at its
    ``strategy.run`` line, records the exception and every variable (each replica's copy),
    and trains on."""

    def program(tape_cls, steps):
        two_cpus()
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        tf.keras.utils.set_random_seed(0)
        with strategy.scope():
            model = mlp(20, (16,), 5)
            optimizer = tf.keras.optimizers.Adam(1e-2)
        hidden, head = model.layers
        data = classification_data(steps * GLOBAL_BATCH, 20, 5)
        dataset = tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH)
        loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                reduction="none")
        losses, caught = [], []

        def step_fn(x, y):
            replica = tf.distribute.get_replica_context()._replica_id_in_sync_group
            fails = len(losses) + len(caught) == USER_FAULT_STEP and replica == 1
            with tape_cls() as tape:
                h = hidden(x, training=True)
                if fails and where == "mid_forward":
                    raise BadRecord(f"bad record in replica {replica}")
                per_example = loss_fn(y, head(h, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            if fails and where == "after_update":
                raise BadRecord(f"loss check failed in replica {replica}")
            return loss

        def every_copy():
            return [list(strategy.experimental_local_results(v)) for v in model.variables]

        for x, y in strategy.experimental_distribute_dataset(dataset):
            record_stats(f"step{len(losses) + len(caught)}")
            try:
                per_replica = strategy.run(step_fn, args=(x, y))
            except BadRecord as error:
                caught.append({"type": type(error).__name__, "message": str(error),
                               **state(model, optimizer), "replicas": every_copy()})
                continue
            losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
        return {"losses": losses, "caught": caught, **state(model, optimizer),
                "replicas": every_copy()}

    return program


def mirrored_user_error_mid_forward(tape_cls, steps):
    return mirrored_user_error("mid_forward")(tape_cls, steps)


def mirrored_user_error_after_update(tape_cls, steps):
    return mirrored_user_error("after_update")(tape_cls, steps)


# ------------------------------------------------------------------------------ child scenarios


def _frames(thread_ident):
    """The names of the functions on ``thread_ident``'s stack, innermost first."""
    frame, names = sys._current_frames().get(thread_ident), []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names


def _replica_waits_for_the_graph(replica):
    """Whether ``replica``'s thread is blocked in the PythonRunner's wait for a fetch while
    the main thread waits in ``strategy.run`` for its turn."""
    return "_wait" in _frames(replica.ident) and \
        "_call_for_each_replica" in _frames(threading.main_thread().ident)


def child_interrupt_mirrored(which):
    """Ctrl-C while replica ``which`` waits for the graph (its ``float``) and the loop's
    thread waits in ``strategy.run``, in the first co-executed step from ``FAULT_STEP`` on
    where it does (a step that falls back runs eagerly, without such a wait). The program
    catches KeyboardInterrupt; then what is left is checked, and the loop runs again, eagerly
    and under Terra."""
    seen, progress, armed = {}, {}, threading.Event()

    def fault(step, replica):
        if step < FAULT_STEP or replica != which or armed.is_set():
            return
        armed.set()
        me, deadline = threading.current_thread(), time.monotonic() + WAIT

        def fire():
            while me.is_alive() and time.monotonic() < deadline:
                if _replica_waits_for_the_graph(me):
                    seen.update(phase_at_fault=terra.stats().phase, step_at_send=step)
                    os.kill(os.getpid(), signal.SIGINT)
                    return
                time.sleep(0.0005)
            armed.clear()  # the step ended without such a wait: the next one is watched

        threading.Thread(target=fire, name="interrupter", daemon=True).start()

    began = time.monotonic()
    try:
        slow_mirrored(terra.TerraGradientTape, STEPS, fault, progress)
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
    reference = slow_mirrored(tf.GradientTape, seen["completed"])
    seen["eager_after_completed"] = {key: reference[key] for key in seen["at_catch"]}
    # a run started afterwards co-executes and gives eager's numbers
    seen["next_eager"] = slow_mirrored(tf.GradientTape, STEPS)
    terra.reset()
    terra.configure(timeout=60.0)
    seen["next_terra"] = slow_mirrored(terra.TerraGradientTape, STEPS)
    seen["next_coexecuted"] = terra.stats().coexecuted
    seen["next_explain"] = terra.explain()
    return seen


def mwms_worker():
    """A worker of a ``MultiWorkerMirroredStrategy`` cluster (``TF_CONFIG``) training the
    custom-loop recipe under ``terra.enable()``, printing ``step N`` after each step; the
    exception that ends it, if any, is its last line (JSON), and it exits with status 3.
    ``STALL_AFTER`` (environment): after that step the worker stops in Python (its process,
    heartbeats and all, lives on), until it is killed. ``COLLECTIVE_TIMEOUT``: the strategy's
    ``CommunicationOptions(timeout_seconds=...)``."""
    terra.enable()
    timeout = os.environ.get("COLLECTIVE_TIMEOUT")
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            timeout_seconds=float(timeout)) if timeout else None)
    stall_after = int(os.environ.get("STALL_AFTER", 0))
    steps = 10 ** 4  # more than the test waits for: a survivor trains until its peer is lost
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = mlp(20, (16,), 5)
        optimizer = tf.keras.optimizers.Adam(1e-2)
    data = classification_data(64 * GLOBAL_BATCH, 20, 5)
    dataset = tf.data.Dataset.from_tensor_slices(data).repeat().batch(GLOBAL_BATCH).take(steps)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    began = None
    try:
        for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(dataset)):
            float(strategy.reduce("SUM", strategy.run(step_fn, args=(x, y)), axis=None))
            print(f"step {step + 1}", flush=True)
            began = time.monotonic()
            if step + 1 == stall_after:
                threading.Event().wait(CHILD_TIMEOUT)  # the test kills it before
    except Exception as error:  # noqa: BLE001 - the type and message are what is checked
        print(json.dumps({"type": type(error).__name__, "message": str(error),
                          "seconds_since_last_step": time.monotonic() - began,
                          "plain_tapes": terra.stats().plain_tapes}), flush=True)
        sys.exit(3)


CHILDREN = {"interrupt_replica0": lambda: child_interrupt_mirrored(0),
            "interrupt_replica1": lambda: child_interrupt_mirrored(1)}


def _child_main(scenario, out=None):
    # a child of a background shell job inherits SIGINT ignored (see test_faults.py)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import differential

    if scenario == "mwms_worker":
        mwms_worker()
        return
    for name, value in BUILD_AT_ONCE.items():
        os.environ.setdefault(name, value)
    facts = differential._to_python(CHILDREN[scenario]())
    facts["finished_at"] = time.time()
    Path(out).write_text(json.dumps(differential._encode(facts), allow_nan=True))


def run_child(scenario, tmp_path):
    """Run ``scenario`` in a child Python; return its facts and the seconds from its last
    statement to the end of the process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
               TF_CPP_MIN_LOG_LEVEL="3", **BUILD_AT_ONCE)
    out = tmp_path / f"{scenario}.json"
    try:
        done = subprocess.run([sys.executable, __file__, scenario, str(out)], env=env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{scenario} hung for {CHILD_TIMEOUT}s:\n{_tail(hung.stderr)}")
    exited = time.time()
    if done.returncode != 0 or not out.exists():
        pytest.fail(f"{scenario} failed (exit {done.returncode}):\n{_tail(done.stdout)}\n"
                    f"{_tail(done.stderr)}")
    facts = json.loads(out.read_text(), object_hook=_decode)
    return facts, exited - facts["finished_at"]


# ------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("scenario", ["interrupt_replica0", "interrupt_replica1"])
def test_interrupt_while_a_replica_waits_for_the_graph(scenario, tmp_path):
    """Ctrl-C while a replica's ``float(loss)`` waits for the graph and the loop's thread
    waits in ``strategy.run``: the program catches KeyboardInterrupt within a bounded time,
    with eager's variables after the steps that completed (every replica's copy), no real tape
    recording, no thread left after ``terra.reset()``, and the next run co-executes with
    eager's numbers, bit for bit."""
    facts, exit_seconds = run_child(scenario, tmp_path)
    context = {key: value for key, value in facts.items()
               if key not in ("at_catch", "eager_after_completed", "next_eager", "next_terra")}
    assert "step_at_send" in facts, f"no step had the replica wait for the graph: {context}"
    assert facts["phase_at_fault"] == "coexecution", context
    assert facts["caught"], f"the KeyboardInterrupt never reached the program: {context}"
    assert facts["seconds_to_catch"] < CHILD_TIMEOUT / 2, f"the run took long: {context}"
    assert facts["completed"] == facts["step_at_send"], f"another step was interrupted: {context}"
    _compare_value(facts["eager_after_completed"], facts["at_catch"], "at the catch", 0.0, 0.0)
    assert facts["tape_stack_empty"], f"a real GradientTape was left recording: {context}"
    assert facts["reset_seconds"] < 60.0, f"terra.reset() took long: {context}"
    assert facts["threads"] == [], f"threads left after terra.reset(): {context}"
    _compare_value(facts["next_eager"], facts["next_terra"], "the next run", 0.0, 0.0)
    assert facts["next_coexecuted"] >= 1, context
    assert exit_seconds < 120.0, f"the process took {exit_seconds:.1f}s to exit: {context}"


@pytest.mark.parametrize("program", [mirrored_user_error_mid_forward,
                                     mirrored_user_error_after_update])
def test_user_exception_in_a_replica_reaches_strategy_run_as_eagerly(program):
    """The second replica raises the user's ValueError in a co-executed step: the program
    catches it at its ``strategy.run`` line with eager's type and message, the variables (each
    replica's copy) read right after the catch and at the end are eager's bit for bit, and the
    loop co-executes again afterwards."""
    outcome = assert_same_as_eager(program, 14, env=BUILD_AT_ONCE, min_coexecuted=4,
                                   exact=(*EVERY_VALUE, "caught"), expect_fallbacks=(1, 4),
                                   max_traces=6)
    [caught] = outcome.terra["caught"]
    assert caught["type"] == "BadRecord", outcome.report()
    phases = [outcome.stats_at(f"step{step}").phase for step in range(14)]
    assert phases[USER_FAULT_STEP] == "coexecution", (phases, outcome.report())
    assert outcome.stats.coexecuted > outcome.stats_at(f"step{USER_FAULT_STEP + 1}").coexecuted, (
        f"co-execution did not resume\n{outcome.report()}")


KILL_AFTER = 5  # steps the workers train together before one is killed
LOST_WITHIN = 120  # seconds the survivor may take to report its lost peer


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _when_printed(process, text):
    """An event set once ``process`` prints the line ``text`` (read in a daemon thread, which
    drains the rest of its output)."""
    seen = threading.Event()

    def read():
        for line in process.stdout:
            if line.strip() == text:
                seen.set()

    threading.Thread(target=read, name="reader", daemon=True).start()
    return seen


def _cluster(extra_env):
    """Two workers on the loopback address, each running ``mwms_worker`` (``extra_env``:
    worker index -> its extra environment)."""
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
               TF_CPP_MIN_LOG_LEVEL="3")
    return [subprocess.Popen(
        [sys.executable, __file__, "mwms_worker"], text=True, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=dict(env, **extra_env.get(i, {}), TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": "worker", "index": i}})))
        for i in range(2)]


def _survivor_fails(workers, victim, kill):
    """Once worker ``victim`` reports step ``KILL_AFTER``, SIGKILL it if ``kill``; return the
    other worker's exception (its last line) and the seconds from then to its exit. Fails the
    test if the survivor does not exit within ``LOST_WITHIN`` seconds."""
    try:
        survivor = workers[1 - victim]
        reached = _when_printed(workers[victim], f"step {KILL_AFTER}")
        assert reached.wait(CHILD_TIMEOUT), f"worker {victim} never reached step {KILL_AFTER}"
        if kill:
            workers[victim].send_signal(signal.SIGKILL)
        since = time.monotonic()
        try:
            out, _ = survivor.communicate(timeout=LOST_WITHIN)
        except subprocess.TimeoutExpired:
            pytest.fail(f"worker {1 - victim} still ran {LOST_WITHIN}s after its peer stopped")
        seconds = time.monotonic() - since
    finally:
        for w in workers:
            w.kill()
            w.wait(timeout=CHILD_TIMEOUT)
    assert survivor.returncode == 3, out[-3000:]
    return json.loads(out.strip().splitlines()[-1]), seconds


@pytest.mark.parametrize("victim", [1, 0])
def test_worker_killed_mid_training_fails_the_survivor_naming_it(victim):
    """Two workers of a ``MultiWorkerMirroredStrategy`` on the loopback address train under
    ``terra.enable()``; once worker ``victim`` reports step ``KILL_AFTER`` it is killed
    (SIGKILL), and the survivor, which goes on into the next step's collective all-reduce,
    must exit with TF's UnavailableError naming the lost task within ``LOST_WITHIN`` seconds:
    TF's coordination service stops waiting for a task whose heartbeats stop, and aborts the
    collectives (worker 0 holds the service; worker 1 loses it with worker 0). Fails on a
    hang, on a survivor that ends without an error, or on an error that names no peer."""
    error, seconds = _survivor_fails(_cluster({}), victim, kill=True)
    assert error["type"] == "UnavailableError", error
    assert f"/job:worker/task:{victim}" in error["message"] or \
        f"/job:worker/replica:0/task:{victim}" in error["message"], error
    assert seconds < LOST_WITHIN, (seconds, error)
    assert error["plain_tapes"] >= KILL_AFTER, error  # Terra left the tapes plain


def test_worker_stalled_mid_training_times_out_with_the_collective_timeout():
    """Worker 1 stops in Python after step ``KILL_AFTER`` while its process lives (its
    heartbeats go on, so the coordination service sees nothing wrong): the survivor's next
    collective all-reduce would wait for it for ever. With
    ``CommunicationOptions(timeout_seconds=10)`` given to the strategy (under
    ``terra.enable()``, whose plain tapes leave TF's collectives and their options as they
    are) it raises DeadlineExceededError within ``LOST_WITHIN`` seconds."""
    stalled = {"STALL_AFTER": str(KILL_AFTER)}
    error, seconds = _survivor_fails(
        _cluster({0: {"COLLECTIVE_TIMEOUT": "10"}, 1: stalled}), 1, kill=False)
    assert error["type"] == "DeadlineExceededError", error
    assert "Collective has timed out" in error["message"], error
    assert seconds < LOST_WITHIN, (seconds, error)


if __name__ == "__main__":
    _child_main(*sys.argv[1:])
