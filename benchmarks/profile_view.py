"""``python -m benchmarks.profile_view``: one training run under Terra and the TensorBoard
profiler, drawn as a timeline PNG, with the run's ``terra.explain()`` on stdout.

TensorBoard's trace viewer shows the same trace interactively, but needs a TensorBoard; the
picture in docs/observability.md must come from a real run and be redone by one command, so
this script reads the ``.xplane.pb`` the profiler writes (:func:`read_trace`) and draws it with
matplotlib (:func:`draw`).

The run is the benchmarks' MLP (784-256-256-10, Adam, batches of 64) in the usual custom loop,
reading its loss with ``float()`` every step, as a loop that logs does. From the middle of the
run on, an L2 penalty joins the loss (weight decay switched on after a warm-up): a path no
trace had, so the picture shows the fallback, the new traces and the new graph as well as
the steady state.

    python -m benchmarks.profile_view                     # docs/profile.png, 40 steps
    python -m benchmarks.profile_view --out profile.png --steps 40
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import tensorflow as tf

import terra
from benchmarks.programs.mlp import MLP

try:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
except ImportError:  # where TF ships TSL as its own package
    from tsl.profiler.protobuf import xplane_pb2

ROOT = Path(__file__).resolve().parent.parent
WEIGHT_DECAY = 1e-4
MAX_EXECUTORS = 4  # tf_Compute rows at most: with the two runners' rows, six
PHASES = ("terra_trace", "terra_coexecute", "terra_fallback")  # the loop thread's, one at a time
COLORS = {  # legend order
    "terra_trace": "tab:orange",
    "terra_merge": "tab:purple",
    "terra_generate": "tab:brown",
    "terra_coexecute": "tab:green",
    "terra_fetch_wait": "tab:blue",
    "terra_job_wait": "tab:cyan",
    "terra_fallback": "tab:red",
    "terra_replay": "darkred",
    "terra_verify": "tab:pink",
    "terra_graph_step": "tab:olive",
}
EAGER_OP = "EagerLocalExecute: "  # TF's event for one op run eagerly by the calling thread


@dataclass(frozen=True)
class Span:
    """One of Terra's annotations: times in ms from the first of them; ``depth`` is how many
    of the thread's Terra spans enclose it (a fetch wait inside its co-executed iteration is
    at depth 1); ``step`` the iteration number it carries, if any."""

    name: str
    start: float
    duration: float
    depth: int
    step: int | None


@dataclass
class Thread:
    """A row of the timeline: a thread's Terra spans and the TF ops it ran, as ``(start,
    duration)`` in ms. ``role`` is ``loop``, ``graph`` (the GraphRunner) or ``executor`` (a
    thread of TF's inter-op pool that ran kernels of a graph)."""

    role: str
    name: str
    spans: list[Span] = field(default_factory=list)
    ops: list[tuple[float, float]] = field(default_factory=list)


def _is_op(name, display_name):
    """A TF op's execution: an executor's kernel (``MatMul_1:_MklMatMul``, with the op type as
    display name) or an op run eagerly, a function call excepted (the GraphRunner's call of the
    whole graph is its ``terra_graph_step`` already)."""
    if name.startswith(EAGER_OP):
        return not name[len(EAGER_OP):].startswith("__inference_")
    return bool(display_name) and ":" in name


def _depths(spans):
    """The nesting depth of each ``(start, end, ...)`` span among those of one thread, in the
    order given (sorted by start, outer before inner)."""
    open_ends, depths = [], []
    for start, end, *_ in spans:
        while open_ends and open_ends[-1] <= start:
            open_ends.pop()
        depths.append(len(open_ends))
        open_ends.append(end)
    return depths


def read_trace(logdir) -> list[Thread]:
    """The threads of the profile written under ``logdir`` that show Terra at work, in the
    order drawn: the loop's thread (the one with Terra's phases), the GraphRunner's (the one
    with ``terra_graph_step``) and the inter-op threads (``tf_Compute``) that ran kernels, the
    busiest first, at most :data:`MAX_EXECUTORS`. Threads are told apart by what ran on them:
    the profiler names both Python threads ``python``. Times are ms from the first Terra span;
    what ended before it (the program's set-up) is left out."""
    (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    space.ParseFromString(Path(path).read_bytes())
    (host,) = [p for p in space.planes if p.name == "/host:CPU"]
    stat_names = {k: v.name for k, v in host.stat_metadata.items()}
    lines = []
    for line in host.lines:
        base = line.timestamp_ns * 1000
        spans, ops = [], []
        for e in line.events:
            meta = host.event_metadata[e.metadata_id]
            start, end = base + e.offset_ps, base + e.offset_ps + e.duration_ps
            if meta.name.startswith("terra_"):
                step = next((s.int64_value for s in e.stats
                             if stat_names[s.metadata_id] == "step_num"), None)
                spans.append((start, end, meta.name, step))
            elif _is_op(meta.name, meta.display_name):
                ops.append((start, end))
        lines.append((line.name, spans, ops))
    t0 = min((s[0] for _, spans, _ in lines for s in spans), default=0)

    def thread(role, name, spans, ops):
        spans.sort(key=lambda s: (s[0], -s[1]))
        return Thread(role, name,
                      [Span(n, (a - t0) / 1e9, (b - a) / 1e9, d, step)
                       for (a, b, n, step), d in zip(spans, _depths(spans))],
                      [((a - t0) / 1e9, (b - a) / 1e9) for a, b in sorted(ops) if b > t0])

    loop = [thread("loop", "loop thread", s, o) for _, s, o in lines
            if any(span[2] in PHASES for span in s)]
    graph = [thread("graph", "GraphRunner", s, o) for _, s, o in lines
             if any(span[2] == "terra_graph_step" for span in s)]
    pool = sorted((o for n, _, o in lines if n.startswith("tf_Compute") and o),
                  key=lambda o: -sum(b - a for a, b in o))
    executors = [thread("executor", f"tf_Compute #{i + 1}", [], o)
                 for i, o in enumerate(pool[:MAX_EXECUTORS])]
    return loop + graph + executors


def zoom_window(threads, count=3):
    """``(start, end)`` in ms around the last ``count`` co-executed iterations that ended
    inside the trace, and their graph calls: the steady state, where the two runners'
    overlap shows. None if the loop co-executed fewer iterations."""
    loop = next((t for t in threads if t.role == "loop"), None)
    coexecuted = [s for s in loop.spans if s.name == "terra_coexecute"] if loop else []
    if len(coexecuted) < count:
        return None
    chosen = coexecuted[-count:]
    steps = {s.step for s in chosen}
    calls = [s for t in threads if t.role == "graph" for s in t.spans if s.step in steps]
    start = min(s.start for s in chosen + calls)
    end = max(s.start + s.duration for s in chosen + calls)
    pad = 0.03 * (end - start)
    return start - pad, end + pad


def _panel(ax, threads, window, labels):
    """One timeline: a row per thread, Terra's spans as bars whose height shrinks with their
    depth (a wait is drawn inside its iteration), TF ops as a thin gray strip under them."""
    for row, t in enumerate(threads):
        y = -row
        ax.broken_barh(t.ops, (y - 0.42, 0.12), facecolors="0.45", linewidth=0)
        for depth in sorted({s.depth for s in t.spans}):
            height = 0.6 * 0.6 ** depth
            for name in COLORS:
                bars = [(s.start, s.duration) for s in t.spans
                        if s.depth == depth and s.name == name]
                if bars:
                    ax.broken_barh(bars, (y + 0.05 - height / 2, height),
                                   facecolors=COLORS[name], linewidth=0)
        if labels:
            for s in t.spans:
                if s.step is not None and s.name in ("terra_coexecute", "terra_graph_step") \
                        and window[0] <= s.start <= window[1]:
                    ax.text(s.start, y + 0.4, f"iteration {s.step}", fontsize="x-small",
                            va="bottom", clip_on=True)
    ax.set_xlim(*window)
    ax.set_ylim(-len(threads) + 0.4, 0.7)
    ax.set_yticks([-row for row in range(len(threads))])
    ax.set_yticklabels([t.name for t in threads])
    ax.set_xlabel("ms since the first traced iteration")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)


def draw(threads, path, title):
    """The whole run and, under it, a zoom on three co-executed iterations, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    zoom = zoom_window(threads)
    fig, axes = plt.subplots(2 if zoom else 1, 1, squeeze=False,
                             figsize=(13, 1.1 * len(threads) * (2 if zoom else 1) + 1.6))
    end = max([s.start + s.duration for t in threads for s in t.spans]
              + [a + d for t in threads for a, d in t.ops])
    _panel(axes[0][0], threads, (0, end), labels=False)
    axes[0][0].set_title(title, fontsize="medium")
    if zoom:
        _panel(axes[1][0], threads, zoom, labels=True)
        axes[1][0].set_title("zoom: the last three co-executed iterations", fontsize="medium")
        axes[0][0].axvspan(*zoom, color="0.85", zorder=0)
    shown = {s.name for t in threads for s in t.spans}
    handles = [Patch(color=c, label=n) for n, c in COLORS.items() if n in shown]
    handles.append(Patch(color="0.45", label="TF op (eager or graph kernel)"))
    fig.legend(handles=handles, loc="lower center", ncol=min(6, len(handles)),
               fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0.035 * -(-len(handles) // 6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def train(steps, new_path_at):
    """The MLP's loop under Terra, the loss read every step; from ``new_path_at`` on, weight
    decay is added to the loss. Returns the losses."""
    program = MLP("quick")
    model, optimizer, loss_fn = program.model, program.optimizer, program.loss_fn
    losses = []
    for step, (x, y) in enumerate(program.batches(steps)):
        with terra.TerraGradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if step >= new_path_at:
                loss += WEIGHT_DECAY * tf.add_n([tf.nn.l2_loss(w)
                                                 for w in model.trainable_variables])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return losses


def profile(steps, logdir):
    """``train`` from a fresh runtime under the profiler, its trace written to ``logdir``;
    returns :func:`read_trace` of it."""
    terra.reset()
    tf.profiler.experimental.start(logdir)
    try:
        train(steps, new_path_at=steps // 2)
    finally:
        tf.profiler.experimental.stop()
    return read_trace(logdir)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/profile.png", help="the PNG to write")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as logdir:
        threads = profile(args.steps, logdir)
    s = terra.stats()
    draw(threads, args.out, f"MLP under Terra, {args.steps} steps: {s.traces} traced, "
         f"{s.coexecuted} co-executed, {s.fallbacks} fallback(s), "
         f"{s.graph_generations} graph generation(s)")
    # the user's lines are absolute paths; relative to the repository they read the same on
    # every machine
    print(terra.explain().replace(f"{ROOT}{os.sep}", ""))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
