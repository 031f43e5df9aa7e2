"""TensorFlow's thread pools told not to spin (``terra.pools``): set when Terra is imported
before the eager context starts, said in ``explain()`` when it came too late, and the numbers
of a co-executed program the same as eager's either way. Each case runs in a fresh process,
since TF reads the switch once per process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import json, sys
import tensorflow as tf
if {op_first}:
    tf.constant(1.0) + 1.0  # the eager context starts here, before Terra is imported
import terra
from terra import pools
from tensorflow.python.eager import context
sys.path.insert(0, {tests!r})
from tiny_models import mlp_loop
eager = mlp_loop(tf.GradientTape, 10)
terra.reset()
under_terra = mlp_loop(terra.TerraGradientTape, 10)
print(json.dumps(dict(
    spinning_off=context.context().config.experimental.disable_thread_spinning,
    quiet=pools.is_quiet(), explain=terra.explain(), coexecuted=terra.stats().coexecuted,
    same=all(bool(tf.reduce_all(tf.equal(a, b))) for a, b in
             zip(tf.nest.flatten(eager), tf.nest.flatten(under_terra))))))
"""


def run_child(op_first=False, **env):
    child_env = dict(os.environ, PYTHONPATH=str(_ROOT), **env)
    if "TERRA_QUIET_POOLS" not in env:
        child_env.pop("TERRA_QUIET_POOLS", None)
    code = _CHILD.format(op_first=op_first, tests=str(_ROOT / "tests"))
    done = subprocess.run([sys.executable, "-c", code], env=child_env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_imported_first_terra_turns_spinning_off_and_keeps_eagers_numbers():
    out = run_child(TERRA_QUIET_POOLS="1")
    assert out["spinning_off"] and out["quiet"], out
    assert out["same"] and out["coexecuted"] > 0, out["explain"]
    assert "thread pools spin" not in out["explain"]


def test_the_switch_off_leaves_tensorflows_config_alone():
    out = run_child(TERRA_QUIET_POOLS="0")
    assert not out["spinning_off"] and not out["quiet"], out
    assert out["same"], out["explain"]


def test_imported_after_the_first_op_explain_says_how_to_fix_it():
    out = run_child(op_first=True, TERRA_QUIET_POOLS="1")
    assert not out["spinning_off"] and not out["quiet"], out
    assert out["same"] and out["coexecuted"] > 0, out["explain"]
    assert "import terra before the first TensorFlow op" in out["explain"], out["explain"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) > 4, reason="the default on few cores")
def test_on_few_cores_the_pools_are_quiet_by_default():
    assert run_child()["spinning_off"]
