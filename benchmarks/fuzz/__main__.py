"""``python -m benchmarks.fuzz --count N --seed S [--steps K] [--jobs J]``: the CLI.

Prints one line per failing program as it is found, writes each failing program (and, for the
first program of each symptom, its minimized form) to ``--out``, and ends with the summary line
``N programs, M mismatches, C crashes, H hangs, E co-executed``.
"""

import argparse
import sys

from .driver import Options, fuzz
from .minimize import DEFAULT_TRIALS
from .program import DEFAULT_STEPS, feature_names
from .runner import DEFAULT_TIMEOUT


def parse(argv=None) -> Options:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fuzz", description=__doc__)
    parser.add_argument("--count", type=int, default=40, help="programs to generate")
    parser.add_argument("--seed", type=int, default=0, help="program seeds are S, S+1, ...")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps per program")
    parser.add_argument("--jobs", type=int, default=1, help="programs run at once")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="seconds per process; a Terra run over it is a hang")
    parser.add_argument("--out", default="fuzz-failures", help="where failing programs go")
    parser.add_argument("--only", default="", help="comma-separated features to draw from")
    parser.add_argument("--disable", default="", help="comma-separated features never drawn")
    parser.add_argument("--min-trials", type=int, default=DEFAULT_TRIALS,
                        help="runs the minimizer may spend per symptom (0: no minimizing)")
    parser.add_argument("--record", default="",
                        help="append one JSON line per program (draw, verdict, stats) here")
    parser.add_argument("--resume", action="store_true",
                        help="skip the programs --record already holds (a campaign in parts)")
    parser.add_argument("--show", action="store_true",
                        help="print the source of program S and exit")
    args = parser.parse_args(argv)
    if args.resume and not args.record:
        parser.error("--resume needs --record (the file of the programs already run)")
    split = lambda text: [name for name in text.split(",") if name]
    try:
        feature_names(split(args.only), split(args.disable))
    except ValueError as error:
        parser.error(str(error))
    return Options(count=args.count, seed=args.seed, steps=args.steps, jobs=args.jobs,
                   timeout=args.timeout, out=args.out, only=split(args.only),
                   disabled=split(args.disable), min_trials=args.min_trials, show=args.show,
                   record=args.record, resume=args.resume)


if __name__ == "__main__":
    sys.exit(fuzz(parse()))
