"""``python -m benchmarks.distribute``: MirroredStrategy training, eager, Terra and tf.function.

TensorFlow's custom-loop recipe for ``tf.distribute`` (``benchmarks/distribute_worker.py``: a
Keras 3 MLP 128-256-256-10, global batch 64, Adam, synthetic data from a fixed seed) on 1, 2
and 4 replicas, each a logical CPU, in three modes: ``eager`` (the recipe run eagerly),
``terra`` (the same code after ``terra.enable()``) and ``function`` (the distributed step in
``tf.function``, TensorFlow's advice for speed). Terra co-executes the ops of one thread, and
an eager ``strategy.run`` runs each replica's step in a thread of its own, new for every call:
today Terra's tapes there act as plain ``tf.GradientTape``s (docs/distribute.md). This
benchmark measures what happens, whatever that is, and reports Terra's counters with it.

Runs are measured as ``python -m benchmarks`` measures them (docs/benchmarks.md): one fresh
process per (replicas, mode, repeat), one at a time, since the CPU is split into logical
devices before TensorFlow initialises and cannot be split again; paired repeats, the modes'
order rotated by one per repeat so the shared machine's drifting load hits each alike; steps/s
the median over repeats, ratios the median of the per-repeat ratios. Every step's loss (warm-up
and timed) is compared with eager's of the same repeat: Terra's bit for bit (it claims eager's
numbers), tf.function's within ``--rtol``/``--atol`` (its graph may fuse and round otherwise),
eager's with its own first repeat (a run that is not deterministic would void the check).

Writes ``distribute.json`` (every run, every loss), ``distribute.md`` (the table) and
``distribute.png`` (steps/s per replica count and mode) to ``--out``.
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

from benchmarks.harness import compare_losses, run_worker
from benchmarks.report import revision
from benchmarks.worker import keras_env

MODES = ("eager", "terra", "function")
LABELS = {"eager": "eager", "terra": "Terra", "function": "tf.function"}
COUNTERS = ("iterations", "traces", "coexecuted", "plain_tapes", "fallbacks")
RTOL, ATOL = 1e-4, 1e-6  # tf.function's losses against eager's, as the main harness compares
TIMEOUT = 600.0


# -- running --------------------------------------------------------------------------------------
def measure(replicas, modes, *, steps, warmup, repeats, seed, timeout,
            log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> list[dict]:
    """Every run, as the worker's result plus ``repeat``: per replica count and repeat, every
    mode once in a fresh process, in an order rotated by one per repeat."""
    runs, started = [], time.perf_counter()
    total = len(replicas) * repeats * len(modes)
    for n in replicas:
        for repeat in range(repeats):
            shift = repeat % len(modes)
            for mode in modes[shift:] + modes[:shift]:
                log(f"[{len(runs) + 1}/{total}] {n} replica(s) {mode} (repeat {repeat + 1}) ...")
                spec = dict(mode=mode, replicas=n, steps=steps, warmup=warmup, seed=seed)
                result = run_worker("benchmarks.distribute_worker", spec, timeout, keras_env(3))
                result["repeat"] = repeat
                runs.append(result)
                outcome = (f"{result['steps_per_s']:.2f} steps/s" if "steps_per_s" in result
                           else result.get("error", "no result"))
                log(f"    {outcome}  ({time.perf_counter() - started:.0f} s total)")
    return runs


# -- the figures --------------------------------------------------------------------------------
def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _paired(mine: list[dict], base: list[dict]) -> list:
    """Per-repeat steps/s ratios (None where either run failed)."""
    return [a["steps_per_s"] / b["steps_per_s"] if "steps_per_s" in a and "steps_per_s" in b
            else None for a, b in zip(mine, base, strict=True)]


def check_losses(mode: str, mine: list[dict], eager: list[dict], rtol: float,
                 atol: float) -> dict:
    """Every repeat's losses against eager's of the same repeat: ``match`` (Terra: equal bit
    for bit; tf.function: within tolerance), ``WRONG`` (the first differing step), ``FAIL``
    (the run raised) or, for eager, ``NONDET`` if a repeat differs from its first; with the
    largest relative difference seen."""
    errors = [r["error"] for r in mine if "error" in r]
    if errors:
        return dict(status="FAIL", detail=errors[0], max_rel_diff=None)
    mismatches, max_rel = [], 0.0
    for k, run in enumerate(mine):
        ref = eager[0 if mode == "eager" else k]
        if "losses" not in ref:
            mismatches.append("eager failed")
            continue
        exact = mode in ("eager", "terra")
        mismatch, rel = compare_losses(run["losses"], ref["losses"], 0.0 if exact else rtol,
                                       0.0 if exact else atol)
        max_rel = max(max_rel, rel)
        if mismatch:
            mismatches.append(mismatch)
    if mismatches:
        return dict(status="NONDET" if mode == "eager" else "WRONG", detail=mismatches[0],
                    max_rel_diff=max_rel)
    return dict(status="match", detail="", max_rel_diff=max_rel)


def summarize(runs: list[dict], replicas, modes, rtol: float = RTOL,
              atol: float = ATOL) -> list[dict]:
    """One row per replica count: each mode's median steps/s, spread and loss check, the
    paired ratios, and Terra's counters (medians over the repeats)."""
    rows = []
    for n in replicas:
        mine = {m: sorted((r for r in runs if r["replicas"] == n and r["mode"] == m),
                          key=lambda r: r["repeat"]) for m in modes}
        row = dict(replicas=n, repeats=len(mine[modes[0]]), modes={})
        for mode in modes:
            sps = [r.get("steps_per_s") for r in mine[mode]]
            ok = [v for v in sps if v]
            row["modes"][mode] = dict(
                steps_per_s=sps, median_steps_per_s=_median(sps),
                spread_pct=(100 * (max(ok) - min(ok)) / 2 / statistics.median(ok)
                            if len(ok) > 1 else None),
                **check_losses(mode, mine[mode], mine["eager"], rtol, atol))
        for peer in ("eager", "function"):
            if "terra" in modes and peer in modes:
                ratios = _paired(mine["terra"], mine[peer])
                row[f"terra_x_{peer}"] = ratios
                row[f"median_terra_x_{peer}"] = _median(ratios)
        if "function" in modes:
            ratios = _paired(mine["function"], mine["eager"])
            row["function_x_eager"] = ratios
            row["median_function_x_eager"] = _median(ratios)
        stats = [r["terra_stats"] for r in mine.get("terra", []) if r.get("terra_stats")]
        if stats:
            row["terra_stats"] = {c: _median([s.get(c) for s in stats]) for c in COUNTERS}
            row["terra_phase"] = stats[-1].get("phase")
        explains = [r["explain"] for r in mine.get("terra", []) if r.get("explain")]
        if explains:
            row["explain"] = explains[-1]
        rows.append(row)
    return rows


