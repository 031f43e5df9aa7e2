"""``python -m benchmarks.soak``: long co-executed runs, watching the process's memory.

Co-execution hands out stand-in tensors, queues values between two threads, keeps a hook table
and freezes the garbage collector after each graph generation: anything one iteration leaves
behind grows with the run. Two programs run for ``--iterations`` steps each under Terra:

- ``mlp``: a small MLP trained with a Keras optimizer, one path;
- ``alternating``: the same model with a Python ``if step % 2`` inside the tape, so consecutive
  iterations take the two cases of a switch-case.

The resident set size (``VmRSS``) is sampled every ``--sample-every`` iterations. RSS counts
as flat when the last sample is at most 5% above the sample at the end of the warm-up
(``--warmup`` iterations: graph generation and the allocator's first growth are over by then).
The budget is off (``TERRA_BUDGET=inf``): this measures a co-executed run, not whether Terra
would have chosen to co-execute a model this small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

os.environ.setdefault("TERRA_BUDGET", "inf")

import numpy as np  # noqa: E402 - after the budget is set: Terra reads it at import
import tensorflow as tf  # noqa: E402

import terra  # noqa: E402

FLAT_MARGIN = 0.05  # growth after the warm-up that still counts as flat


@dataclasses.dataclass
class Soak:
    """One program's run: Terra's counters and the RSS series ``[(iteration, MiB)]``."""

    program: str
    iterations: int
    coexecuted: int
    fallbacks: int
    rss: list[tuple[int, float]]
    warmup: int
    seconds: float

    @property
    def growth(self) -> float:
        """Last sample over the first sample at or after the warm-up, minus one."""
        base = next(mib for it, mib in self.rss if it >= self.warmup)
        return self.rss[-1][1] / base - 1.0

    @property
    def flat(self) -> bool:
        return self.growth <= FLAT_MARGIN


def rss_mib() -> float:
    """This process's resident set size in MiB (``VmRSS`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def _model():
    return tf.keras.Sequential([
        tf.keras.Input((32,)),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ])


def train(program: str, iterations: int, sample_every: int) -> list[tuple[int, float]]:
    """Train ``program`` for ``iterations`` steps under Terra; return the RSS samples. The
    loss is read every ``sample_every`` steps, as a training loop's logging would."""
    tf.keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1024, 32)).astype(np.float32)
    y = rng.integers(0, 10, 1024).astype(np.int32)
    model, optimizer = _model(), tf.keras.optimizers.Adam(1e-3)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    samples = []
    for step in range(iterations):
        start = (step * 32) % 1024
        xb, yb = x[start:start + 32], y[start:start + 32]
        with terra.TerraGradientTape() as tape:
            logits = model(xb, training=True)
            if program == "alternating" and step % 2:
                logits = logits * 0.5
            loss = loss_fn(yb, logits)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        if (step + 1) % sample_every == 0:
            float(loss)
            samples.append((step + 1, rss_mib()))
    return samples


def soak(program: str, iterations: int, sample_every: int, warmup: int) -> Soak:
    terra.reset()
    began = time.perf_counter()
    samples = train(program, iterations, sample_every)
    seconds = time.perf_counter() - began
    stats = terra.stats()
    terra.reset()
    return Soak(program, stats.iterations, stats.coexecuted, stats.fallbacks, samples,
                min(warmup, samples[-1][0]), seconds)


def report(result: Soak) -> str:
    series = ", ".join(f"{it}: {mib:.1f}" for it, mib in result.rss)
    return (f"{result.program}: {result.iterations} iterations, {result.coexecuted} co-executed, "
            f"{result.fallbacks} fallbacks, {result.seconds:.0f} s; RSS MiB {{{series}}}; "
            f"growth after iteration {result.warmup}: {100 * result.growth:+.1f}% -> "
            f"{'flat' if result.flat else 'GROWING'}")


def main(argv=None) -> list[Soak]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--sample-every", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=1000,
                        help="iteration whose sample is the base of the flatness check")
    parser.add_argument("--programs", default="mlp,alternating")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    results = []
    for program in args.programs.split(","):
        results.append(soak(program, args.iterations, args.sample_every, args.warmup))
        print(report(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{**dataclasses.asdict(r), "growth": r.growth, "flat": r.flat}
                       for r in results], out, indent=1)
    return results


if __name__ == "__main__":
    main()
