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

from benchmarks.modes import AUTOGRAPH_PEER, MODES
from benchmarks.worker import RESULT_TAG, run_one

ROOT = Path(__file__).resolve().parents[1]


def measure(programs, modes, *, config, steps, warmup, repeats, seed, timeout, inprocess,
            log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[dict]:
    """All runs, as worker results plus ``repeat``. ``steps``/``warmup`` map program -> count."""
    runs = []
    total = len(programs) * repeats * len(modes)
    started = time.perf_counter()
    for program in programs:
        for repeat in range(repeats):
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                spec = dict(program=program, mode=mode, config=config, steps=steps[program],
                            warmup=warmup[program], seed=seed)
                log(f"[{len(runs) + 1}/{total}] {program} {mode} (repeat {repeat + 1}) ...")
                run_start = time.perf_counter()
                result = run_one(**spec) if inprocess else _run_subprocess(spec, timeout)
                result["repeat"] = repeat
                runs.append(result)
                wall = time.perf_counter() - run_start
                outcome = (f"{result['steps_per_s']:.2f} steps/s" if "steps_per_s" in result
                           else result.get("error", "no result"))
                log(f"    {outcome}  ({wall:.1f} s; {time.perf_counter() - started:.0f} s total)")
    return runs


def _run_subprocess(spec: dict, timeout: float) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    cmd = [sys.executable, "-m", "benchmarks.worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(spec, error=f"timeout after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    tail = proc.stderr.strip().splitlines()[-3:]
    return dict(spec, error=f"worker crashed (exit code {proc.returncode})",
                traceback="\n".join(tail))


def compare_losses(losses, reference, rtol: float, atol: float) -> tuple[str | None, float]:
    """(first mismatch as text or None, largest relative difference)."""
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


def summarize(runs: list[dict], programs, modes, rtol: float, atol: float) -> list[dict]:
    """One row per (program, mode): status, speed, paired ratios, traces, memory."""
    by_key = {(r["program"], r["mode"], r["repeat"]): r for r in runs}
    repeats = sorted({r["repeat"] for r in runs})
    rows = []
    for program in programs:
        sps = {m: {k: by_key[(program, m, k)].get("steps_per_s") for k in repeats} for m in modes}
        for mode in modes:
            mine = [by_key[(program, mode, k)] for k in repeats]
            row = dict(program=program, mode=mode, label=MODES[mode].label, status="ok",
                       detail="")
            errors = [r["error"] for r in mine if "error" in r]
            mismatches, max_rel = [], 0.0
            for k, r in zip(repeats, mine, strict=True):
                # eager is checked against its own first repeat (determinism of the program).
                ref = by_key[(program, "eager", repeats[0] if mode == "eager" else k)]
                if "losses" in r and "losses" in ref:
                    mismatch, rel = compare_losses(r["losses"], ref["losses"], rtol, atol)
                    max_rel = max(max_rel, rel)
                    if mismatch:
                        mismatches.append(mismatch)
            if errors:
                row.update(status="FAIL", detail=errors[0])
            elif mismatches:
                row.update(status="NONDET" if mode == "eager" else "WRONG", detail=mismatches[0])
            row["max_rel_diff"] = max_rel
            row["steps_per_s"] = [sps[mode][k] for k in repeats]
            row["median_steps_per_s"] = _median(row["steps_per_s"])
            ok = [v for v in row["steps_per_s"] if v]
            row["spread_pct"] = (100 * (max(ok) - min(ok)) / 2 / statistics.median(ok)
                                 if len(ok) > 1 else None)
            row["speedup"] = _paired(sps[mode], sps.get("eager"))
            row["median_speedup"] = _median(row["speedup"])
            peer = AUTOGRAPH_PEER.get(mode)
            if peer not in modes and peer == "autograph_xla":
                peer = "autograph"
            if peer in modes:
                row["vs_autograph_mode"] = peer
                row["vs_autograph"] = _paired(sps[mode], sps[peer])
                row["median_vs_autograph"] = _median(row["vs_autograph"])
            row["traces"] = _median([_traces(r) for r in mine])
            stats = [r.get("terra_stats") for r in mine if r.get("terra_stats")]
            if stats:
                row["terra_stats"] = _merge_stats(stats)
                row["fallbacks"] = row["terra_stats"].get("fallbacks")
                row["coexecuted"] = row["terra_stats"].get("coexecuted")
            row["peak_rss_mb"] = _median([r.get("peak_rss_mb") for r in mine])
            row["warmup_s"] = _median([r.get("warmup_s") for r in mine])
            rows.append(row)
    return rows


def _paired(mine: dict, base: dict | None) -> list:
    if not base:
        return []
    return [mine[k] / base[k] if mine.get(k) and base.get(k) else None for k in mine]


def _traces(run: dict):
    if run.get("terra_stats"):
        return run["terra_stats"].get("traces")
    return run.get("traces")


def _merge_stats(stats: list[dict]) -> dict:
    """Median of every numeric field over the repeats; other fields from the last repeat."""
    merged = dict(stats[-1])
    for key, value in stats[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = _median([s.get(key) for s in stats])
    return merged
