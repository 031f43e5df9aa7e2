"""One measured run: build a program fresh, run warm-up steps, then timed steps.

The harness starts ``python -m benchmarks.worker '<json spec>'`` once per (program, mode,
repeat), one at a time, so every run gets a fresh TensorFlow and Terra (no state carried from
another mode), its own peak RSS (``ru_maxrss`` of the process) and crash isolation. The result
is printed as one JSON line prefixed with ``RESULT_TAG`` on stdout.
"""

from __future__ import annotations

import json
import resource
import sys
import time
import traceback

RESULT_TAG = "@@benchmark-result "


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(program: str, mode: str, config: str = "quick", steps: int = 20, warmup: int = 5,
            seed: int = 0) -> dict:
    """Measure one (program, mode) run; never raises (errors are part of the result).

    ``timed_s`` covers the timed steps including the final conversion of their losses, so work
    still in flight when the loop ends (a graph running behind Python) is counted.
    """
    from benchmarks import modes
    from benchmarks.programs import load, run

    result = dict(program=program, mode=mode, config=config, steps=steps, warmup=warmup,
                  seed=seed, rss_base_mb=_peak_rss_mb())
    phase = "build"
    try:
        m = modes.MODES[mode]
        cls = load(program)
        tape = modes.tape_for(m)
        start = time.perf_counter()
        prog = cls(config, seed, tape=tape)
        step_fn = modes.step_fn_for(m, prog)
        result["build_s"] = time.perf_counter() - start
        phase = "warm-up"
        start = time.perf_counter()
        losses = run(prog, warmup, step_fn)
        result["warmup_s"] = time.perf_counter() - start
        result["terra_stats_warmup"] = modes.terra_stats()
        phase = "timed steps"
        start = time.perf_counter()
        losses += run(prog, steps, step_fn)
        result["timed_s"] = elapsed = time.perf_counter() - start
        result["steps_per_s"] = steps / elapsed
        result["losses"] = losses
        result["terra_stats"] = modes.terra_stats()
        if m.autograph:
            result["traces"] = step_fn.experimental_get_tracing_count()
    except Exception as e:  # reported, not handled: a failing mode is a result
        first = (str(e).strip().splitlines() or [""])[0]
        result["error"] = f"{type(e).__name__} during {phase}: {first[:300]}"
        result["traceback"] = traceback.format_exc()[-4000:]
        result["terra_stats"] = modes.terra_stats()
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    result = run_one(**spec)
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
