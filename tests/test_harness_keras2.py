"""``python -m benchmarks --keras 2``: the harness runs its programs on tf_keras, and Terra's
losses equal eager's there too.

Runs go through the harness's own worker processes and loss comparison, on two small programs:
``mlp`` (the headline model) and ``dcgan`` (two tapes, noise from ``base.SeedStream``, tf_keras'
Dropout with its stateful random ops). Steps are few: the point is which Keras ran and whether
the numbers agree, not speed.
"""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import harness
from benchmarks.worker import RESULT_TAG

PROGRAMS = ["mlp", "dcgan"]
MODES = ["eager", "terra"]
WARMUP = 8
STEPS = 8
RTOL, ATOL = 1e-4, 1e-6


@pytest.fixture(scope="module")
def runs():
    return harness.measure(PROGRAMS, MODES, config="quick", steps=dict.fromkeys(PROGRAMS, STEPS),
                           warmup=dict.fromkeys(PROGRAMS, WARMUP), repeats=1, seed=0,
                           timeout=300, inprocess=False, keras=2, log=lambda msg: None)


def _rows(runs):
    return harness.summarize(runs, PROGRAMS, MODES, RTOL, ATOL, RTOL)


def test_tf_keras_ran(runs):
    for run in runs:
        assert "error" not in run, run.get("traceback") or run["error"]
        assert run["keras_version"].startswith("2."), run
        assert run["keras_module"] == "tf_keras", run


def test_terra_losses_equal_eager(runs):
    for row in _rows(runs):
        assert row["status"] == "ok", row
        if row["mode"] == "terra":  # else eager was compared with eager
            assert row["coexecuted"] > 0, row["terra_stats"]


def test_comparison_catches_a_difference(runs):
    """The check above is live: Terra's losses off by 1e-3 are flagged."""
    tampered = [dict(run) for run in runs]
    for run in tampered:
        if run["mode"] == "terra":
            run["losses"] = [_scale(loss, 1.001) for loss in run["losses"]]
    statuses = {row["mode"]: row["status"] for row in _rows(tampered)}
    assert statuses == {"eager": "ok", "terra": "WRONG"}


def test_worker_refuses_the_wrong_keras():
    """A run asked for Keras 2 in a process where TensorFlow chose Keras 3 is an error."""
    spec = dict(program="mlp", mode="eager", steps=1, warmup=0, keras=2)
    env = dict(os.environ, TF_USE_LEGACY_KERAS="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(filter(None, [str(harness.ROOT),
                                                        os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.worker", json.dumps(spec)],
                          cwd=harness.ROOT, env=env, capture_output=True, text=True, timeout=120)
    line = next(line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG))
    result = json.loads(line[len(RESULT_TAG):])
    assert result["keras_version"].startswith("3."), result
    assert "asked for Keras 2" in result["error"], result


def _scale(loss, factor):
    if isinstance(loss, (list, tuple)):
        return [x * factor for x in loss]
    return loss * factor
