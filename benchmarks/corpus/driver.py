"""Run a corpus program eagerly and under Terra (one fresh process each), compare, tabulate.

The comparison is the project's promise: the same per-step losses and, after the last step, the
same value of every variable (model and optimizer state), within ``RTOL``/``ATOL``. Speed is
reported next to it: the median step time over the second half of the run (where Terra should be
co-executing; every mode reads each step's loss back before the step's time is taken) and
steps/s over the whole run (tracing and graph generation included), medians over paired
repeats. With ``function=True`` each pair also runs the program's step inside ``tf.function``
(AutoGraph, the other way to make such a loop a graph), timed only: its numbers are not
eager's to the bit (Grappler regroups arithmetic), so it is not compared.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import numpy as np

from benchmarks.corpus import REGISTRY
from benchmarks.harness import compare_losses, run_worker

RTOL, ATOL = 1e-4, 1e-6
TIMEOUT = 900.0  # seconds per run; a hang under Terra is a finding, not a stuck corpus


@dataclasses.dataclass
class Comparison:
    match: bool
    detail: str  # where the runs part (first differing step or variable), or why not compared


def run_child(program: str, mode: str, steps: int, seed: int, scratch: str,
              timeout: float = TIMEOUT) -> dict:
    """One run in a fresh ``benchmarks.corpus.worker`` process; its variables land in
    ``scratch``. A crash or a timeout is returned as the result's ``error``."""
    entry = REGISTRY[program]
    spec = dict(program=program, mode=mode, steps=steps, seed=seed,
                variables_path=os.path.join(scratch, f"{program}-{mode}.npz"),
                deterministic=entry.deterministic)
    return run_worker("benchmarks.corpus.worker", spec, timeout, dict(entry.env))


def compare(eager: dict, terra: dict, rtol: float = RTOL, atol: float = ATOL) -> Comparison:
    """Terra's run against eager's: losses step by step, then every variable in full."""
    for run in (eager, terra):
        if "error" in run:
            return Comparison(False, f"{run['mode']} run failed: {run['error']}")
    mismatch, _ = compare_losses(terra["losses"], eager["losses"], rtol, atol)
    if mismatch:
        return Comparison(False, f"loss at {mismatch}")
    return compare_variables(eager["variables_path"], terra["variables_path"], rtol, atol)


def compare_variables(eager_path: str, terra_path: str, rtol: float, atol: float) -> Comparison:
    with np.load(eager_path) as eager, np.load(terra_path) as terra:
        if sorted(eager.files) != sorted(terra.files):
            return Comparison(False, f"variables differ: eager has {len(eager.files)}, "
                                     f"Terra {len(terra.files)}")
        for key in sorted(eager.files):
            left, right = eager[key], terra[key]
            if left.shape != right.shape:
                return Comparison(False, f"variable {key}: shape {right.shape} vs {left.shape}")
            if not np.allclose(right, left, rtol=rtol, atol=atol, equal_nan=True):
                worst = float(np.max(np.abs(right.astype(np.float64) - left)))
                return Comparison(False, f"variable {key}: max abs difference {worst:.3g}")
        return Comparison(True, f"{len(eager.files)} variables equal")


