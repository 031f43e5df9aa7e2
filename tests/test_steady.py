"""Terra decides the same way on an idle and on a busy machine.

Two small programs (the plain Keras MLP loop, and one whose Python takes another branch every
third step) run under Terra's defaults (the cost budget on, the graph instantiated in the
background) in a child process: once on an idle machine, then beside two processes that keep
both cores busy, then eagerly. What Terra did must not differ: every iteration's phase, each
step's kind (traced, generating, instantiating, co-executed, fell back, waiting, eager), the
traces, graph generations, fallbacks and co-executed iterations; and the losses, gradients and
variables must be eager's, bit for bit. Timing decides nothing that could make them differ:
co-execution starts at an iteration fixed when the graph is generated (``terra.background``),
the census and the ledger decide from counts and CPU time (``terra.budget``).

The phases come from ``benchmarks.startup_worker``, which notes every iteration Terra begins
(wrapping ``Runtime.next_iteration``), and ``benchmarks.startup.per_step``, which gives each
step its kind, as the start-up benchmark does. No time is asserted.
"""

import concurrent.futures
import subprocess
import sys

from test_control_flow_differential import train
from tiny_models import mlp_loop

from benchmarks import startup
from benchmarks.harness import run_worker
from benchmarks.worker import keras_env

STEPS = 24
# Terra's defaults, whatever the test suite sets for its other tests (tests/conftest.py)
DEFAULTS = {"TERRA_BUDGET": "0.05", "TERRA_BACKGROUND": "1", "TERRA_CHECK": "0",
            **keras_env(3)}
PROGRAMS = ("test_steady:mlp", "test_steady:branch_every_third")
TIMEOUT = 300.0


def mlp(tape_cls, steps):
    """The plain loop: a 20-16-5 Keras MLP, Adam, the loss read back every step."""
    return mlp_loop(tape_cls, steps)


def branch_every_third(tape_cls, steps):
    """Every third step (from the second) goes through another layer, picked by Python's
    step counter: the traces see both paths before the census lets the graph be built."""
    def forward(net, x, step):
        h = net.inp(x)
        h = net.alt(h) if step % 3 == 1 else net.shared(h)
        return net.out(h)

    return train(tape_cls, steps, forward)


def _spec(program, mode):
    return dict(suite="control_flow", program=program, mode=mode, steps=STEPS, seed=0)


def _runs(*modes, together=False):
    """A child process per program and mode, one after the other or all at once; their
    results, per mode, in the order of ``PROGRAMS``."""
    specs = [_spec(p, mode) for mode in modes for p in PROGRAMS]
    with concurrent.futures.ThreadPoolExecutor(len(specs) if together else 1) as pool:
        results = list(pool.map(
            lambda spec: run_worker("benchmarks.startup_worker", spec, TIMEOUT, DEFAULTS),
            specs))
    return [results[i:i + len(PROGRAMS)] for i in range(0, len(results), len(PROGRAMS))]


def decisions(result):
    """What Terra did in a run: the phase each iteration began in, each step's kind as a
    timeline (``benchmarks.startup.LETTERS``) and the counters at the end."""
    assert "error" not in result and "report_error" not in result, \
        result.get("error") or result.get("report_error")
    steps = startup.per_step(result["iterations"], result["final"], result["steps"],
                             result.get("generations", ()))
    return dict(phases=[r["phase"] for r in result["iterations"]],
                timeline=startup.timeline([s["kind"] for s in steps]),
                final=result["final"])


def _busy(cores=2):
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]


def test_the_same_decisions_idle_and_beside_two_busy_processes():
    """Idle: each Terra run alone. Busy: two processes that never sleep, and beside them both
    programs under Terra at once. Then both eagerly, at once (eager's numbers)."""
    idle, = _runs("terra")
    hogs = _busy()
    try:
        busy, = _runs("terra", together=True)
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait()
    eager, = _runs("eager", together=True)
    for program, quiet, loaded, reference in zip(PROGRAMS, idle, busy, eager, strict=True):
        calm, rush = decisions(quiet), decisions(loaded)
        report = f"{program}:\n idle {calm}\n busy {rush}\n{quiet.get('explain')}"
        assert calm == rush, report
        assert calm["final"]["coexecuted"] >= 5, report  # a run that co-executed
        assert "error" not in reference, reference["error"]
        for run in (quiet, loaded):
            assert run["losses"] == reference["losses"], report
            assert run["state_digest"] == reference["state_digest"], report
