"""``python -m benchmarks``: eager vs AutoGraph vs Terra on the benchmark programs.

For each program, each repeat runs every mode once (order rotated per repeat), each run in a
fresh worker process, one at a time. Prints progress on stderr and a table on stdout; writes
``results.json``, ``results.md`` and ``speedup.png`` into ``--out``. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from pathlib import Path

from benchmarks import harness, report
from benchmarks.modes import MODES
from benchmarks.programs import PAPER, REGISTRY
from benchmarks.worker import KERAS_VERSIONS

DEFAULT_PROGRAMS = "mlp,convnet"
DEFAULT_MODES = "eager,autograph,terra"


def _names(text: str, known, what: str) -> list[str]:
    aliases = {"all": list(known), "paper": PAPER}
    names = []
    for name in text.split(","):
        name = name.strip()
        for n in aliases.get(name, [name]):
            if n not in known:
                raise SystemExit(f"unknown {what} {n!r}; known: {', '.join(known)}")
            if n not in names:
                names.append(n)
    return names


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", default=DEFAULT_PROGRAMS,
                   help=f"comma-separated, or 'all' / 'paper' (default {DEFAULT_PROGRAMS}); "
                        f"known: {', '.join(REGISTRY)}")
    p.add_argument("--modes", default=DEFAULT_MODES,
                   help=f"comma-separated or 'all' (default {DEFAULT_MODES}; eager is always "
                        f"added as the baseline); known: {', '.join(MODES)}")
    p.add_argument("--steps", type=int, help="timed steps per run (default: per program)")
    p.add_argument("--warmup", type=int, help="warm-up steps per run (default: per program)")
    p.add_argument("--repeats", type=int, default=3, help="paired repeats (default 3)")
    p.add_argument("--config", choices=("quick", "large"), default="quick")
    p.add_argument("--keras", type=int, choices=KERAS_VERSIONS, default=3,
                   help="Keras the programs are built with: 3 (default) or 2 (tf_keras: every "
                        "worker runs with TF_USE_LEGACY_KERAS=1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results"), help="output directory")
    p.add_argument("--rtol", type=float, default=1e-4,
                   help="relative tolerance of the loss comparison with eager (default 1e-4)")
    p.add_argument("--xla-rtol", type=float, default=1e-3,
                   help="relative tolerance for XLA modes, whose fused kernels round "
                        "differently (default 1e-3)")
    p.add_argument("--atol", type=float, default=1e-6,
                   help="absolute tolerance of the loss comparison (default 1e-6)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    p.add_argument("--inprocess", action="store_true",
                   help="run everything in this process (for debugging: no crash isolation, "
                        "no per-mode peak memory, state may leak between modes)")
    args = p.parse_args(argv)
    args.programs = _names(args.programs, REGISTRY, "program")
    modes = _names(args.modes, MODES, "mode")
    args.modes = ["eager"] + [m for m in modes if m != "eager"]
    if args.repeats < 1 or (args.steps is not None and args.steps < 1):
        p.error("--repeats and --steps must be at least 1")
    return args


def _tf_version() -> str:
    for dist in ("tensorflow-cpu", "tensorflow"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return "?"


def _keras_version(keras: int, runs) -> str:
    """The Keras version(s) the runs recorded, else the installed one that was asked for."""
    ran = sorted({r["keras_version"] for r in runs if "keras_version" in r})
    return ", ".join(ran) or importlib.metadata.version("tf_keras" if keras == 2 else "keras")


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} CPUs"


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    steps = {p: args.steps or REGISTRY[p].steps for p in args.programs}
    warmup = {p: REGISTRY[p].warmup if args.warmup is None else args.warmup
              for p in args.programs}
    runs = harness.measure(args.programs, args.modes, config=args.config, steps=steps,
                           warmup=warmup, repeats=args.repeats, seed=args.seed,
                           timeout=args.timeout, inprocess=args.inprocess, keras=args.keras)
    rows = harness.summarize(runs, args.programs, args.modes, args.rtol, args.atol,
                             args.xla_rtol)
    meta = dict(
        command="python -m benchmarks " + shlex.join(sys.argv[1:] if argv is None else argv),
        date=datetime.datetime.now().isoformat(timespec="seconds"), machine=_machine(),
        tensorflow=_tf_version(), keras=_keras_version(args.keras, runs),
        python=platform.python_version(), programs=args.programs, modes=args.modes,
        config=args.config, steps=steps, warmup=warmup, repeats=args.repeats, seed=args.seed,
        rtol=args.rtol, xla_rtol=args.xla_rtol, atol=args.atol,
        isolation="in-process" if args.inprocess else "one worker process per run")
    print(report.text_table(rows))
    paths = report.write(rows, runs, meta, args.out, args.programs, args.modes)
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
