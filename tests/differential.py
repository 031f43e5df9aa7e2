"""The differential helper: a program run eagerly and under Terra must give the same numbers.

A *program* is a function ``program(tape_cls, steps) -> dict`` that builds its model from a fixed
seed, runs an ordinary imperative training loop with ``tape_cls`` in place of
``tf.GradientTape`` and returns what to compare (per-step losses and gradients, final variables,
anything Python computed from fetched values). :func:`assert_same_as_eager` runs it with
``tf.GradientTape``, then with ``terra.TerraGradientTape`` after ``terra.reset()``, compares every
returned value and checks ``terra.stats()``. Every test of Terra's semantics goes through it: a
test never asserts a hard-coded number, only "Terra == eager".

Returned values may nest lists/tuples/dicts of numpy arrays, tensors or variables (converted with
``.numpy()`` after the program returns), Python numbers, bools, strings and ``None``. Floats are
compared with ``np.testing.assert_allclose``; integers, bools, ``None`` positions and the text of
strings exactly (numbers inside strings with the float tolerance, so printed losses compare like
losses). ``DIFFERENTIAL_EXACT=1`` in the environment demands bit-identical floats everywhere.

Programs can call :func:`record_stats` (a no-op outside the Terra run) to snapshot
``terra.stats()`` at chosen points, e.g. to show that co-execution resumed after a fallback.
Every wait between Terra's runners times out after ``TIMEOUT`` seconds (``TERRA_TIMEOUT``).

Run as a script (``python differential.py module:program steps out.json``) it performs both runs
in this process and writes the outcome as JSON: ``assert_same_as_eager(..., env=...)`` uses that to
run a program in a child process whose environment must be set before TensorFlow is imported
(``TF_USE_LEGACY_KERAS=1``).
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

import terra

TIMEOUT = 30.0  # seconds, unless TERRA_TIMEOUT is set
STAT_NAMES = ("iterations", "traces", "fallbacks", "graph_generations", "phase", "coexecuted")
_NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf)")

_timeline: list[tuple[str, dict]] | None = None  # set only while the Terra run is in progress


@dataclasses.dataclass
class Outcome:
    """Both runs of one program: the returned values, and Terra's stats after its run."""

    eager: dict
    terra: dict
    stats: types.SimpleNamespace
    explain: str
    timeline: list[tuple[str, dict]]  # (label, stats snapshot) from record_stats, Terra run
    keras: str  # module that tf.keras resolves to, so a Keras-2 run cannot silently be Keras 3

    def stats_at(self, label: str) -> types.SimpleNamespace:
        """The last snapshot recorded under ``label`` during the Terra run."""
        for name, snapshot in reversed(self.timeline):
            if name == label:
                return types.SimpleNamespace(**snapshot)
        raise AssertionError(f"record_stats({label!r}) never ran in the Terra run\n{self.report()}")

    def report(self) -> str:
        return f"terra.stats(): {vars(self.stats)}\nterra.explain():\n{self.explain or '(empty)'}"


def record_stats(label: str) -> None:
    """Snapshot ``terra.stats()`` under ``label`` if the Terra run is in progress."""
    if _timeline is not None:
        _timeline.append((label, _stats_dict()))


def assert_same_as_eager(
    program: Callable[[type, int], dict],
    steps: int = 10,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    exact: tuple[str, ...] = (),
    expect_fallbacks: int | tuple[int, int | None] = 0,
    max_traces: int = 2,
    min_coexecuted: int = 1,
    env: dict[str, str] | None = None,
) -> Outcome:
    """Run ``program`` eagerly and under Terra; assert equal results and sane Terra stats.

    Args:
      program: ``program(tape_cls, steps) -> dict`` (see the module docstring).
      steps: training steps; >= 8 so that warm-up and tracing leave iterations to co-execute.
      rtol, atol: float tolerance of ``np.testing.assert_allclose``.
      exact: top-level keys whose floats must be bit-identical.
      expect_fallbacks: exact count, or ``(low, high)`` bounds (``high`` None: unbounded).
      max_traces: upper bound on ``terra.stats().traces``.
      min_coexecuted: lower bound on ``terra.stats().coexecuted``.
      env: run both runs in a child Python with these extra environment variables (for
        switches read at TensorFlow import); ``program`` must then be a module-level function.

    Returns:
      The :class:`Outcome`, for test-specific checks on top.
    """
    outcome = _run_in_child(program, steps, env) if env is not None else run_both(program, steps)
    if os.environ.get("DIFFERENTIAL_EXACT", "") not in ("", "0"):
        rtol, atol, exact = 0.0, 0.0, tuple(outcome.eager)
    _compare(outcome, rtol, atol, exact)
    _check_stats(outcome, expect_fallbacks, max_traces, min_coexecuted)
    return outcome


