"""Schedule the runs (paired, interleaved repeats), then compare and summarize them.

For every program and repeat, every mode runs once, in an order rotated by one per repeat so
that no mode always runs first (or right after another one) while the machine's load drifts.
Each run is a fresh ``benchmarks.worker`` process; only one runs at a time.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.modes import AUTOGRAPH_PEER, MODES, finish
from benchmarks.programs import REGISTRY
from benchmarks.worker import RESULT_TAG, keras_env, run_one

ROOT = Path(__file__).resolve().parents[1]


def measure(programs, modes, *, config, steps, warmup, repeats, seed, timeout, inprocess,
            keras=3, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[dict]:
    """All runs, as worker results plus ``repeat``. ``steps``/``warmup`` map program -> count;
    ``keras`` is the Keras major version every run uses (2: tf_keras)."""
    if inprocess:  # before the first run imports TensorFlow; later runs reuse its choice
        os.environ.update(keras_env(keras))
    runs = []
    total = len(programs) * repeats * len(modes)
    started = time.perf_counter()
    for program in programs:
        for repeat in range(repeats):
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                spec = dict(program=program, mode=mode, config=config, steps=steps[program],
                            warmup=warmup[program], seed=seed, keras=keras)
                log(f"[{len(runs) + 1}/{total}] {program} {mode} (repeat {repeat + 1}) ...")
                run_start = time.perf_counter()
                if inprocess:
                    result = run_one(**spec)
                    result["peak_rss_mb"] = None  # the process's peak, not this run's
                    finish(MODES[mode])
                else:
                    result = _run_subprocess(spec, timeout)
                result["repeat"] = repeat
                runs.append(result)
                wall = time.perf_counter() - run_start
                outcome = (f"{result['steps_per_s']:.2f} steps/s" if "steps_per_s" in result
                           else result.get("error", "no result"))
                log(f"    {outcome}  ({wall:.1f} s; {time.perf_counter() - started:.0f} s total)")
    return runs


def _run_subprocess(spec: dict, timeout: float) -> dict:
    return run_worker("benchmarks.worker", spec, timeout, keras_env(spec["keras"]))


def run_worker(module: str, spec: dict, timeout: float, extra_env: dict = (),
               root: Path = ROOT) -> dict:
    """``python -m module <spec as JSON>`` in a fresh process with the project at ``root``
    (this checkout, or another one to compare with) importable first; its result is the line
    tagged ``RESULT_TAG``. A crash or a timeout becomes the result's ``error`` (with the last
    lines of stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra_env)
    cmd = [sys.executable, "-m", module, json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timeout after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = proc.stderr.strip().splitlines()[-5:]
    return dict(spec, error=f"worker crashed (exit code {proc.returncode})",
                traceback="\n".join(tail))


def compare_losses(losses, reference, rtol: float, atol: float,
                   steps: int | None = None) -> tuple[str | None, float]:
    """(first mismatch as text or None, largest relative difference) over the first ``steps``."""
    losses, reference = losses[:steps], reference[:steps]
    a, b = np.asarray(losses, np.float64), np.asarray(reference, np.float64)
    if a.shape != b.shape:
        return f"{len(a)} losses vs eager's {len(b)}", float("inf")
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.abs(a - b) / np.maximum(np.abs(b), atol)
    max_rel = float(np.nanmax(rel)) if rel.size else 0.0
    bad = ~np.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    if a.ndim > 1:
        bad = bad.any(axis=tuple(range(1, a.ndim)))
    if not bad.any():
        return None, max_rel
    i = int(np.argmax(bad))
    return f"step {i + 1}: {_fmt(losses[i])} vs eager {_fmt(reference[i])}", max_rel


def _fmt(loss) -> str:
    if isinstance(loss, (list, tuple)):
        return "(" + ", ".join(f"{x:.6g}" for x in loss) + ")"
    return f"{loss:.6g}"


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict], programs, modes, rtol: float, atol: float,
              xla_rtol: float) -> list[dict]:
    """One row per (program, mode): status, speed, paired ratios, traces, memory."""
    by_key = {(r["program"], r["mode"], r["repeat"]): r for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    rows = []
    for program in programs:
        sps = {m: {k: by_key[(program, m, k)].get("steps_per_s") for k in repeats} for m in modes}
        eager = [by_key[(program, "eager", k)] for k in repeats]
        for mode in modes:
            mine = [by_key[(program, mode, k)] for k in repeats]
            row = dict(program=program, mode=mode, label=MODES[mode].label)
            row.update(_check(program, mode, mine, eager,
                              xla_rtol if MODES[mode].xla else rtol, atol))
            row.update(_speed(mode, modes, sps))
            row.update(_terra(mine))
            row.update(_floor(mine))
            row["traces"] = _median([_traces(r) for r in mine])
            row["peak_rss_mb"] = _median([r.get("peak_rss_mb") for r in mine])
            row["warmup_s"] = _median([r.get("warmup_s") for r in mine])
            row["startup_steps"] = _median([_startup(r, e) for r, e in zip(mine, eager)])
            rows.append(row)
    return rows


def _startup(run, eager):
    """What the mode's warm-up took over eager's, in eager steps of the same repeat: Terra's
    tracing, generation and instantiation, AutoGraph's tracing, XLA's compilation."""
    if run is eager or None in (run.get("warmup_s"), eager.get("warmup_s"),
                                eager.get("steps_per_s")):
        return None
    return (run["warmup_s"] - eager["warmup_s"]) * eager["steps_per_s"]


def _check(program, mode, mine, eager, rtol, atol) -> dict:
    """Status of one (program, mode): ok, FAIL (raised), WRONG (losses differ from eager's),
    NONDET (eager itself differs between repeats) or UNCHECKED (AutoGraph+XLA on a program
    that draws random numbers: Terra+XLA keeps random ops out of XLA, AutoGraph+XLA cannot).
    The floor's losses are not compared: its timed steps all return the recorded step's."""
    compared = None if MODES[mode].floor or MODES[mode].exact else \
        REGISTRY[program].compare_steps
    mismatches, max_rel = [], 0.0
    for k, r in enumerate([] if MODES[mode].floor else mine):
        ref = eager[0 if mode == "eager" else k]  # eager: determinism across repeats
        if "losses" in r and "losses" in ref:
            mismatch, rel = compare_losses(r["losses"], ref["losses"], rtol, atol, compared)
            max_rel = max(max_rel, rel)
            if mismatch:
                mismatches.append(mismatch)
    result = dict(status="ok", detail="", compared_steps=compared, max_rel_diff=max_rel)
    errors = [r["error"] for r in mine if "error" in r]
    if errors:
        result.update(status="FAIL", detail=errors[0])
    elif MODES[mode].jit_compile and REGISTRY[program].random:
        result.update(status="UNCHECKED", detail="XLA draws other random numbers than eager "
                      "(dropout/noise in the step); losses not compared")
    elif mismatches:
        result.update(status="NONDET" if mode == "eager" else "WRONG", detail=mismatches[0])
    return result


def _speed(mode, modes, sps) -> dict:
    """steps/s per repeat, median and spread; per-repeat ratios to eager and to AutoGraph."""
    per_repeat = list(sps[mode].values())
    ok = [v for v in per_repeat if v]
    result = dict(steps_per_s=per_repeat, median_steps_per_s=_median(per_repeat),
                  spread_pct=(100 * (max(ok) - min(ok)) / 2 / statistics.median(ok)
                              if len(ok) > 1 else None))
    result["speedup"] = _paired(sps[mode], sps["eager"])
    result["median_speedup"] = _median(result["speedup"])
    if "floor" in modes and mode != "floor":  # the share of the floor's speed reached
        result["vs_floor"] = _paired(sps[mode], sps["floor"])
        result["median_vs_floor"] = _median(result["vs_floor"])
    peer = AUTOGRAPH_PEER.get(mode)
    if peer == "autograph_xla" and peer not in modes:
        peer = "autograph"
    if peer in modes:
        result["vs_autograph_mode"] = peer
        result["vs_autograph"] = _paired(sps[mode], sps[peer])
        result["median_vs_autograph"] = _median(result["vs_autograph"])
    return result


def _terra(mine) -> dict:
    """Terra's stats: whole-run medians, and the timed steps alone (``_timed_stats``)."""
    stats = [r["terra_stats"] for r in mine if r.get("terra_stats")]
    if not stats:
        return {}
    merged = _merge_stats(stats)
    timed = [_timed_stats(r) for r in mine if r.get("terra_stats_warmup") and "error" not in r]
    return dict(terra_stats=merged, fallbacks=merged.get("fallbacks"),
                coexecuted=merged.get("coexecuted"),
                terra_timed=_merge_stats(timed) if timed else None)


def _floor(mine) -> dict:
    """The floor's counters (``benchmarks.floor.Floor.stats``), medians over the repeats."""
    stats = [r["floor_stats"] for r in mine if r.get("floor_stats")]
    return dict(floor_stats=_merge_stats(stats)) if stats else {}


def _paired(mine: dict, base: dict | None) -> list:
    if not base:
        return []
    return [mine[k] / base[k] if mine.get(k) and base.get(k) else None for k in mine]


def _traces(run: dict):
    if run.get("terra_stats"):
        return run["terra_stats"].get("traces")
    return run.get("traces")


def _timed_stats(run: dict) -> dict:
    """Terra stats of the timed steps only: counter deltas, and times in ms per timed step."""
    end, start = run["terra_stats"], run["terra_stats_warmup"]
    timed = {"phase": end.get("phase")}
    for key, value in end.items():
        before = start.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or before is None:
            continue
        delta = value - before
        timed[key] = delta if isinstance(value, int) else 1000 * delta / run["steps"]
    return timed


def _merge_stats(stats: list[dict]) -> dict:
    """Median of every numeric field over the repeats; other fields from the last repeat."""
    merged = dict(stats[-1])
    for key, value in stats[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = _median([s.get(key) for s in stats])
    return merged
