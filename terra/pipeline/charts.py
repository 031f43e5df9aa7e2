"""Time-by-device charts of a schedule: text for ``str(schedule)``, PNG through matplotlib.

Both draw the simulated timeline, so a chart shows where the bubbles of *this* order fall under
the given costs, not a hand-drawn picture of it.
"""

from __future__ import annotations

import math
from fractions import Fraction

from terra.pipeline.schedules import TRANSFER, Schedule
from terra.pipeline.simulator import Simulation, simulate


def default_costs(schedule: Schedule) -> dict:
    """The papers' drawing costs: backward = 2 x forward; under 2BP forward = p1 = p2."""
    if schedule.split_backward:
        return {"forward": 1, "backward": 1, "weight": 1}
    return {"forward": 1, "backward": 2}


def label(schedule: Schedule, op) -> str:
    """``F3`` is micro-batch 3's forward; a letter names the chunk when a device has several."""
    text = f"{op.kind}{op.microbatch}"
    if schedule.chunks > 1:
        text += "abcdefghijklmnopqrstuvwxyz"[_chunk(schedule, op)]
    return text


def _chunk(schedule: Schedule, op) -> int:
    """Which of its device's chunks ``op``'s stage is: the n-th time the route meets the device."""
    route = schedule.routes[op.microbatch]
    return sum(1 for s in range(op.stage) if route[s] == route[op.stage])


def _slot(simulation: Simulation) -> Fraction:
    """The largest time step that every operation's start and end falls on."""
    times = {t for _, _, start, end in simulation.timeline for t in (start, end)} - {0}
    numerator = math.gcd(*(t.numerator for t in times)) if times else 1
    denominator = math.lcm(*(t.denominator for t in times)) if times else 1
    return Fraction(numerator, denominator)


def text_chart(schedule: Schedule, simulation: Simulation | None = None, **costs) -> str:
    """One row per device, one column per time slot; ``.`` is a bubble.

    BPipe's evictions and loads take no compute time; a second row under the device marks each
    at the slot it happens (``e3`` evicts micro-batch 3 to the peer stage, ``l3`` loads it back).
    """
    costs = costs or default_costs(schedule)
    simulation = simulation or simulate(schedule, **costs)
    slot = _slot(simulation)
    cell = max(len(label(schedule, op)) for ops in schedule.per_device for op in ops
               if op.kind not in TRANSFER) + 1
    width = int(simulation.makespan / slot)
    ratio = simulation.bubble_ratio
    lines = [f"{schedule.kind}: {schedule.devices} devices, {schedule.microbatches} micro-batches"
             f", costs {costs}: makespan {simulation.makespan}, bubble {ratio} "
             f"({float(ratio):.3f})"]
    for d in range(schedule.devices):
        row = ["." * cell] * width
        marks = [" " * cell] * width
        for op, start, end in simulation.device_timeline(d):
            first = int(start / slot)
            if op.kind in TRANSFER:
                marks[first] = f"{op.kind[0].lower()}{op.microbatch}".ljust(cell)
                continue
            span = int((end - start) / slot)
            text = label(schedule, op).ljust(span * cell - 1)[:span * cell - 1] + "|"
            row[first:first + span] = [text] + [""] * (span - 1)
        lines.append(f"d{d} |" + "".join(row))
        if any(m.strip() for m in marks):
            lines.append("    " + "".join(marks).rstrip())
    return "\n".join(lines)


COLORS = {"F": "#4682b4", "B": "#eb8f6b", "W": "#9acd32"}


def png_chart(schedules, path, **costs) -> None:
    """Draw each schedule's simulated timeline as one panel of a PNG (needs matplotlib)."""
    import matplotlib  # optional: only the PNG needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(schedules), 1, figsize=(12, 1.2 + 0.9 * len(schedules) * 2),
                             squeeze=False)
    for axis, schedule in zip(axes[:, 0], schedules):
        chosen = costs or default_costs(schedule)
        simulation = simulate(schedule, **chosen)
        for d, op, start, end in simulation.timeline:
            if op.kind in TRANSFER:
                axis.plot([float(start)], [d], marker="v" if op.kind == "EVICT" else "^",
                          color="black", markersize=5)
                continue
            shade = 0.55 if _chunk(schedule, op) % 2 else 1.0
            axis.broken_barh([(float(start), float(end - start))], (d - 0.4, 0.8),
                             facecolors=COLORS[op.kind], alpha=shade, edgecolor="black",
                             linewidth=0.4)
            if end - start >= simulation.makespan / 60:
                axis.text(float(start + end) / 2, d, str(op.microbatch), ha="center",
                          va="center", fontsize=6)
        axis.set_yticks(range(schedule.devices), [f"d{d}" for d in range(schedule.devices)])
        axis.invert_yaxis()
        axis.set_xlim(0, float(simulation.makespan))
        axis.set_title(f"{schedule.kind}: D={schedule.devices}, N={schedule.microbatches}, "
                       f"bubble {float(simulation.bubble_ratio):.3f}", fontsize=9)
    axes[-1, 0].set_xlabel("time (forward of one micro-batch on one device = 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