def run_both(program: Callable[[type, int], dict], steps: int) -> Outcome:
    """The eager run, then the Terra run, in this process; Terra is reset around both so that
    the eager reference never runs next to a live runtime left over from an earlier test."""
    global _timeline
    terra.reset()
    eager = _run_once(program, tf.GradientTape, steps)
    terra.reset()
    # a hang between the runners should fail one tiny test quickly, not stall the suite
    terra.configure(timeout=float(os.environ.get("TERRA_TIMEOUT", TIMEOUT)))
    _timeline = []
    try:
        terra_results = _run_once(program, terra.TerraGradientTape, steps)
        stats, explain = types.SimpleNamespace(**_stats_dict()), _explain()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # includes pytest's Failed from a pytest.raises in a program
        raise AssertionError(
            f"the Terra run raised {type(error).__name__}: {error}\n{_report_now()}"
        ) from error
    finally:
        timeline, _timeline = _timeline, None
        terra.reset()
    return Outcome(
        eager=eager,
        terra=terra_results,
        stats=stats,
        explain=explain,
        timeline=timeline,
        keras=tf.keras.layers.Dense.__module__,
    )


def _run_once(program, tape_cls, steps):
    tf.keras.backend.clear_session()
    gc.collect()
    results = program(tape_cls, steps)
    if not isinstance(results, dict):
        raise TypeError(f"a program returns a dict, {program.__name__} returned {type(results)}")
    return {key: _to_python(value) for key, value in results.items()}


def _to_python(value):
    """Tensors and variables -> numpy, containers recursively, everything else unchanged."""
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray | np.generic):
        return value.numpy()  # tf.Tensor, tf.Variable, Keras 3 Variable
    if isinstance(value, dict):
        return {key: _to_python(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_to_python(item) for item in value]
    return value


def _stats_dict() -> dict:
    stats = terra.stats()
    more = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else {}
    return {**{name: getattr(stats, name, None) for name in STAT_NAMES}, **more}


def _explain() -> str:
    try:
        return str(terra.explain(verbose=True))  # the checks read the TraceGraph too
    except Exception as error:  # the report must not hide the real failure
        return f"(terra.explain() raised {type(error).__name__}: {error})"


def _report_now() -> str:
    return f"terra.stats(): {_stats_dict()}\nterra.explain():\n{_explain() or '(empty)'}"


# ---------------------------------------------------------------------------------- comparison


def _compare(outcome: Outcome, rtol: float, atol: float, exact: tuple[str, ...]) -> None:
    eager, terra_results = outcome.eager, outcome.terra
    if sorted(eager) != sorted(terra_results):
        raise AssertionError(
            f"the runs returned different keys: eager {sorted(eager)}, "
            f"Terra {sorted(terra_results)}\n{outcome.report()}"
        )
    for key in eager:
        tolerance = (0.0, 0.0) if key in exact else (rtol, atol)
        try:
            _compare_value(eager[key], terra_results[key], key, *tolerance)
        except AssertionError as error:
            raise AssertionError(
                f"Terra differs from eager at {error}\n{outcome.report()}"
            ) from None


def _compare_value(expected, actual, path, rtol, atol):
    if isinstance(expected, dict) or isinstance(actual, dict):
        if not (isinstance(expected, dict) and isinstance(actual, dict)) or sorted(
            expected
        ) != sorted(actual):
            raise AssertionError(f"{path}: eager {_short(expected)}, Terra {_short(actual)}")
        for key in expected:
            _compare_value(expected[key], actual[key], f"{path}[{key!r}]", rtol, atol)
    elif isinstance(expected, list) or isinstance(actual, list):
        if not (isinstance(expected, list) and isinstance(actual, list)):
            raise AssertionError(f"{path}: eager {_short(expected)}, Terra {_short(actual)}")
        if len(expected) != len(actual):
            raise AssertionError(f"{path}: eager has {len(expected)} items, Terra {len(actual)}")
        for index, (left, right) in enumerate(zip(expected, actual, strict=True)):
            _compare_value(left, right, f"{path}[{index}]", rtol, atol)
    elif isinstance(expected, str) or isinstance(actual, str):
        _compare_text(expected, actual, path, rtol, atol)
    elif expected is None or actual is None or isinstance(expected, bool):
        if type(expected) is not type(actual) or expected != actual:
            raise AssertionError(f"{path}: eager {expected!r}, Terra {actual!r}")
    else:
        _compare_numbers(expected, actual, path, rtol, atol)


def _compare_numbers(expected, actual, path, rtol, atol):
    left, right = np.asarray(expected), np.asarray(actual)
    if left.shape != right.shape or left.dtype.kind != right.dtype.kind:
        raise AssertionError(
            f"{path}: eager {left.dtype}{list(left.shape)}, Terra {right.dtype}{list(right.shape)}"
        )
    try:
        if left.dtype.kind not in "fc":
            np.testing.assert_array_equal(right, left, strict=True)
        elif rtol == 0.0 and atol == 0.0:  # bitwise: -0.0 vs 0.0 and NaN payloads count too
            if left.dtype != right.dtype or left.tobytes() != right.tobytes():
                np.testing.assert_array_equal(right, left, strict=True)
                raise AssertionError("equal values, different bits")
        else:
            np.testing.assert_allclose(right, left, rtol=rtol, atol=atol)
    except AssertionError as error:
        exactly = " (bit-exact)" if rtol == 0.0 and atol == 0.0 else ""
        raise AssertionError(f"{path}{exactly}: {str(error).strip()}") from None


def _compare_text(expected, actual, path, rtol, atol):
    if not (isinstance(expected, str) and isinstance(actual, str)):
        raise AssertionError(f"{path}: eager {_short(expected)}, Terra {_short(actual)}")
    numbers = [[float(n) for n in _NUMBER.findall(text)] for text in (expected, actual)]
    if _NUMBER.sub("#", expected) != _NUMBER.sub("#", actual) or not np.allclose(
        numbers[1], numbers[0], rtol=rtol, atol=atol, equal_nan=True
    ):
        raise AssertionError(f"{path}: eager {expected!r}, Terra {actual!r}")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------- stats


def _check_stats(outcome, expect_fallbacks, max_traces, min_coexecuted) -> None:
    stats = outcome.stats
    low, high = (
        (expect_fallbacks, expect_fallbacks)
        if isinstance(expect_fallbacks, int)
        else expect_fallbacks
    )
    problems = [
        f"terra.stats() has no {name!r}" for name in STAT_NAMES if vars(stats)[name] is None
    ]
    if stats.coexecuted is not None and stats.coexecuted < min_coexecuted:
        problems.append(f"coexecuted = {stats.coexecuted}, expected >= {min_coexecuted}")
    if stats.fallbacks is not None and not (
        low <= stats.fallbacks and (high is None or stats.fallbacks <= high)
    ):
        want = f"== {low}" if low == high else f"in [{low}, {'inf' if high is None else high}]"
        problems.append(f"fallbacks = {stats.fallbacks}, expected {want}")
    if stats.traces is not None and stats.traces > max_traces:
        problems.append(f"traces = {stats.traces}, expected <= {max_traces}")
    if problems:
        raise AssertionError(
            "results equal eager, but Terra's stats are off: "
            + "; ".join(problems)
            + f"\n{outcome.report()}"
        )


# ---------------------------------------------------------------------------------- child process


def _run_in_child(program, steps, env) -> Outcome:
    if "<locals>" in program.__qualname__:
        raise TypeError("a program run with env= must be a module-level function")
    tests_dir = Path(__file__).resolve().parent
    child_env = dict(os.environ, **env)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(tests_dir.parent), str(tests_dir), child_env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "outcome.json"
        target = f"{program.__module__}:{program.__qualname__}"
        done = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), target, str(steps), str(out)],
            env=child_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0 or not out.exists():
            raise AssertionError(
                f"child run of {target} with {env} failed (exit {done.returncode}):\n"
                f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
            )
        data = json.loads(out.read_text(), object_hook=_decode)
    return Outcome(
        eager=data["eager"],
        terra=data["terra"],
        stats=types.SimpleNamespace(**data["stats"]),
        explain=data["explain"],
        timeline=[tuple(item) for item in data["timeline"]],
        keras=data["keras"],
    )


