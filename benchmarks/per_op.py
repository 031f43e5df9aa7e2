"""``python -m benchmarks.per_op``: Terra's own cost per intercepted op in co-execution.

The step of a program runs co-executed under Terra and in the floor mode (``benchmarks.floor``:
every op answered from a recorded step, so only the user's Python and TF's op wrappers are
left) in fresh worker processes, paired and interleaved as the main benchmark does. Terra's
own cost per op is ``(Terra - floor) / N``, with N the ops the PythonRunner is handed per
step, from the loop thread's CPU time and from the wall time (medians over repeats). A last
block of Terra's steps also times the ops inside Terra's door directly (the time in
``CoexecDoor.fast_entry``/``slow`` less the waits for the graph, ``terra.stats().python_stall``;
in total and by op type):
validation, stand-ins, feeds and path following, without cProfile's distortion; the timing
probe's own time per call, measured around a door that does nothing, is taken off.

Programs: ``chain`` (defined here: a step of ~500 cheap ops on 4x4 tensors, no Keras, so Terra
and the floor run the same Python) and any of ``benchmarks.programs``. On a Keras model the
difference also holds what Terra saves (layer regions skip built-in layers' Python, which the
floor runs), so there the door's own time is the figure to read.

    python -m benchmarks.per_op                          # chain and yolov3, 3 repeats
    python -m benchmarks.per_op --programs chain --repeats 5
    python -m benchmarks.per_op --trees /tmp/before,.    # two checkouts, runs alternated

A 2-core cloud machine's speed drifts by half within minutes (the same tree's door took 3.3
and 4.5 us an op an hour apart), so two trees are compared with ``--trees``: Terra's runs of
each checkout (its own ``terra`` and ``benchmarks``) alternated, ABBA, and the medians side by
side with their ratio.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys
import time

from benchmarks.harness import run_worker
from benchmarks.worker import keras_env, serve

CHAIN_OPS = 500  # the chain step's ops (ReadVariableOp, AddV2, Mul, StridedSlice, ...)
# program -> (warm-up, timed steps); yolov3 warms up over its eight batches three times, so
# the output shapes its boolean masks give are known (inferred once, then looked up)
DEFAULTS = {"chain": (8, 200), "yolov3": (24, 16)}
PROBE_CALLS = 20000  # calls of an empty door, timed as the real one is: the probe's own time


def chain_program(seed: int):
    """The ``chain`` program (imports TensorFlow): one variable read, then ``CHAIN_OPS`` cheap
    ops of five kinds on a 4x4 tensor (a Python scalar constant, a stand-in input, slicing
    with converted constants, a concat, a transpose), and the gradient of their sum."""
    import tensorflow as tf

    from benchmarks.programs.base import Program

    class Chain(Program):
        CONFIGS = {"quick": {}}

        def build(self):
            self.w = tf.Variable(tf.fill((4, 4), 0.5))
            self.data = [(tf.constant(self.rng.normal(size=(4, 4)).astype("float32")),)
                         for _ in range(4)]

        def train_step(self, x):
            with self.tape() as tape:
                w = self.w * 1.0
                y = x
                for _ in range((CHAIN_OPS - 1) // 6):
                    y = tf.add(y, 1.0) * w  # AddV2, Mul
                    y = tf.concat([y[1:], y[:1]], 0)  # StridedSlice x2, ConcatV2
                    y = tf.transpose(y)
                loss = tf.reduce_sum(y)
            grad = tape.gradient(loss, self.w)
            self.w.assign_sub(1e-3 * grad)
            return loss

    return Chain("quick", seed, tape=_tape)


_tape = None  # the worker's tape class, set before the program is built


def run_one(program: str, mode: str, warmup: int, steps: int, seed: int = 0) -> dict:
    """One worker run: ``warmup`` steps (Terra: at least until it co-executes), ``steps`` timed
    steps (wall and the loop thread's CPU, up to and including their losses' conversion),
    then, under Terra, as many steps again with its door timed."""
    global _tape
    from benchmarks import modes
    from benchmarks.programs import load, run

    m = modes.MODES[mode]
    _tape = modes.tape_for(m)
    prog = chain_program(seed) if program == "chain" else load(program)("quick", seed,
                                                                         tape=_tape)
    step_fn = modes.step_fn_for(m, prog, warmup)
    run(prog, warmup, step_fn)
    if m.terra is not None:
        import terra

        for _ in range(4 * warmup):  # an instantiation in the background: eager steps
            if terra.stats().phase == "coexecution":
                break
            run(prog, 1, step_fn)
    wall, cpu = time.perf_counter(), time.thread_time()
    run(prog, steps, step_fn)
    result = dict(program=program, mode=mode, ms=(time.perf_counter() - wall) / steps * 1e3,
                  cpu_ms=(time.thread_time() - cpu) / steps * 1e3)
    if m.floor:
        result["ops"] = step_fn.stats()["ops_per_step"]
        result["diverged"] = step_fn.stats()["diverged_steps"]
    else:
        result.update(_door_timed(prog, step_fn, steps))
    return result


def _door_timed(prog, step_fn, steps) -> dict:
    """``steps`` more Terra steps with its door's outermost calls timed: the ops it was handed
    per step and its own time per op (less its waits for the graph). Also Terra's counters."""
    import terra
    from benchmarks.programs import run
    from terra import interception, runtime

    counts = {"ops": 0, "depth": 0, "time": 0.0}
    by_type = collections.defaultdict(lambda: [0, 0.0])  # op type -> [calls, seconds]
    rt = runtime.current()

    def timed(call, type_at):
        def door(*args):
            counts["ops"] += 1
            counts["depth"] += 1
            waiting = rt.runner.waiting
            stalled, began = waiting.stall_time, time.perf_counter()
            try:
                return call(*args)
            finally:
                counts["depth"] -= 1
                if not counts["depth"]:  # a variable read inside an op: counted once
                    took = time.perf_counter() - began - (waiting.stall_time - stalled)
                    counts["time"] += took
                    mine = by_type[args[type_at]]
                    mine[0] += 1
                    mine[1] += took
        return door

    before = terra.stats()
    # TF's fast path while the door is the handler (its lanes and general path), and its
    # slow door; routed anew so that the timed fast path is the one in TF's way
    door = rt.coexec_door
    door.fast_entry, door.slow = timed(door.fast_entry, 1), timed(door.slow, 0)
    interception.set_handler(None)
    interception.set_handler(door)
    run(prog, steps, step_fn)
    after = terra.stats()
    ops, spent = counts["ops"], counts["time"]
    # the probe's own share of what it timed: the same wrapper around a door that does nothing
    types = {op: (n / steps, t / n * 1e6) for op, (n, t) in by_type.items()}
    empty = timed(lambda *args: None, 1)
    counts.update(ops=0, time=0.0)
    for _ in range(PROBE_CALLS):
        empty(None, "probe", None)
    probe = counts["time"] / PROBE_CALLS
    return dict(ops=ops / steps, coexecuted=after.coexecuted - before.coexecuted,
                fallbacks=after.fallbacks - before.fallbacks, phase=after.phase,
                door_us=(spent / max(ops, 1) - probe) * 1e6, probe_us=probe * 1e6,
                door_by_type={op: (n, us - probe * 1e6) for op, (n, us) in types.items()})


