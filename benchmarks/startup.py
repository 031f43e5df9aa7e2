"""``python -m benchmarks.startup``: how soon Terra pays for itself in a short first run.

The other benchmarks time Terra after its warm-up, or over a whole run; a user's first run of
a script is short, and what it sees is the start: eager-speed iterations, traced ones (eager
plus recording), graph generation, the iterations that run eagerly while the graph is
instantiated, and only then co-execution. This runs each program from its first step for
``--steps`` steps (default 30), eagerly and under Terra, each run in a fresh process
(``benchmarks.startup_worker``), and times every step. Per program it reports:

- **start-up**: Terra's extra cost at its largest, in eager steps: cumulative Terra time less
  cumulative eager time, at its maximum over the run, over the median eager step;
- **pays back from**: the first step from which cumulative Terra time stays below eager's
  to the end of the run (``never`` if it is not below at the last step);
- **traced / eager**: the median traced step over the median eager step (a traced step runs
  eagerly and records: its overhead is the recorder's), and **co-executed / eager** likewise:
  what each co-executed step earns back is one less this;
- the first co-executed step, the steps co-executed, and ``terra.stats()``'s traces, graph
  generations (graphs installed) and fallbacks;
- **eager / Terra**: eager's time over Terra's for the whole run, start-up included;
- **timeline**: each step's kind, one letter a step (``LETTERS``), from the phase its Terra
  iteration began in, the counters around it and the graph generations (``per_step``).

``startup.json`` also has, per program, where the start-up went (``cost_by_kind``: up to its
peak, Terra's time less eager's per kind of step, graph generation apart) and every step of
every run. Repeats are paired (eager and Terra back to back, the order swapped from one
repeat to the next); a program's figures are the medians of the per-repeat ones, a set's
summary rows their medians and geometric means. The table goes to stdout and to
``startup.md`` in ``--out``. See docs/benchmarks.md ("Start-up").
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks import control_flow
from benchmarks.corpus import REGISTRY as CORPUS
from benchmarks.corpus import missing
from benchmarks.harness import compare_losses, run_worker
from benchmarks.programs import PAPER
from benchmarks.report import revision
from benchmarks.worker import keras_env

SUITES = ("ten", "control_flow", "corpus")
COUNTERS = ("iterations", "traces", "fallbacks", "coexecuted", "graph_generations")
# a step's kind -> its letter in the timeline column
LETTERS = {"warmup": "w", "traced": "t", "generating": "g", "instantiating": "i",
           "coexecuted": "c", "fallback": "f", "waiting": "p", "eager": "e", None: "-"}
OTHER = "?"  # a kind without a letter of its own
RTOL, ATOL = 1e-4, 1e-6  # the losses against eager's, as the harness compares them
TIMEOUT = 600.0


# -- what each step was -----------------------------------------------------------------------
def step_kind(phase: str | None, delta: dict, generated: bool = False) -> str | None:
    """A step's kind from the phase its first Terra iteration began in and how its counters
    moved: a fallback (or detour) wherever one happened; co-executed if it began in
    co-execution and did not fall back (the run's last iteration is not counted yet when the
    run ends: it closes at the next tape entry); traced if it began tracing (whether or not
    its trace was merged); ``generating`` if a graph was generated at its start (the last
    trace ends at the next tape entry) and it then ran eagerly while the graph was
    instantiated in the background; else the phase it ran in (warm-up, instantiating,
    waiting, eager), None if no tape was entered."""
    if delta.get("fallbacks"):
        return "fallback"
    if phase == "coexecution":
        return "coexecuted"
    if phase == "tracing":
        return "traced"
    if phase == "instantiating" and generated:
        return "generating"
    return phase


def per_step(records: list[dict], final: dict, steps: int,
             generations: list[dict] = ()) -> list[dict]:
    """Each step's begin phase, iterations begun, counter changes, seconds of graph
    generation and kind.

    ``records`` are the worker's, one per iteration Terra began: the step under way
    (0-based), the phase it began in and the counters at that moment, when every earlier
    iteration has been closed and counted; ``final`` the counters at the run's end;
    ``generations`` the step and seconds of each graph generation. A step's changes are its
    counters at the next step's first iteration (or ``final``) less those at its own first
    iteration, so the closing of a step's iteration, which happens at the next tape entry,
    is the step's own."""
    generation_s = [0.0] * steps
    for generation in generations:
        if 0 <= generation["step"] < steps:
            generation_s[generation["step"]] += generation["seconds"]
    first, begun = {}, [0] * steps
    for record in records:
        if 0 <= record["step"] < steps:
            begun[record["step"]] += 1
            first.setdefault(record["step"], record)
    at = [None] * steps + [final]  # counters where each step's first iteration began
    for k in reversed(range(steps)):
        at[k] = first.get(k, at[k + 1])
    rows = []
    for k in range(steps):
        delta = {c: at[k + 1][c] - at[k][c] for c in COUNTERS}
        phase = first[k]["phase"] if k in first else None
        rows.append(dict(phase=phase, begun=begun[k], generation_s=generation_s[k],
                         kind=step_kind(phase, delta, generation_s[k] > 0), **delta))
    return rows


