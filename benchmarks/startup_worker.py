"""One run of the start-up benchmark: a program from its first step, eagerly or under Terra.

``python -m benchmarks.startup_worker '<json spec>'`` (started by ``benchmarks.startup``, one
fresh process per run, as ``benchmarks.worker``) builds one program and runs ``steps`` steps
with no warm-up, recording when each step began: a first run's start-up is what is measured,
so nothing may run before the first step (not even a warm-up step in another mode). Under
Terra it also records, for every iteration Terra begins, the step it belongs to, the phase it
begins in and Terra's counters at that moment, the step and seconds of every graph
generation, and at the run's end ``terra.stats()`` and ``terra.explain()``;
``benchmarks.startup`` derives each step's kind from these (traced, co-executed, fell back,
...).

A step's time is measured as its set measures it elsewhere, so that both modes end a step at
the same point:

- ``ten`` (``benchmarks.programs``, quick config, the harness's tape swap): the loop calls
  the step and the program's ``after_step``; the losses are converted after the loop, which
  the last step's time includes (so work still in flight in a graph is counted).
- ``control_flow`` (the programs of ``tests/test_control_flow_differential.py``): their loop
  is their own, so a step is the time between two entries into an outermost tape, as
  ``benchmarks.control_flow`` takes it; the last ends when the program returns.
- ``corpus`` (``benchmarks.corpus``, ``terra.enable()``): the program's own ``train`` loop,
  each step ending where it hands its loss to the tick, which reads it back to the host.

The program's build (before its first step) is timed apart (``build_s``) and is in neither
mode's steps; Terra's runtime is built at the first tape entry, so it is in step 1.
"""

from __future__ import annotations

import functools
import importlib
import random
import sys
import time
import traceback
from pathlib import Path

from benchmarks.worker import serve

ROOT = Path(__file__).resolve().parents[1]
COUNTERS = ("iterations", "traces", "fallbacks", "coexecuted", "graph_generations")


class Clock:
    """The step under way (0-based) and when each step began; the drivers advance it."""

    def __init__(self):
        self.step = 0
        self.began = []

    def tick(self):
        self.step = len(self.began)
        self.began.append(time.perf_counter())


def run(suite: str, program: str, mode: str, steps: int, seed: int = 0) -> dict:
    """Run ``program`` of ``suite`` (a set of programs: ``ten``, ``control_flow``, ``corpus``)
    for ``steps`` steps; never raises (an error is a result)."""
    result = dict(suite=suite, program=program, mode=mode, steps=steps, seed=seed)
    clock = Clock()
    records, generations = [], []
    where = "build"
    try:
        if mode == "terra":
            _watch(records, generations, clock)
        driver = {"ten": _ten, "control_flow": _control_flow, "corpus": _corpus}[suite]
        where = "the run"
        end, losses, build_s, *state = driver(program, mode, steps, seed, clock)
        result["build_s"] = build_s
        if state:
            result["state_digest"] = state[0]
        began = clock.began
        if len(began) != steps:
            raise RuntimeError(f"{len(began)} steps began, {steps} asked for")
        result["step_s"] = [b - a for a, b in zip(began, [*began[1:], end])]
        result["losses"] = losses
    except Exception as e:  # reported, not handled: a failing run is a result
        result["error"] = f"{type(e).__name__} during {where}: {str(e)[:300]}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if mode == "terra":
        result.update(_terra_report(records), generations=generations)
    return result


def _watch(records: list, generations: list, clock: Clock) -> None:
    """Note every iteration Terra begins (the step under way, the phase it begins in, and the
    counters then, every earlier iteration closed and counted) and every graph generation
    (the step, its seconds). Wraps the runtime's ``next_iteration`` (an outermost tape's
    entry) and the lifecycle's ``generate`` from outside: Terra has no callback for either,
    and the wrappers only read. A generation runs inside ``next_iteration``, when the
    iteration that finished the trace ends, so it belongs to the step whose tape entry that
    is."""
    from terra import lifecycle, runtime

    next_iteration, generate = runtime.Runtime.next_iteration, lifecycle.GraphLifecycle.generate

    @functools.wraps(next_iteration)
    def noted_next_iteration(self):
        next_iteration(self)
        s = self.stats
        records.append(dict(step=clock.step, phase=s.phase,
                            **{c: getattr(s, c) for c in COUNTERS}))

    @functools.wraps(generate)
    def noted_generate(self):
        began = time.perf_counter()
        try:
            return generate(self)
        finally:
            generations.append(dict(step=clock.step, seconds=time.perf_counter() - began))

    runtime.Runtime.next_iteration = noted_next_iteration
    lifecycle.GraphLifecycle.generate = noted_generate


