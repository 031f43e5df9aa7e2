"""Every schedule trains a model on TensorFlow devices with the unpipelined step's numbers.

The TensorFlow runs happen in a child process (tests/pipeline_worker.py): splitting the CPU into
logical devices, or connecting to a cluster, has to come before TensorFlow initialises its
devices, which this pytest process may already have done.
"""

import json
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import keras
import numpy as np
import pytest

from terra.pipeline.partition import balanced_cuts, chain_layers

ROOT = Path(__file__).resolve().parent.parent
KINDS = ["gpipe", "1f1b", "interleaved", "bitpipe", "2bp-gpipe", "2bp-1f1b", "bpipe"]
# A micro-batch's input to a stage: 4 rows of 16 float64 values.
MICROBATCH_BYTES = 4 * 16 * 8


def run_worker(mode):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "pipeline_worker.py"), mode],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def logical():
    return run_worker("schedules")


@pytest.fixture(scope="module")
def multihost():
    return run_worker("multihost")


def assert_matches_unpipelined(result, steps):
    assert len(result["grads"]) == len(result["expected"]) > 0
    for got, want in zip(result["grads"], result["expected"]):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=0)
    assert len(result["losses"]) == steps
    np.testing.assert_allclose(result["losses"], result["ref_losses"], rtol=1e-5, atol=0)
    assert result["losses"][-1] < result["losses"][0]  # it trained


@pytest.mark.parametrize("kind", KINDS)
def test_schedule_trains_like_the_unpipelined_step(logical, kind):
    assert_matches_unpipelined(logical[kind], steps=20)
    assert len(logical[kind]["devices"]) == 4  # every logical device holds a stage


@pytest.mark.parametrize("kind", KINDS)
def test_counted_bytes_follow_the_simulated_activations(logical, kind):
    chunks = 2 if kind in ("interleaved", "bitpipe") else 1
    simulated = [Fraction(value) for value in logical[kind]["simulated"]]
    assert logical[kind]["peak_bytes"] == [s * chunks * MICROBATCH_BYTES for s in simulated]


def test_measured_memory_ordering(logical):
    gpipe, plain, balanced = (logical[k]["peak_bytes"] for k in ("gpipe", "1f1b", "bpipe"))
    assert gpipe[0] > plain[0]
    assert max(balanced) < max(plain)
    assert max(balanced) - min(balanced) < max(plain) - min(plain)


def test_split_model_covers_every_layer(logical):
    sizes = logical["split"]
    assert len(sizes) == 4 and all(sizes) and sum(sizes) == 8


def test_two_servers_on_loopback(multihost):
    assert multihost["servers"] == 2
    for kind in ("gpipe", "1f1b"):
        assert_matches_unpipelined(multihost[kind], steps=5)
        tasks = {device.split("/device")[0] for device in multihost[kind]["devices"]}
        assert tasks == {"/job:worker/replica:0/task:0", "/job:worker/replica:0/task:1"}


def test_balanced_cuts_minimise_the_slowest_stage():
    assert balanced_cuts([1, 1, 1, 1, 4], 2) == [4, 1]
    sizes = balanced_cuts([5, 1, 1, 1, 1, 1], 3)
    groups = np.split(np.array([5, 1, 1, 1, 1, 1]), np.cumsum(sizes)[:-1])
    assert max(g.sum() for g in groups) == 5
    with pytest.raises(ValueError):
        balanced_cuts([1, 1], 3)


def test_only_a_chain_of_layers_is_cut():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4)(inputs)
    skip = keras.layers.Add()([keras.layers.Dense(4)(hidden), inputs])
    with pytest.raises(ValueError, match="chain"):
        chain_layers(keras.Model(inputs, skip))
    chain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    assert len(chain_layers(chain)) == 2