def timeline(kinds: list) -> str:
    return "".join(LETTERS.get(kind, OTHER) for kind in kinds)


# -- the figures of one pair of runs --------------------------------------------------------
def pair_figures(eager_s: list[float], terra_s: list[float], steps: list[dict],
                 final: dict) -> dict:
    """The start-up figures of one eager run and one Terra run of the same program (per-step
    seconds, the Terra run's ``per_step`` rows and its closing counters); steps 1-based."""
    if len(eager_s) != len(terra_s) or len(steps) != len(terra_s) or not terra_s:
        raise ValueError(f"{len(eager_s)} eager steps, {len(terra_s)} Terra steps, "
                         f"{len(steps)} step kinds")
    unit = statistics.median(eager_s)
    excess, lag = [], 0.0  # cumulative Terra time less cumulative eager time, per step
    for e, t in zip(eager_s, terra_s):
        lag += t - e
        excess.append(lag)
    behind = [k for k, lag in enumerate(excess) if lag >= 0]  # Terra not ahead (0-based)
    kinds = [s["kind"] for s in steps]
    of_kind = {}  # kind -> Terra's times of the steps of that kind
    for t, kind in zip(terra_s, kinds):
        of_kind.setdefault(kind, []).append(t)
    peak = excess.index(max(excess))
    # where the start-up went: up to its peak, per kind of step, Terra's time less eager's
    # for the same steps, in eager steps (graph generation apart from the step it ran in);
    # the co-executed steps' share is what they had earned back by then (negative)
    cost = {}
    for e, t, step in zip(eager_s[:peak + 1], terra_s[:peak + 1], steps):
        generation = step.get("generation_s", 0.0)
        cost[step["kind"]] = cost.get(step["kind"], 0.0) + t - e - generation
        if generation:
            cost["generation"] = cost.get("generation", 0.0) + generation
    return dict(
        eager_step_ms=1e3 * unit,
        startup_steps=max(0.0, excess[peak]) / unit,
        peak_step=peak + 1,
        pays_back_from=None if excess[-1] >= 0 else (behind[-1] + 2 if behind else 1),
        traced_ratio=_ratio(of_kind.get("traced"), unit),
        coexecuted_ratio=_ratio(of_kind.get("coexecuted"), unit),
        cost_by_kind={kind: round(seconds / unit, 2) for kind, seconds in cost.items()},
        generation_s=sum(step.get("generation_s", 0.0) for step in steps),
        first_coexecuted=kinds.index("coexecuted") + 1 if "coexecuted" in kinds else None,
        coexecuted_steps=kinds.count("coexecuted"),
        traced_steps=kinds.count("traced"),
        fallback_steps=kinds.count("fallback"),
        other_steps=len(kinds) - sum(kinds.count(k) for k in ("coexecuted", "traced",
                                                              "fallback")),
        **{c: final[c] for c in COUNTERS},
        whole_run_ratio=sum(eager_s) / sum(terra_s),
        timeline=timeline(kinds),
    )


def _ratio(times, unit):
    return statistics.median(times) / unit if times else None


def _median(values, never=False):
    """Median of the values; with ``never``, None stands for "never" (after every number) and
    is the median if at least half are None."""
    if never:
        values = [math.inf if v is None else v for v in values]
        m = statistics.median_low(values) if values else math.inf
        return None if m == math.inf else m
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


NEVER = ("pays_back_from", "first_coexecuted")  # None means never within the run
NUMERIC = ("eager_step_ms", "startup_steps", "peak_step", "pays_back_from", "traced_ratio",
           "coexecuted_ratio", "generation_s", "first_coexecuted", "coexecuted_steps",
           "traced_steps", "fallback_steps", "other_steps", *COUNTERS, "whole_run_ratio")