def _terra_report(records: list) -> dict:
    """The iteration records, and at the run's end (the last step's results read)
    ``terra.stats()``, its counters (``final``) and ``terra.explain()``; then ``closed``, the
    counters after ``terra.reset()``. The last iteration is still open at the end (it closes
    at the next tape entry), and the reset closes it as a fallback wherever the recorded
    iteration went on past the loop's last op (the next step's noise, drawn before its tape):
    an artifact of ending the run there, so the steps' kinds are taken from ``final``."""
    import terra
    from terra import runtime

    report = dict(iterations=records)
    try:
        stats = terra.stats()
        report["stats"] = {k: v for k, v in vars(stats).items()
                           if isinstance(v, (int, float, str, bool, type(None)))}
        report["final"] = {c: getattr(stats, c) for c in COUNTERS}
        report["explain"] = str(terra.explain())
        rt = runtime.current()
        terra.reset()
        if rt is not None:
            report["closed"] = {c: getattr(rt.stats, c) for c in COUNTERS}
    except Exception as e:  # the report must not hide the run's own outcome
        report["report_error"] = f"{type(e).__name__}: {e}"
    return report


def _floats(loss):
    if isinstance(loss, dict):
        loss = list(loss.values())
    if isinstance(loss, (tuple, list)):
        return [float(x) for x in loss]
    return float(loss)


def _ten(program, mode, steps, seed, clock):
    """A benchmark program, built and stepped as ``benchmarks.worker`` does (its tape from
    ``benchmarks.modes``: plain, or Terra's after ``terra.reset()`` and ``configure``)."""
    import tensorflow as tf

    from benchmarks import modes
    from benchmarks.programs import REGISTRY, load

    if REGISTRY[program].op_determinism:
        tf.config.experimental.enable_op_determinism()
    cls = load(program)
    m = modes.MODES[mode]
    start = time.perf_counter()
    prog = cls("quick", seed, tape=modes.tape_for(m))
    step_fn = modes.step_fn_for(m, prog, 0)
    build_s = time.perf_counter() - start
    outs = []
    for batch in prog.batches(steps):
        clock.tick()
        outs.append(prog.after_step(step_fn(*batch)))
    losses = [_floats(out) for out in outs]
    return time.perf_counter(), losses, build_s


def _control_flow(program, mode, steps, seed, clock):
    """A control-flow test program with a tape class that ticks the clock at each entry into
    an outermost tape: the program's loop is its own, so a tape entry is where a step
    begins. ``program``: a function of ``tests/test_control_flow_differential.py``, or
    ``module:function`` of any test module written the same way (``tests/test_steady.py``).
    Besides the losses, a digest of everything else the program returns (gradients, every
    variable), to compare with eager's bit for bit."""
    sys.path.insert(0, str(ROOT / "tests"))
    import tensorflow as tf

    import terra

    module, _, name = program.rpartition(":")
    programs = importlib.import_module(module or "test_control_flow_differential")
    base = terra.TerraGradientTape if mode == "terra" else tf.GradientTape
    depth = [0]

    class Tape(base):
        def __enter__(self):
            if not depth[0]:
                clock.tick()
            depth[0] += 1
            return super().__enter__()

        def __exit__(self, *exc):
            depth[0] -= 1
            return super().__exit__(*exc)

    out = getattr(programs, name)(Tape, steps)
    end = time.perf_counter()
    rest = {k: v for k, v in out.items() if k != "losses"}
    return end, [float(x) for x in out["losses"]], None, _digest(rest)


def _digest(value) -> str:
    """A hash of every number in ``value`` (nested dicts, lists, tensors, variables, arrays),
    with their shapes and dtypes: two runs' digests agree only if every number does, bit
    for bit."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()

    def add(v):
        if isinstance(v, dict):
            for k in sorted(v):
                h.update(repr(k).encode())
                add(v[k])
        elif isinstance(v, (list, tuple)):
            h.update(b"[%d" % len(v))
            for x in v:
                add(x)
        elif v is None:
            h.update(b"None")
        else:
            a = np.asarray(v)
            h.update(f"{a.dtype}{a.shape}".encode())
            h.update(np.ascontiguousarray(a).tobytes())

    add(value)
    return h.hexdigest()


def _corpus(program, mode, steps, seed, clock):
    """A corpus program, seeded and (under Terra) enabled as ``benchmarks.corpus.worker``
    does; a step ends at its tick, where the loss is read back."""
    import numpy as np
    import tensorflow as tf

    from benchmarks.corpus import REGISTRY, missing

    absent = missing(program)
    if absent:
        raise RuntimeError(f"not installed: {', '.join(absent)}")
    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)
    if REGISTRY[program].deterministic:
        tf.config.experimental.enable_op_determinism()
    if mode == "terra":
        import terra

        terra.enable()
    start = time.perf_counter()
    module = importlib.import_module(f"benchmarks.corpus.programs.{program}")
    prog = module.build(np.random.default_rng(seed))
    build_s = time.perf_counter() - start
    losses = []

    def tick(loss):
        losses.append(_floats(loss))
        clock.tick()

    clock.tick()  # the first step begins; each tick ends one and begins the next
    prog.train(steps, tick)
    end = clock.began.pop()  # the last tick ends the last step and begins none
    return end, losses, build_s


if __name__ == "__main__":
    serve(run)
