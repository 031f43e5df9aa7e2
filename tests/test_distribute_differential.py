"""Custom training loops under ``tf.distribute`` strategies: eager's numbers, every step's loss
and every variable (each replica's copy too), and ``terra.stats()`` saying what ran how.

- The default strategy's and ``OneDeviceStrategy``'s ``run`` call the step on the loop's
  thread: Terra co-executes them.
- ``MirroredStrategy`` over two logical CPUs runs each replica's step in a thread of its own,
  the replicas taking turns with the loop's thread: Terra follows the turns and co-executes
  the loop (``terra.replicas``), with Python in the step too.
- ``MultiWorkerMirroredStrategy`` with two worker processes on the loopback address: its
  tapes act as plain tapes, ``explain()`` says why, and the loop runs eagerly.

The programs are in ``distribute_worker.py`` (see there why they run in child processes).
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import tensorflow as tf
from differential import _compare_value, _decode, assert_same_as_eager
from distribute_worker import (
    distributed_loop,
    mirrored,
    mirrored_apply_in_tape,
    mirrored_fit,
    mirrored_new_path,
    mirrored_python_in_step,
    mirrored_reduce_in_backward,
    mirrored_synchronized_bn,
    one_device,
)

STEPS = 16
TESTS = Path(__file__).resolve().parent
# Terra builds its graph as soon as a trace is covered, whatever the cost ledger predicts: a
# tape Terra could not serve would then co-execute, and show in the numbers (with the
# collective all-reduce left to TF's threads, the MirroredStrategy loop's 5th loss differs
# from eager's in the third digit: the skeleton reduced its stand-ins' dummy values).
# Waits between the runners time out after a minute: two processes share two busy CPUs.
EVERY_VALUE = ("losses", "model", "optimizer0", "replicas")  # compared bit for bit
BUILD_AT_ONCE = {"TERRA_MIN_SAVING": "-inf", "TERRA_BUDGET": "1e9", "TERRA_TIMEOUT": "60"}


def default_strategy(tape_cls, steps):
    return distributed_loop(tf.distribute.get_strategy(), tape_cls, steps)


def test_default_strategy_run_coexecutes():
    outcome = assert_same_as_eager(default_strategy, STEPS, env=BUILD_AT_ONCE, min_coexecuted=4,
                                   exact=EVERY_VALUE)
    assert outcome.stats.plain_tapes == 0, outcome.report()


def test_one_device_strategy_coexecutes():
    outcome = assert_same_as_eager(one_device, STEPS, env=BUILD_AT_ONCE, min_coexecuted=4,
                                   exact=EVERY_VALUE)
    assert outcome.stats.plain_tapes == 0, outcome.report()


def test_mirrored_strategy_coexecutes():
    """Each replica's step runs in a replica thread of its own, the replicas taking turns with
    the loop's thread; the graph holds every replica's ops, the collective all-reduce and the
    updates of every replica's copy. The dataset's end is one fallback: the graph draws the
    next batch ahead, and its ``OptionalGetValue`` finds the last optional empty."""
    outcome = assert_same_as_eager(mirrored, STEPS, env=BUILD_AT_ONCE, min_coexecuted=STEPS // 2,
                                   exact=EVERY_VALUE, expect_fallbacks=(1, 3), max_traces=4)
    assert outcome.stats.plain_tapes == 0, outcome.report()


def test_mirrored_strategy_with_python_in_the_step():
    """A replica reads its loss (``float``), prints it and branches on a per-example value:
    the reads wait for the graph in the replica's turn, and the numbers stay eager's."""
    outcome = assert_same_as_eager(mirrored_python_in_step, STEPS, env=BUILD_AT_ONCE,
                                   min_coexecuted=STEPS // 2, exact=(*EVERY_VALUE, "read"),
                                   expect_fallbacks=(1, 3), max_traces=4)
    assert len(outcome.terra["read"]) == 2 * STEPS, outcome.report()
    assert outcome.stats.plain_tapes == 0, outcome.report()


def test_mirrored_strategy_keras_fit_run_eagerly_coexecutes():
    """Keras' eager ``fit`` calls ``strategy.run`` itself: under ``terra.enable()`` its
    replicas' tapes are Terra's, and the epochs co-execute with eager's numbers."""
    outcome = assert_same_as_eager(mirrored_fit, STEPS, env=BUILD_AT_ONCE, min_coexecuted=STEPS,
                                   exact=("losses", "model", "replicas"),
                                   expect_fallbacks=(0, 3), max_traces=6)
    assert outcome.stats.plain_tapes == 0, outcome.report()


