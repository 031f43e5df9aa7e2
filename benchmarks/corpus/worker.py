"""One run of one corpus program, eagerly or under Terra, in its own process.

``python -m benchmarks.corpus.worker '<json spec>'`` seeds everything, calls ``terra.enable()``
for the Terra mode (before the program is built, so that every ``tf.GradientTape`` the library
opens is Terra's), builds the program and runs its steps. The ``function`` mode runs the
program's ``step_function()`` (its step inside ``tf.function``, AutoGraph's way) instead of
``step()``, for timing only; a program without one is reported ``unsupported``.

Every mode reads each step's loss back to the host before the step's time is taken, so a step
ends at the same point in all three (for Terra, which may run the graph behind Python, its
graph's work is done; for ``tf.function``, the function's). It prints one JSON line tagged with
``benchmarks.worker.RESULT_TAG`` (losses, times, Terra's stats and report) and writes the final
value of every variable to the spec's ``.npz`` file (too large for a JSON line: a MobileNet has
millions of numbers). A fresh process per run keeps the eager reference free of Terra and lets
a program set environment switches read at TensorFlow's import (``TF_USE_LEGACY_KERAS``).
"""

from __future__ import annotations

import importlib
import random
import time
import traceback

from benchmarks.worker import serve

EXPLAIN_LINES = 12  # of terra.explain() kept in the result


def run(program: str, mode: str, steps: int, seed: int, variables_path: str,
        deterministic: bool = False) -> dict:
    """Run ``program`` for ``steps`` steps; never raises (an error is part of the result)."""
    import numpy as np
    import tensorflow as tf

    result = dict(program=program, mode=mode, steps=steps, seed=seed, variables_path=variables_path)
    random.seed(seed)
    np.random.seed(seed)
    tf.random.set_seed(seed)
    if deterministic:  # else two eager runs of the program could already disagree
        tf.config.experimental.enable_op_determinism()
    if mode == "terra":
        import terra

        terra.enable()
    phase = "build"
    try:
        module = importlib.import_module(f"benchmarks.corpus.programs.{program}")
        prog = module.build(np.random.default_rng(seed))
        step = None
        if mode == "function":
            step = prog.step_function()
            if step is None:
                result["unsupported"] = "the program has no step_function()"
                return result
        phase = "training"
        losses, ticks = [], []

        def tick(loss):
            losses.append(numbers(loss))  # the host sync: the step's work is done
            ticks.append(time.perf_counter())

        start = time.perf_counter()
        if step is None:
            prog.train(steps, tick)
        else:
            prog.train(steps, tick, step)
        end = time.perf_counter()
        result["losses"] = losses
        half = len(ticks) // 2
        result["total_s"] = end - start
        # the second half alone: past tracing and graph generation (Terra's steady state)
        result["second_half_s"] = end - ticks[half - 1] if half else None
        result["second_half_steps"] = len(ticks) - half
        result["step_s"] = list(np.diff([start, *ticks]))
        phase = "saving variables"
        values = {f"{i:04d} {v.name}": np.asarray(v.numpy())
                  for i, v in enumerate(prog.variables())}
        np.savez(variables_path, **values)
        result["variables"] = len(values)
    except Exception as error:  # reported, not handled: a failing run is a result
        result["error"] = f"{type(error).__name__} during {phase}: {str(error)[:300]}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if mode == "terra":
        result.update(_terra_report())
    return result


def numbers(loss):
    """A step's loss as JSON numbers: a float, or a list of floats for a step with several
    (a tuple, or a dict's values in order)."""
    if isinstance(loss, dict):
        loss = list(loss.values())
    if isinstance(loss, (list, tuple)):
        return [float(part) for part in loss]
    return float(loss)


def _terra_report() -> dict:
    import terra

    stats = terra.stats()
    fields = ("iterations", "traces", "fallbacks", "graph_generations", "coexecuted",
              "skipped_calls", "phase")
    try:
        explain = str(terra.explain())
    except Exception as error:  # the report must not hide the run's own outcome
        explain = f"terra.explain() raised {type(error).__name__}: {error}"
    return dict(stats={f: getattr(stats, f) for f in fields},
                explain="\n".join(explain.splitlines()[:EXPLAIN_LINES]))


if __name__ == "__main__":
    serve(run)