def measure(programs, repeats, timeout, log=print) -> list[dict]:
    """Every (program, repeat) pair of runs, Terra and floor in alternating order."""
    runs = []
    for program in programs:
        warmup, steps = DEFAULTS.get(program, (8, 12))
        for r in range(repeats):
            order = ("terra", "floor") if r % 2 == 0 else ("floor", "terra")
            pair = {}
            for mode in order:
                spec = dict(program=program, mode=mode, warmup=warmup, steps=steps)
                # co-executed whatever Terra's cost budget would decide: it is what is measured
                env = dict(keras_env(3), TERRA_BUDGET="inf")
                pair[mode] = run_worker("benchmarks.per_op", spec, timeout, env)
                if "error" in pair[mode]:
                    raise SystemExit(f"{program} {mode}: {pair[mode]['error']}\n"
                                     f"{pair[mode].get('traceback', '')}")
            log(f"  {program} repeat {r + 1}: terra {pair['terra']['ms']:.2f} ms/step, "
                f"floor {pair['floor']['ms']:.2f} ms/step", file=sys.stderr)
            runs.append(dict(program=program, repeat=r, **pair))
    return runs


def summarize(runs) -> str:
    """The table: per program, the median over repeats of each figure, the differences taken
    within each pair."""
    columns = {  # heading -> the figure of one pair
        "ops/step": lambda t, f: t["ops"],
        "floor ops/step": lambda t, f: f["ops"],
        "Terra ms/step": lambda t, f: t["ms"],
        "floor ms/step": lambda t, f: f["ms"],
        "Terra CPU ms": lambda t, f: t["cpu_ms"],
        "floor CPU ms": lambda t, f: f["cpu_ms"],
        "own us/op (CPU)": lambda t, f: (t["cpu_ms"] - f["cpu_ms"]) * 1e3 / t["ops"],
        "own us/op (wall)": lambda t, f: (t["ms"] - f["ms"]) * 1e3 / t["ops"],
        "door us/op": lambda t, f: t["door_us"],
        "probe us": lambda t, f: t["probe_us"],
    }
    lines = ["| program | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for program in dict.fromkeys(r["program"] for r in runs):
        pairs = [(r["terra"], r["floor"]) for r in runs if r["program"] == program]
        cells = [statistics.median(figure(*p) for p in pairs) for figure in columns.values()]
        lines.append(f"| {program} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    return "\n".join(lines)


def summarize_types(runs, top=8) -> str:
    """Per program, the door's own time by op type (the ops costing the most per step first):
    calls a step and us a call, medians over repeats."""
    lines = ["| program | op type | calls/step | door us/call | us/step |", "|---" * 5 + "|"]
    for program in dict.fromkeys(r["program"] for r in runs):
        tables = [r["terra"]["door_by_type"] for r in runs if r["program"] == program]
        rows = []
        for op in set().union(*tables):
            n = statistics.median(t[op][0] for t in tables if op in t)
            us = statistics.median(t[op][1] for t in tables if op in t)
            rows.append((n * us, op, n, us))
        for total, op, n, us in sorted(rows, reverse=True)[:top]:
            lines.append(f"| {program} | {op} | {n:.1f} | {us:.2f} | {total:.0f} |")
    return "\n".join(lines)


def compare_trees(trees, program, repeats, timeout, log=print) -> str:
    """Terra's runs of ``program`` in each checkout of ``trees``, alternated (the order
    reversed every other round), as a table of medians: door us/op, ms/step, and each tree's
    step over the first's."""
    warmup, steps = DEFAULTS.get(program, (8, 12))
    spec = dict(program=program, mode="terra", warmup=warmup, steps=steps)
    env = dict(keras_env(3), TERRA_BUDGET="inf")
    runs = {tree: [] for tree in trees}
    for r in range(repeats):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            result = run_worker("benchmarks.per_op", spec, timeout, env,
                                root=pathlib.Path(tree).resolve())
            if "error" in result:
                raise SystemExit(f"{tree}: {result['error']}\n{result.get('traceback', '')}")
            runs[tree].append(result)
            log(f"  {tree} round {r + 1}: {result['ms']:.2f} ms/step, door "
                f"{result['door_us']:.2f} us/op", file=sys.stderr)
    first = statistics.median(t["ms"] for t in runs[trees[0]])
    lines = ["| tree | door us/op | ms/step | CPU ms/step | step / first tree's |",
             "|---" * 5 + "|"]
    for tree, results in runs.items():
        ms = statistics.median(t["ms"] for t in results)
        lines.append(f"| {tree} | {statistics.median(t['door_us'] for t in results):.2f} | "
                     f"{ms:.2f} | {statistics.median(t['cpu_ms'] for t in results):.2f} | "
                     f"{ms / first:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.per_op", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--programs", default="chain,yolov3", help="comma-separated (default "
                   "chain,yolov3): chain, or programs of benchmarks.programs")
    p.add_argument("--repeats", type=int, default=3, help="paired repeats (default 3)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per worker run")
    p.add_argument("--trees", help="comma-separated checkouts: Terra's runs of the first "
                   "program in each, alternated (--repeats rounds)")
    args = p.parse_args(argv)
    if args.trees:
        print(compare_trees(args.trees.split(","), args.programs.split(",")[0], args.repeats,
                            args.timeout))
        return
    runs = measure(args.programs.split(","), args.repeats, args.timeout)
    for r in runs:
        t = r["terra"]
        if t["coexecuted"] == 0 or t["phase"] != "coexecution":
            print(f"warning: {r['program']} repeat {r['repeat'] + 1}: Terra co-executed "
                  f"{t['coexecuted']} timed steps, phase {t['phase']}", file=sys.stderr)
    print(summarize(runs))
    print()
    print(summarize_types(runs))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):
        serve(run_one)
    else:
        main()