def program_row(suite: str, program: str, pairs: list[tuple[dict, dict]]) -> dict:
    """One program's row: the medians over its repeats of each pair's figures, the first
    pair's timeline and start-up by kind, whether Terra's losses were eager's in every pair,
    and the first error."""
    row = dict(suite=suite, program=program, repeats=len(pairs))
    figures, errors, matches = [], [], []
    for eager, terra in pairs:
        failed = [r for r in (eager, terra) if "error" in r or "report_error" in r]
        if failed:
            r = failed[0]
            errors.append(f"{r['mode']}: {r.get('error') or r['report_error']}")
            continue
        steps = per_step(terra["iterations"], terra["final"], terra["steps"],
                         terra.get("generations", ()))
        figures.append(pair_figures(eager["step_s"], terra["step_s"], steps, terra["final"]))
        mismatch, _ = compare_losses(terra["losses"], eager["losses"], RTOL, ATOL)
        matches.append(mismatch or "match")
    if errors:
        row["error"] = errors[0]
    if not figures:
        return row
    for key in NUMERIC:
        row[key] = _median([f[key] for f in figures], never=key in NEVER)
    row["timeline"] = figures[0]["timeline"]
    row["cost_by_kind"] = figures[0]["cost_by_kind"]
    row["losses"] = next((m for m in matches if m != "match"), "match")
    return row


def _geomean(values):
    values = [v for v in values if v is not None]
    if not values or min(values) <= 0:
        return None
    return math.exp(statistics.fmean(math.log(v) for v in values))


# the ratios (and the start-up, in eager steps): geometric means
GEOMETRIC = ("startup_steps", "traced_ratio", "coexecuted_ratio", "whole_run_ratio")


def summary_rows(rows: list[dict]) -> list[dict]:
    """A set's median row (of every figure; "never" counted after every step) and geometric
    mean row (of the ratios and the start-up, where every value is positive)."""
    ok = [r for r in rows if "whole_run_ratio" in r]
    if not ok:
        return []
    label = f"{ok[0]['suite']}: " if len({r["suite"] for r in rows}) == 1 else ""
    median = dict(program=f"{label}median ({len(ok)})", summary=True)
    for key in NUMERIC:
        median[key] = _median([r.get(key) for r in ok], never=key in NEVER)
    geomean = dict(program=f"{label}geometric mean", summary=True)
    for key in GEOMETRIC:
        geomean[key] = _geomean([r.get(key) for r in ok])
    return [median, geomean]


# -- the table ----------------------------------------------------------------------------------
HEADER = ("program", "eager ms/step", "start-up (eager steps)", "pays back from step",
          "traced / eager", "co-executed / eager", "first co-executed", "co-executed",
          "traces", "generations", "fallbacks", "eager / Terra", "losses", "timeline")


def _fmt(value, digits=1, never="-"):
    if value is None:
        return never
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.{digits}f}"
    return str(int(value)) if isinstance(value, float) else str(value)


def table(rows: list[dict], steps: int) -> str:
    """The markdown table: every program, each set followed by its summary rows."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        if "error" in row and "whole_run_ratio" not in row:
            cells = [row["program"], *["-"] * 11, f"FAIL ({row['error'][:80]})", ""]
        else:
            summary = row.get("summary")
            never = "-" if summary and "median" not in row["program"] else f"never ({steps})"
            cells = [
                f"**{row['program']}**" if summary else row["program"],
                _fmt(row.get("eager_step_ms")),
                _fmt(row.get("startup_steps")),
                _fmt(row.get("pays_back_from"), never=never),
                _fmt(row.get("traced_ratio"), 2),
                _fmt(row.get("coexecuted_ratio"), 2),
                _fmt(row.get("first_coexecuted"), never=never),
                _fmt(row.get("coexecuted_steps")),
                _fmt(row.get("traces")),
                _fmt(row.get("graph_generations")),
                _fmt(row.get("fallbacks")),
                _fmt(row.get("whole_run_ratio"), 2),
                "" if summary else row.get("losses", "") + (" (a repeat failed)"
                                                             if "error" in row else ""),
                f"`{row['timeline']}`" if row.get("timeline") else "",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def with_summaries(rows: list[dict]) -> list[dict]:
    """The rows with each set's summary rows after its programs."""
    out = []
    for suite in SUITES:
        mine = [r for r in rows if r["suite"] == suite]
        if mine:
            out += mine + summary_rows(mine)
    return out


# -- running --------------------------------------------------------------------------------------
def programs_of(suite: str) -> list[str]:
    """A set's programs; the corpus' whose library is installed."""
    if suite == "ten":
        return list(PAPER)
    if suite == "control_flow":
        return list(control_flow.PROGRAMS)
    return [name for name in CORPUS if not missing(name)]