# -- the table and the plot -------------------------------------------------------------------
HEADER = ("replicas", "eager steps/s", "Terra steps/s", "tf.function steps/s", "Terra x eager",
          "Terra x tf.function", "co-executed steps", "plain tapes", "losses vs eager")


def _sps(row, mode):
    m = row["modes"].get(mode)
    if m is None:
        return "-"
    if m["median_steps_per_s"] is None:
        return "FAIL"
    spread = f" (+-{m['spread_pct']:.0f}%)" if m.get("spread_pct") is not None else ""
    return f"{m['median_steps_per_s']:.2f}{spread}"


def _x(value):
    return "-" if value is None else f"x{value:.2f}"


def _num(value):
    return "-" if value is None else f"{value:g}"


def _losses(row):
    parts = []
    for mode in ("eager", "terra", "function"):
        m = row["modes"].get(mode)
        if m is None:
            continue
        if mode == "eager":
            if m["status"] != "match":
                parts.append(f"eager {m['status']}: {m['detail'][:80]}")
        elif m["status"] == "match":
            parts.append("Terra bit for bit" if mode == "terra" else
                         "tf.function bit for bit" if m["max_rel_diff"] == 0 else
                         f"tf.function within tolerance (at most {m['max_rel_diff']:.0e} "
                         "off)")
        else:
            parts.append(f"{LABELS[mode]} {m['status']}: {m['detail'][:80]}")
    return "; ".join(parts)