def _encode(value):
    """JSON with exact numbers: float32/float64 -> Python float is exact and repr round-trips."""
    if isinstance(value, np.ndarray | np.generic):
        value = np.asarray(value)
        return {
            "__ndarray__": value.ravel().tolist(),
            "dtype": value.dtype.str,
            "shape": list(value.shape),
        }
    if isinstance(value, dict):
        return {str(key): _encode(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(item) for item in value]
    return value


def _decode(obj):
    if "__ndarray__" in obj:
        array = np.array(obj["__ndarray__"], dtype=np.dtype(obj["dtype"]))
        return array.reshape(obj["shape"])
    return obj


def _child_main(target: str, steps: str, out: str) -> None:
    module_name, _, qualname = target.partition(":")
    program = importlib.import_module(module_name)
    for part in qualname.split("."):
        program = getattr(program, part)
    # through the importable module, not __main__: programs call differential.record_stats
    import differential

    outcome = differential.run_both(program, int(steps))
    payload = {
        "eager": outcome.eager,
        "terra": outcome.terra,
        "stats": vars(outcome.stats),
        "explain": outcome.explain,
        "timeline": outcome.timeline,
        "keras": outcome.keras,
    }
    # NaN/inf are written with JSON's NaN/Infinity extension, which json.loads reads back
    Path(out).write_text(json.dumps(_encode(payload), allow_nan=True))


if __name__ == "__main__":
    _child_main(*sys.argv[1:])
