"""``python -m benchmarks.corpus [--quick] [--programs a,b] [--steps N] [--repeats R]
[--function]``: the corpus table.

Progress goes to stderr, the markdown table to stdout. The exit code is 1 if any program's Terra
run differs from its eager run (or either failed), so a script can rely on it.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.corpus import REGISTRY, missing
from benchmarks.corpus.driver import run_program, table

DEFAULT_STEPS = 40  # Terra's cost budget judges a program after 30+ iterations
QUICK_STEPS = 30


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.corpus", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the small subset CI runs")
    parser.add_argument("--programs", help="comma-separated names (default: all)")
    parser.add_argument("--steps", type=int, help=f"steps per run (default {DEFAULT_STEPS}, "
                                                  f"{QUICK_STEPS} with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="paired eager/Terra runs per program; speeds are their medians "
                             "(default 3)")
    parser.add_argument("--function", action="store_true",
                        help="also time each program's step inside tf.function (AutoGraph), "
                             "where the program provides one")
    args = parser.parse_args(argv)
    names = (args.programs.split(",") if args.programs else
             [n for n, e in REGISTRY.items() if e.quick or not args.quick])
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        parser.error(f"unknown programs {unknown}; known: {', '.join(REGISTRY)}")
    steps = args.steps or (QUICK_STEPS if args.quick else DEFAULT_STEPS)
    rows = []
    for name in names:
        lacking = missing(name)
        if lacking:
            print(f"{name}: skipped, not installed: {', '.join(lacking)}", file=sys.stderr)
            continue
        start = time.perf_counter()
        modes = "eager, under Terra and in tf.function" if args.function else \
            "eager and under Terra"
        print(f"{name}: {steps} steps {modes}, {args.repeats} set(s) ...",
              file=sys.stderr, flush=True)
        row = run_program(name, steps, args.seed, repeats=args.repeats, function=args.function)
        print(f"    {'match' if row['match'] else 'MISMATCH: ' + row['detail']}, "
              f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        rows.append(row)
    print(table(rows))
    return 0 if all(row["match"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
