"""``python -m benchmarks.pipeline``: the pipeline schedules' simulated bubbles and memory next to
the papers' closed forms, as Markdown tables on stdout, and their charts as a PNG.

Nothing here is timed: the simulator is exact, so the tables are the same on every machine.
See docs/pipeline.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from terra.pipeline import formulas as f
from terra.pipeline import schedule, simulate
from terra.pipeline.charts import png_chart

PAPER = {"forward": 1, "backward": 2}       # GPipe, 1F1B, interleaved, BitPipe: B = 2F
TWO_BP = {"forward": 1, "backward": 1, "weight": 1}  # 2BP's Table 1: F = p1 = p2


def _cell(value) -> str:
    return f"{value} ({float(value):.4f})"


def bubble_rows():
    """(schedule, D, N, simulated, formula, peak on device 0, its formula) for every size."""
    rows = []
    for D in (4, 8):
        for N in (D, 2 * D, 4 * D):
            cases = [("gpipe", 1, PAPER, f.gpipe(D, N), N),
                     ("1f1b", 1, PAPER, f.gpipe(D, N), min(D, N)),
                     ("interleaved v=2", 2, PAPER, f.interleaved(D, N, 2), None),
                     ("2bp-gpipe", 1, TWO_BP, f.twobp_gpipe(D, N), None),
                     ("2bp-1f1b", 1, TWO_BP, f.twobp_1f1b(D, N), None),
                     ("bitpipe", 2, PAPER, f.bitpipe(D, N), None),
                     ("bpipe", 1, PAPER, f.gpipe(D, N), f.bpipe_limit(D))]
            for name, chunks, costs, formula, held in cases:
                result = simulate(schedule(name.split()[0], D, N, chunks=chunks), **costs)
                peak = result.peak_activations[0]
                rows.append((name, D, N, result.bubble_ratio, formula, peak, held))
    return rows


def print_bubbles():
    print("| schedule | D | N | bubble, simulated | bubble, paper's formula | equal | "
          "held on device 0 | paper |")
    print("|---|---|---|---|---|---|---|---|")
    for name, D, N, simulated, formula, peak, held in bubble_rows():
        print(f"| {name} | {D} | {N} | {_cell(simulated)} | {_cell(formula)} | "
              f"{'yes' if simulated == formula else '**no**'} | {peak} | "
              f"{'' if held is None else held} |")


def print_table1():
    print("| N | schedule | without 2BP (sim / Table 1) | with 2BP (sim / Table 1) |")
    print("|---|---|---|---|")
    for N in (4, 8):
        table = f.twobp_table1(N)
        for row, (plain, split, micro) in f.twobp_table1_runs(N).items():
            without = simulate(schedule(plain, N, micro), **TWO_BP).bubble_ratio
            with_2bp = simulate(schedule(split, N, micro), **TWO_BP).bubble_ratio
            print(f"| {N} | {row} | {without} / {table[row][0]} | {with_2bp} / "
                  f"{table[row][1]} |")


def print_bpipe():
    print("| p | m | 1F1B held per stage | BPipe held per stage | ceil((p+2)/2) | evictors |")
    print("|---|---|---|---|---|---|")
    for p in (4, 8):
        for m in (p, 2 * p, 4 * p):
            plain = simulate(schedule("1f1b", p, m), **PAPER).peak_activations
            balanced = simulate(schedule("bpipe", p, m), **PAPER).peak_activations
            print(f"| {p} | {m} | {', '.join(map(str, plain))} | "
                  f"{', '.join(map(str, balanced))} | {f.bpipe_limit(p)} | "
                  f"{f.bpipe_evictors(p)} |")


CHARTED = [("gpipe", 1, 8), ("1f1b", 1, 8), ("interleaved", 2, 8), ("2bp-1f1b", 1, 8),
           ("bitpipe", 2, 4), ("bpipe", 1, 8)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", default="docs/pipeline.png",
                        help="where to draw the charts (needs matplotlib); '' to skip")
    parser.add_argument("--text", action="store_true",
                        help="also print each charted schedule as text")
    args = parser.parse_args(argv)
    print("## Bubble ratio and held activations, simulated vs the papers\n")
    print_bubbles()
    print("\n## 2BP, Table 1 (N pipeline processes, forward = p1 = p2)\n")
    print_table1()
    print("\n## BPipe, micro-batches held per stage (backward = 2 x forward)\n")
    print_bpipe()
    plans = [schedule(kind, 4, n, chunks=chunks) for kind, chunks, n in CHARTED]
    if args.text:
        for plan in plans:
            print(f"\n```\n{plan}\n```")
    if args.png:
        Path(args.png).parent.mkdir(parents=True, exist_ok=True)
        png_chart(plans, args.png)
        print(f"\nCharts: {args.png}")


if __name__ == "__main__":
    main()
