"""``python -m benchmarks.control_flow``: the control-flow test programs, eager vs Terra.

The programs of ``tests/test_control_flow_differential.py`` (an if/else, loops of varying trip
count, recursion, ...), run for ``--steps`` training steps eagerly and under Terra in this
process. Prints, per program, Terra's traces, fallbacks and co-executed iterations, and the step
time of each (median of the last ``--last`` steps: the time between two entries into the
tape). Correctness is the tests' job; this measures what the tests do not: speed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

PROGRAMS = ("counter_branch", "loss_branch", "sdpoint_like", "try_except", "generator_loop",
            "helper_two_sites", "recursion", "late_path", "shared_layer_repeated",
            "rnn_varying_length", "shrinking_loop", "growing_loop", "rnn_longer_later",
            "until_the_norm_grows")


def _timed(tape_base):
    """A tape class that notes when each step enters it, and the list it notes into."""
    stamps = []

    class Tape(tape_base):
        def __enter__(self):
            stamps.append(time.perf_counter())
            return super().__enter__()

    return Tape, stamps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--last", type=int, default=24, help="steps the median is taken over")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import tensorflow as tf
    import test_control_flow_differential as programs

    import terra

    print("| program | traces | fallbacks | co-executed | eager ms | Terra ms | Terra/eager |")
    print("|---|---|---|---|---|---|---|")
    for name in args.programs.split(","):
        step_ms = {}
        for label, base in (("eager", tf.GradientTape), ("terra", terra.TerraGradientTape)):
            terra.reset()
            tape, stamps = _timed(base)
            getattr(programs, name)(tape, args.steps)
            gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][-args.last:]
            step_ms[label] = 1e3 * statistics.median(gaps)
            stats = terra.stats()
        terra.reset()
        print(f"| {name} | {stats.traces} | {stats.fallbacks} | {stats.coexecuted}/{args.steps} | "
              f"{step_ms['eager']:.1f} | {step_ms['terra']:.1f} | "
              f"x{step_ms['eager'] / step_ms['terra']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