def test_mirrored_strategy_falls_back_in_a_replicas_turn():
    """From the middle of the run on, the second replica's loss gains a penalty: the
    iteration falls back in that replica's turn, its replay runs the first replica's ops (on
    their device) from the second's thread, and the new path co-executes once traced."""
    outcome = assert_same_as_eager(mirrored_new_path, 24, env=BUILD_AT_ONCE, min_coexecuted=8,
                                   exact=EVERY_VALUE, expect_fallbacks=(2, 5), max_traces=8)
    assert outcome.stats.plain_tapes == 0, outcome.report()
    assert "fallback [new op] at " in outcome.explain, outcome.report()


def test_mirrored_strategy_with_a_merge_call_in_the_backward_pass_runs_eagerly():
    """The logits' gradient is summed over the replicas in the backward pass: the gradient
    call lets the other replicas run in the middle of it, so its region cannot be one step
    of one replica's; Terra runs the loop eagerly and says why."""
    outcome = assert_same_as_eager(mirrored_reduce_in_backward, 8, env=BUILD_AT_ONCE,
                                   min_coexecuted=0, exact=EVERY_VALUE, max_traces=0)
    assert outcome.stats.phase == "eager", outcome.report()
    assert "running eagerly because a gradient call in a replica's step passed the turn to " \
        "another thread (a merge_call in its backward pass" in outcome.explain, outcome.report()


def test_mirrored_strategy_with_a_synchronized_batch_normalization_runs_eagerly():
    """A batch normalization synchronized across the replicas reduces in its forward pass,
    inside the tape's ``with`` block (and again in its gradient): eager, and says why."""
    outcome = assert_same_as_eager(mirrored_synchronized_bn, 8, env=BUILD_AT_ONCE,
                                   min_coexecuted=0, exact=EVERY_VALUE, max_traces=0)
    assert outcome.stats.phase == "eager", outcome.report()
    assert "running eagerly because a tape was open while a replica's step passed the turn" \
        in outcome.explain, outcome.report()


def test_mirrored_strategy_with_a_tape_open_across_the_update_runs_eagerly():
    """The optimizer's update inside the tape's ``with`` block: the tape is open while the
    other replicas run, and a replay could not re-enter it in its own thread; Terra runs the
    loop eagerly and says why."""
    outcome = assert_same_as_eager(mirrored_apply_in_tape, 8, env=BUILD_AT_ONCE,
                                   min_coexecuted=0, exact=EVERY_VALUE, max_traces=0)
    assert outcome.stats.phase == "eager", outcome.report()
    assert "running eagerly because a tape was open while a replica's step passed the turn" \
        in outcome.explain, outcome.report()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_multi_worker_mirrored_strategy_runs_eagerly_and_says_why():
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]),
               TF_CPP_MIN_LOG_LEVEL="3", **BUILD_AT_ONCE)
    workers = [subprocess.Popen(
        [sys.executable, str(TESTS / "distribute_worker.py"), str(STEPS)], text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=dict(env, TF_CONFIG=json.dumps({"cluster": cluster,
                                            "task": {"type": "worker", "index": i}})))
        for i in range(2)]
    try:
        done = [w.communicate(timeout=300) for w in workers]
    finally:
        for w in workers:
            w.kill()
    for w, (_, err) in zip(workers, done, strict=True):
        assert w.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1], object_hook=_decode) for out, _ in done]
    for index, result in enumerate(results):
        for run in ("eager", "terra"):  # eager's numbers under Terra, the same on both workers
            _compare_value(results[0]["eager"], result[run], f"worker {index}, {run}", 0.0, 0.0)
        s = result["stats"]
        assert (s["iterations"], s["coexecuted"], s["plain_tapes"]) == (0, 0, STEPS), result
        assert "a tape in a replica thread of tf.distribute.MultiWorkerMirroredStrategy.run" \
            in result["explain"], result["explain"]
