"""One measured run: build a program fresh, run warm-up steps, then timed steps.

The harness starts ``python -m benchmarks.worker '<json spec>'`` once per (program, mode,
repeat), one at a time, so every run gets a fresh TensorFlow and Terra (no state carried from
another mode), its own peak RSS (``ru_maxrss`` of the process) and crash isolation. The result
is printed as one JSON line prefixed with ``RESULT_TAG`` on stdout.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
import traceback

RESULT_TAG = "@@benchmark-result "
PROGRAMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "programs")
KERAS_VERSIONS = (2, 3)


def keras_env(keras: int) -> dict[str, str]:
    """The environment that makes TensorFlow's ``tf.keras`` (and so the programs, see
    ``benchmarks.programs.base``) tf_keras for ``keras=2`` and Keras 3 for ``keras=3``. Set
    either way, so a ``TF_USE_LEGACY_KERAS`` left in the caller's shell cannot pick the Keras."""
    if keras not in KERAS_VERSIONS:
        raise ValueError(f"keras must be one of {KERAS_VERSIONS}, not {keras!r}")
    return {"TF_USE_LEGACY_KERAS": "1" if keras == 2 else "0"}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_one(program: str, mode: str, config: str = "quick", steps: int = 20, warmup: int = 5,
            seed: int = 0, keras: int = 3) -> dict:
    """Measure one (program, mode) run; never raises (errors are part of the result).

    ``keras`` is the Keras major version the run must use; the caller sets :func:`keras_env`
    before TensorFlow is imported. The version that actually ran is recorded
    (``keras_version``, ``keras_module``), and a run on the other Keras is an error, not a
    result.

    ``timed_s`` covers the timed steps including the final conversion of their losses, so work
    still in flight when the loop ends (a graph running behind Python) is counted. The floor
    mode records its last warm-up step and answers the timed steps from it (``floor_stats``:
    ops per step, steps that diverged from the record, ops run for real).
    """
    from benchmarks import modes
    from benchmarks.programs import REGISTRY, load, run

    result = dict(program=program, mode=mode, config=config, steps=steps, warmup=warmup,
                  seed=seed, keras=keras)
    m = modes.MODES[mode]
    phase = "build"
    try:
        if REGISTRY[program].op_determinism:  # else two eager runs could disagree
            import tensorflow as tf

            tf.config.experimental.enable_op_determinism()
        cls = load(program)
        _check_keras(keras, result)
        tape = modes.tape_for(m)
        result["rss_imported_mb"] = _peak_rss_mb()  # TensorFlow, Keras, Terra loaded
        start = time.perf_counter()
        prog = cls(config, seed, tape=tape)
        step_fn = modes.step_fn_for(m, prog, warmup)
        result["build_s"] = time.perf_counter() - start
        phase = "warm-up"
        start = time.perf_counter()
        losses = run(prog, warmup, step_fn)
        result["warmup_s"] = time.perf_counter() - start
        result["terra_stats_warmup"] = modes.terra_stats(m)
        phase = "timed steps"
        start = time.perf_counter()
        losses += run(prog, steps, step_fn)
        result["timed_s"] = elapsed = time.perf_counter() - start
        result["steps_per_s"] = steps / elapsed
        result["losses"] = losses
        result["terra_stats"] = modes.terra_stats(m)
        if m.autograph:
            result["traces"] = step_fn.experimental_get_tracing_count()
    except Exception as e:  # reported, not handled: a failing mode is a result
        result["error"] = f"{type(e).__name__} during {phase}: {_short_message(e)}"
        result["traceback"] = traceback.format_exc()[-4000:]
        result["terra_stats"] = modes.terra_stats(m)
    if m.floor and phase != "build":
        result["floor_stats"] = step_fn.stats()
    result["peak_rss_mb"] = _peak_rss_mb()
    return result


def _check_keras(keras: int, result: dict) -> None:
    """Record the Keras the programs were built with; raise if it is not the one asked for."""
    from benchmarks.programs.base import keras as module

    result["keras_version"] = module.__version__
    result["keras_module"] = module.__name__
    if not module.__version__.startswith(f"{keras}."):
        raise RuntimeError(f"asked for Keras {keras}, but {module.__name__} "
                           f"{module.__version__} was loaded (TF_USE_LEGACY_KERAS="
                           f"{os.environ.get('TF_USE_LEGACY_KERAS')!r} when TensorFlow was "
                           f"imported?)")


def _short_message(e: Exception) -> str:
    """The error's message in one line, with the program's ``file:line`` where it was raised.

    AutoGraph wraps errors as "in user code: File ..., line N ... <Type>: <message>"; the last
    line is the message and the quoted frame the user's location.
    """
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    message = (lines[-1] if lines and lines[0] == "in user code:" else
               lines[0] if lines else "")
    message = message.removeprefix(f"{type(e).__name__}: ")[:300]
    where = None
    for line in lines:
        match = re.match(r'File "([^"]+)", line (\d+)', line)
        if match and PROGRAMS_DIR in match.group(1):
            where = f"{os.path.basename(match.group(1))}:{match.group(2)}"
    if where is None:
        for frame in traceback.extract_tb(e.__traceback__):
            if PROGRAMS_DIR in frame.filename:
                where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return f"{message} ({where})" if where else message


def serve(run) -> None:
    """The worker process's body: ``run(**spec)`` on the JSON spec of ``argv[1]``, its result
    printed after ``RESULT_TAG``. Exits at once: a runner thread left blocked by a failed run
    must not keep the process (and its already printed result) alive until the timeout."""
    result = run(**json.loads(sys.argv[1]))
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    serve(run_one)