def run_program(program: str, steps: int, seed: int = 0, timeout: float = TIMEOUT,
                repeats: int = 1, function: bool = False) -> dict:
    """``repeats`` sets of runs of ``program`` (eager and Terra, and ``tf.function`` with
    ``function``; the order reversed from one set to the next so that drifting machine load
    hits every mode alike) and their comparisons, as one table row: speeds and ratios are
    medians over the sets (each ratio taken within its set), and every set must match."""
    modes = ("eager", "terra", "function") if function else ("eager", "terra")
    pairs = []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(repeats):
            order = modes if repeat % 2 == 0 else modes[::-1]
            runs = {mode: run_child(program, mode, steps, seed, scratch, timeout)
                    for mode in order}
            pairs.append((runs, compare(runs["eager"], runs["terra"])))
    failed = [comparison for _, comparison in pairs if not comparison.match]
    last = pairs[-1][0]["terra"]
    row = dict(program=program, library=REGISTRY[program].library, steps=steps,
               repeats=repeats, match=not failed, detail=(failed or [pairs[-1][1]])[0].detail,
               stats=last.get("stats"), explain=last.get("explain", ""))
    for mode in modes:
        row[f"{mode}_sps"] = _median([_speed(runs[mode])[0] for runs, _ in pairs])
        row[f"{mode}_half_sps"] = _median([_speed(runs[mode])[1] for runs, _ in pairs])
        row[f"{mode}_step_ms"] = _median([_step_ms(runs[mode]) for runs, _ in pairs])
        row[f"{mode}_traceback"] = next((runs[mode]["traceback"] for runs, _ in pairs
                                         if runs[mode].get("traceback")), None)
    row["ratio"] = _median([_ratio(_speed(runs["terra"])[0], _speed(runs["eager"])[0])
                            for runs, _ in pairs])
    row["half_ratio"] = _median([_ratio(_speed(runs["terra"])[1], _speed(runs["eager"])[1])
                                 for runs, _ in pairs])
    # Terra's speed over each baseline's, from the step times: above 1, Terra is faster
    row["x_eager"] = _median([_ratio(_step_ms(runs["eager"]), _step_ms(runs["terra"]))
                              for runs, _ in pairs])
    row["function"] = None  # not run
    if function:
        outcomes = [runs["function"] for runs, _ in pairs]
        unsupported = next((r["unsupported"] for r in outcomes if "unsupported" in r), None)
        error = next((r["error"] for r in outcomes if "error" in r), None)
        row["function"] = ("n/a" if unsupported else f"failed: {error}" if error else "ran")
        row["x_function"] = _median([_ratio(_step_ms(runs["function"]), _step_ms(runs["terra"]))
                                     for runs, _ in pairs])
    return row


def _step_ms(run: dict):
    """The median step time over the run's second half, in milliseconds (None where the run
    failed, did not run, or predates per-step times)."""
    times = run.get("step_s")
    if not times:
        return None
    return 1000 * float(np.median(times[len(times) // 2:]))


def _speed(run: dict):
    """Steps/s over the whole run and over its second half (None where it failed)."""
    whole = run["steps"] / run["total_s"] if "total_s" in run else None
    half = run.get("second_half_s")
    return whole, run["second_half_steps"] / half if half else None


def _median(values):
    known = [v for v in values if v is not None]
    return float(np.median(known)) if known and len(known) == len(values) else None


def _ratio(mine, base):
    return mine / base if mine and base else None


def table(rows: list[dict]) -> str:
    """The markdown table, then the explain() excerpts of the programs Terra did not speed up,
    got wrong, or left below 0.8 of ``tf.function``'s speed.

    "x eager" and "x tf.function" are Terra's speed over each baseline's in the second half
    (the baseline's median step time over Terra's); "whole run" is Terra's steps/s over eager's
    for the whole run, tracing and graph generation included."""
    lines = ["| program | library | match | eager ms/step | tf.function ms/step "
             "| Terra ms/step | x eager | x tf.function | whole run x eager | traces "
             "| fallbacks | coexecuted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for row in rows:
        stats = row["stats"] or {}
        match = "yes" if row["match"] else f"**no** ({row['detail']})"
        function = row.get("function")
        if function is None or function == "ran":
            function_ms, x_function = _num(row.get("function_step_ms")), \
                _num(row.get("x_function"))
        else:
            function_ms = x_function = "n/a" if function == "n/a" else "failed"
        if function and function.startswith("failed"):
            notes.append(f"`{row['program']}`: the tf.function run {function}\n")
        lines.append(
            f"| {row['program']} | {row['library']} | {match} | {_num(row.get('eager_step_ms'))} "
            f"| {function_ms} | {_num(row.get('terra_step_ms'))} | {_num(row.get('x_eager'))} "
            f"| {x_function} | {_num(row['ratio'])} "
            f"| {stats.get('traces', '-')} | {stats.get('fallbacks', '-')} "
            f"| {stats.get('coexecuted', '-')} |")
        slow = row["ratio"] is not None and row["ratio"] < 1.0
        behind = row.get("x_function") is not None and row["x_function"] < 0.8
        if row["explain"] and (not stats.get("coexecuted") or slow or behind
                               or not row["match"]):
            excerpt = "\n".join(f"    {line}" for line in row["explain"].splitlines())
            notes.append(f"`{row['program']}`: terra.explain() begins\n\n{excerpt}\n")
    return "\n".join(lines + [""] + notes)


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"
