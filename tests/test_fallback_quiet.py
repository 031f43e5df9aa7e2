"""A fallback is Terra's business: TensorFlow's runtime must not report it on stderr.

To leave co-execution Terra stops the graph of the abandoned iteration, which waits in its
channels for values Python will never feed. Stopping it by cancelling those waits made TF's
C++ runtime log "Local rendezvous is aborting with status: CANCELLED: Dequeue operation was
cancelled" and "...: Skipping cancelled dequeue attempt with queue not closed" at every
fallback, which read like a crash. What Terra says about a fallback is its logger's, as
``TERRA_VERBOSITY`` asks. Those lines are written to the process's file descriptor 2, below
Python's and pytest's capture, so each program runs in a child Python whose stderr is read.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD_TIMEOUT = 300  # seconds a child may take before the test fails as a hang
TF_NOISE = ("Local rendezvous is aborting", "Skipping cancelled dequeue",
            "Skipping cancelled enqueue", "Dequeue operation was cancelled")


def child(scenario):
    """Run ``scenario`` under Terra; print its counters as the last line of stdout."""
    from test_fail_safe_differential import rare_new_paths
    from test_fallback_differential import STEPS, path_change_program

    import terra
    from terra import budget

    if scenario == "detours":  # the graph is kept: its closed channels are opened again
        terra.configure(free_rebuilds=0)
        budget.Ledger.affordable = lambda self: False
        results = rare_new_paths(terra.TerraGradientTape, 16)
    else:  # the loss (mid-forward) or the input (two inputs awaited) changes at one step
        results = path_change_program(scenario)(terra.TerraGradientTape, STEPS)
    s = terra.stats()
    finite = all(math.isfinite(loss) for loss in results["losses"])
    print(json.dumps({"fallbacks": s.fallbacks, "coexecuted": s.coexecuted,
                      "generations": s.graph_generations, "finite": finite}))


def run_child(scenario, **env):
    """``scenario`` in a child Python: its counters and everything it wrote to stderr."""
    tests = Path(__file__).resolve().parent
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join([str(tests.parent), str(tests)])
    try:
        done = subprocess.run([sys.executable, __file__, scenario], env=child_env,
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"{scenario} hung for {CHILD_TIMEOUT}s:\n{hung.stderr}")
    if done.returncode != 0:
        pytest.fail(f"{scenario} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                    f"{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def tf_noise(stderr):
    """The lines of ``stderr`` in which TF reports a stopped graph or a cancelled wait."""
    return [line for line in stderr.splitlines() if any(n in line for n in TF_NOISE)]


@pytest.mark.parametrize("scenario", ["before_forward", "in_loss", "detours"])
def test_a_fallback_leaves_no_tensorflow_warning_on_stderr(scenario):
    """A co-executed iteration falls back where the graph waits for the batch (two inputs
    at once), mid-way through the loss, and where the graph is kept (a detour: the next
    iterations run it with the channels that were closed to stop it opened again). Fails
    if TF logs the graph's stop, or if the fallback did not happen or co-execution did not
    go on."""
    facts, stderr = run_child(scenario)
    assert facts["fallbacks"] >= 1 and facts["coexecuted"] >= 4 and facts["finite"], facts
    if scenario == "detours":
        assert facts["generations"] == 1, facts
    assert not tf_noise(stderr), "\n".join(tf_noise(stderr))


def test_verbosity_still_reports_the_fallback():
    """With ``TERRA_VERBOSITY=1`` the ``terra`` logger tells of the fallback, and TF still
    says nothing about it."""
    facts, stderr = run_child("before_forward", TERRA_VERBOSITY="1")
    assert facts["fallbacks"] >= 1, facts
    reported = [line for line in stderr.splitlines() if line.startswith("Terra fallback [")]
    assert reported and "test_fallback_differential.py:" in reported[0], stderr[-3000:]
    assert not tf_noise(stderr), "\n".join(tf_noise(stderr))


class Loud:
    """A channel whose closing writes, at file descriptor 2, TF's line about a cancelled
    dequeue of a Terra channel, then lines that are not that: the user's queue's, another
    thread's."""

    def __init__(self, lines):
        self.lines = lines

    def close(self):
        for line in self.lines:
            os.write(2, line)


def test_closing_a_graphs_inputs_keeps_every_other_line_on_stderr(capfd):
    """While Terra closes a graph's channels, stderr loses TF's lines about cancelled
    dequeues of Terra's channels only. Fails if such a line gets through, or if another
    line written meanwhile is lost or reordered."""
    from terra import queues

    ours = (b"W0000 00:00:1796665481.781206   16479 queue_base.cc:286] terra_channel_1: "
            b"Skipping cancelled dequeue attempt with queue not closed\n")
    others = [b"W0000 00:00:1796665481.781300   16479 queue_base.cc:286] user_queue: "
              b"Skipping cancelled dequeue attempt with queue not closed\n",
              b"a line another thread wrote\n",
              b"W0000 00:00:1796665481.781400   16479 op_kernel.cc:1857] OP_REQUIRES failed "
              b"at gather_op.cc: INVALID_ARGUMENT: terra_channel_2\n"]
    capfd.readouterr()  # what importing TF wrote
    queues.close_all([Loud([ours, others[0]]), Loud([others[1], ours, others[2]])])
    assert capfd.readouterr().err == b"".join(others).decode()


if __name__ == "__main__":
    child(sys.argv[1])