def _env(suite: str, program: str) -> dict:
    """The Keras each run uses: the corpus program's own switches, Keras 3 for the rest."""
    return dict(CORPUS[program].env) if suite == "corpus" else keras_env(3)


def measure(selected, steps, repeats, seed, timeout, log) -> list[dict]:
    """Every run: per program and repeat, eager and Terra back to back in fresh processes,
    the order swapped each repeat so that drifting load hits both alike."""
    runs, total, started = [], 2 * repeats * len(selected), time.perf_counter()
    for suite, program in selected:
        for repeat in range(repeats):
            for mode in ("eager", "terra") if repeat % 2 == 0 else ("terra", "eager"):
                log(f"[{len(runs) + 1}/{total}] {program} {mode} (repeat {repeat + 1}) ...")
                spec = dict(suite=suite, program=program, mode=mode, steps=steps, seed=seed)
                result = run_worker("benchmarks.startup_worker", spec, timeout,
                                    _env(suite, program))
                result["repeat"] = repeat
                runs.append(result)
                outcome = result.get("error") or f"{sum(result['step_s']):.1f} s of steps"
                log(f"    {outcome}  ({time.perf_counter() - started:.0f} s total)")
    return runs


def rows_of(runs: list[dict], selected) -> list[dict]:
    rows = []
    for suite, program in selected:
        mine = {(r["mode"], r["repeat"]): r for r in runs if r["program"] == program}
        repeats = sorted({k for _, k in mine})
        pairs = [(mine[("eager", k)], mine[("terra", k)]) for k in repeats]
        rows.append(program_row(suite, program, pairs))
    return rows


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.startup",
                                description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--set", default="ten",
                   help="ten (the paper's ten programs), control_flow, corpus or all; "
                        "comma-separated for several (default ten)")
    p.add_argument("--programs", help="comma-separated names of any set (default: the "
                                      "set's programs)")
    p.add_argument("--steps", type=int, default=30, help="steps per run (default 30)")
    p.add_argument("--repeats", type=int, default=1, help="paired repeats (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per run")
    p.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    p.add_argument("--table", type=Path, metavar="JSON",
                   help="run nothing: print the table of the runs in a startup.json written "
                        "before (after a change to how the figures are computed)")
    args = p.parse_args(argv)
    suites = []
    for name in args.set.split(","):
        for suite in SUITES if name.strip() == "all" else [name.strip()]:
            if suite not in SUITES:
                p.error(f"unknown set {suite!r}; known: {', '.join(SUITES)}, all")
            if suite not in suites:
                suites.append(suite)
    if args.programs:
        owner = {n: s for s in SUITES for n in (programs_of(s) if s != "corpus" else CORPUS)}
        args.selected = []
        for name in args.programs.split(","):
            if name.strip() not in owner:
                p.error(f"unknown program {name.strip()!r}")
            args.selected.append((owner[name.strip()], name.strip()))
    else:
        args.selected = [(s, n) for s in suites for n in programs_of(s)]
    if args.steps < 2 or args.repeats < 1:
        p.error("--steps must be at least 2 and --repeats at least 1")
    return args


def main(argv=None, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.table:
        saved = json.loads(args.table.read_text())
        selected = list(dict.fromkeys((r["suite"], r["program"]) for r in saved["runs"]))
        print(table(with_summaries(rows_of(saved["runs"], selected)), saved["meta"]["steps"]))
        return 0
    runs = measure(args.selected, args.steps, args.repeats, args.seed, args.timeout, log)
    rows = with_summaries(rows_of(runs, args.selected))
    text = table(rows, args.steps)
    print(text)
    meta = dict(command="python -m benchmarks.startup " + shlex.join(argv),
                date=datetime.datetime.now().isoformat(timespec="seconds"),
                revision=revision(), python=platform.python_version(),
                cpus=os.cpu_count(), steps=args.steps, repeats=args.repeats, seed=args.seed,
                terra_env={k: v for k, v in os.environ.items() if k.startswith("TERRA_")})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "startup.json").write_text(json.dumps(dict(meta=meta, rows=rows, runs=runs),
                                                      indent=1))
    (args.out / "startup.md").write_text(f"`{meta['command']}` at {meta['revision']} "
                                         f"({meta['date']})\n\n{text}\n")
    log(f"wrote {args.out / 'startup.json'}, {args.out / 'startup.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