def table(rows: list[dict], steps: int, warmup: int) -> str:
    """The markdown table: steps/s (median, +- half the range in % of it), the paired ratios,
    Terra's counters over the whole run and the loss checks."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for row in rows:
        stats = row.get("terra_stats") or {}
        total = warmup + steps
        coexecuted = stats.get("coexecuted")
        cells = [str(row["replicas"]), _sps(row, "eager"), _sps(row, "terra"),
                 _sps(row, "function"), _x(row.get("median_terra_x_eager")),
                 _x(row.get("median_terra_x_function")),
                 "-" if coexecuted is None else f"{coexecuted:g} of {total}",
                 _num(stats.get("plain_tapes")), _losses(row)]
        lines.append("| " + " | ".join(cells).replace("\n", " ") + " |")
    return "\n".join(lines)


def plot(rows: list[dict], modes, path: Path) -> None:
    """Steps/s per replica count, a bar per mode (a log scale: tf.function is tens of times
    eager), with each repeat's value as a dot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        for i, row in enumerate(rows):
            m = row["modes"][mode]
            x = i + (j - (len(modes) - 1) / 2) * width
            if m["median_steps_per_s"] is None:
                ax.text(x, 1, "X", ha="center", va="bottom", color=f"C{j}", fontweight="bold")
                continue
            repeats = [v for v in m["steps_per_s"] if v]
            ax.bar(x, m["median_steps_per_s"], width, color=f"C{j}",
                   label=LABELS[mode] if i == 0 else None,
                   hatch="//" if m["status"] != "match" else None)
            ax.plot([x] * len(repeats), repeats, "k.", markersize=3)
            ax.text(x, max(repeats) * 1.1, f"{m['median_steps_per_s']:.1f}", ha="center",
                    va="bottom", fontsize="x-small")
    values = [v for row in rows for mode in modes for v in row["modes"][mode]["steps_per_s"]
              if v]
    ax.set_yscale("log")
    if values:  # whole decades, so that bars of similar height still show as bars
        ax.set_ylim(10 ** math.floor(math.log10(min(values))),
                    10 ** math.ceil(math.log10(max(values) * 1.5)))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{row['replicas']} replica{'s' * (row['replicas'] > 1)}"
                        for row in rows])
    ax.set_ylabel("training steps/s (median; dots: repeats)")
    ax.set_title("MirroredStrategy on logical CPUs (hatched: losses differ)")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the command -------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.distribute",
                                description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--replicas", type=_ints, default=[1, 2, 4],
                   help="replica counts, comma-separated (default 1,2,4)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated of {', '.join(MODES)} (default all; eager is "
                        "always run: the reference)")
    # a run's own TensorFlow start-up (~10 s on a busy machine) dwarfs its steps: two
    # repeats keep the default command near 5 minutes; more steady the medians
    p.add_argument("--steps", type=int, default=30, help="timed steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per run (default 5)")
    p.add_argument("--repeats", type=int, default=2, help="paired repeats (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=RTOL, help="tf.function's losses vs eager's")
    p.add_argument("--atol", type=float, default=ATOL)
    p.add_argument("--timeout", type=float, default=TIMEOUT, help="seconds per run "
                                                                  f"(default {TIMEOUT:g})")
    p.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    p.add_argument("--table", type=Path, metavar="JSON",
                   help="run nothing: write the table and the plot of the runs in a "
                        "distribute.json written before to --out (after a change to how they "
                        "are drawn)")
    args = p.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    args.modes = ["eager"] + [m for m in MODES if m in modes and m != "eager"]
    if not args.replicas or min(args.replicas) < 1:
        p.error("--replicas needs counts of at least 1")
    if args.steps < 1 or args.warmup < 1 or args.repeats < 1:
        p.error("--steps, --warmup and --repeats must be at least 1 (a warm-up step traces "
                "tf.function's step and fills the dataset's pipeline outside the timing)")
    return args


def main(argv=None, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.table:
        saved = json.loads(args.table.read_text())
        write(saved["meta"], saved["runs"], args.out, log)
        return 0
    started = time.perf_counter()
    runs = measure(args.replicas, args.modes, steps=args.steps, warmup=args.warmup,
                   repeats=args.repeats, seed=args.seed, timeout=args.timeout, log=log)
    meta = dict(command=" ".join(["python -m benchmarks.distribute", shlex.join(argv)]).strip(),
                date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                revision=revision(), python=platform.python_version(), cpus=os.cpu_count(),
                replicas=args.replicas, modes=args.modes, steps=args.steps,
                warmup=args.warmup, repeats=args.repeats, seed=args.seed, rtol=args.rtol,
                atol=args.atol, wall_s=round(time.perf_counter() - started, 1),
                tensorflow=next((r["tensorflow"] for r in runs if "tensorflow" in r), None),
                keras=next((r["keras_version"] for r in runs if "keras_version" in r), None),
                terra_env={k: v for k, v in os.environ.items() if k.startswith("TERRA_")})
    write(meta, runs, args.out, log)
    return 0


def write(meta: dict, runs: list[dict], out: Path, log) -> None:
    """Summarize the runs; print the table and write it, the JSON and the plot to ``out``."""
    rows = summarize(runs, meta["replicas"], meta["modes"], meta["rtol"], meta["atol"])
    text = table(rows, meta["steps"], meta["warmup"])
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "distribute.json").write_text(json.dumps(dict(meta=meta, rows=rows, runs=runs),
                                                    indent=1))
    (out / "distribute.md").write_text(
        f"`{meta['command'].strip()}` at {meta['revision']} ({meta['date']}; TensorFlow "
        f"{meta['tensorflow']}, Keras {meta['keras']}, Python {meta['python']}, "
        f"{meta['cpus']} CPUs; {meta['warmup']} warm-up and {meta['steps']} timed steps, "
        f"{meta['repeats']} paired repeat(s))\n\n{text}\n")
    plot(rows, meta["modes"], out / "distribute.png")
    log(f"wrote {out / 'distribute.json'}, {out / 'distribute.md'}, "
        f"{out / 'distribute.png'}")


if __name__ == "__main__":
    raise SystemExit(main())
