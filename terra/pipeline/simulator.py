"""An exact, event-by-event simulation of a schedule's order under given operation costs.

Each device runs its operations in the schedule's order, one at a time, each as soon as the
device is free and the operations it depends on have finished: a stage's forward after the
previous stage's forward of the same micro-batch, a backward after the next stage's backward and
its own forward, a 2BP ``W`` after its ``B``. Transfers between devices take no time (the papers'
formulas assume the same). Costs are kept as :class:`fractions.Fraction`, so a makespan or
bubble ratio compares exactly with a paper's closed form.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from terra.pipeline.schedules import TRANSFER, Op, Schedule


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` found: ``timeline`` holds ``(device, op, start, end)`` rows."""

    makespan: Fraction
    bubble_ratio: Fraction
    peak_activations: tuple[Fraction, ...]
    busy: tuple[Fraction, ...]
    timeline: tuple[tuple[int, Op, Fraction, Fraction], ...]

    def device_timeline(self, device):
        return [(op, start, end) for d, op, start, end in self.timeline if d == device]


def _exact(value) -> Fraction:
    # Through str so that 0.1 means one tenth, not the binary float nearest to it.
    return Fraction(str(value)) if isinstance(value, float) else Fraction(value)


def durations(schedule: Schedule, forward=1, backward=2, weight=None) -> dict[str, Fraction]:
    """Seconds (or units) per op kind on one chunk: a device's share divided among its chunks.

    Without a split backward, ``weight`` (2BP's p2) is part of the one backward, so the same
    costs describe a schedule with and without 2BP, as the 2BP paper's Table 1 compares them.
    """
    whole = _exact(backward) + (0 if weight is None or schedule.split_backward
                                else _exact(weight))
    if schedule.split_backward and weight is None:
        raise ValueError("a 2BP schedule needs weight=, the cost of backward-p2")
    chunks = schedule.chunks
    return {"F": _exact(forward) / chunks, "B": whole / chunks,
            "W": (_exact(weight) if weight is not None else Fraction(0)) / chunks,
            "EVICT": Fraction(0), "LOAD": Fraction(0)}


def _dependencies(schedule: Schedule, op: Op):
    last = schedule.num_stages - 1
    if op.kind == "F":
        return [("F", op.microbatch, op.stage - 1)] if op.stage else []
    if op.kind == "B":
        deps = [("F", op.microbatch, op.stage)]
        return deps + ([("B", op.microbatch, op.stage + 1)] if op.stage < last else [])
    if op.kind == "W":
        return [("B", op.microbatch, op.stage)]
    return [("F", op.microbatch, op.stage)]  # an eviction or load of a forward's activations


def simulate(schedule: Schedule, forward=1, backward=2, weight=None) -> Simulation:
    """Run ``schedule`` on an ideal machine and measure its makespan, bubbles and memory.

    ``bubble_ratio`` is idle device time over total device time (devices x makespan), the
    definition of the GPipe, 2BP and BitPipe papers. ``peak_activations[d]`` is the most
    micro-batches whose saved activations device ``d`` held at once, a chunk counting as
    ``1/chunks`` of one: a forward saves them when it starts, the last backward operation of the
    micro-batch on that stage (``B``, or ``W`` under 2BP) frees them when it ends, and BPipe's
    ``EVICT`` / ``LOAD`` move them to / from the peer stage's device.
    """
    cost = durations(schedule, forward, backward, weight)
    finish = {}
    position = [0] * schedule.devices
    free_at = [Fraction(0)] * schedule.devices
    timeline = []
    remaining = sum(len(ops) for ops in schedule.per_device)
    while remaining:
        progressed = False
        for d, ops in enumerate(schedule.per_device):
            while position[d] < len(ops):
                op = ops[position[d]]
                deps = _dependencies(schedule, op)
                if any(dep not in finish for dep in deps):
                    break
                start = max([free_at[d]] + [finish[dep] for dep in deps])
                end = start + cost[op.kind]
                if op.kind not in TRANSFER:
                    finish[op.kind, op.microbatch, op.stage] = end
                timeline.append((d, op, start, end))
                free_at[d] = end
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(ops[position[d]]) for d, ops in enumerate(schedule.per_device)
                     if position[d] < len(ops)]
            raise ValueError(f"the schedule deadlocks: every device waits ({', '.join(stuck)})")
    makespan = max(end for _, _, _, end in timeline)
    busy = [Fraction(0)] * schedule.devices
    for d, _op, start, end in timeline:
        busy[d] += end - start
    idle = sum(makespan - b for b in busy)
    ratio = idle / (makespan * schedule.devices) if makespan else Fraction(0)
    share = Fraction(1, schedule.chunks)
    return Simulation(makespan, ratio, peak_held(schedule, timeline, lambda op: share),
                      tuple(busy), tuple(sorted(timeline, key=lambda row: (row[2], row[0]))))


def peak_held(schedule: Schedule, timeline, size, zero=Fraction(0)) -> tuple:
    """The most each device held at once, ``size(op)`` being what ``op``'s micro-batch saves
    on its stage (a share of a micro-batch here, bytes in the TensorFlow runner).

    Replays saves and frees in time order; at equal times frees go first, as memory would.
    """
    releaser = "W" if schedule.split_backward else "B"
    changes = []
    for seq, (d, op, start, end) in enumerate(timeline):
        if op.kind == "F":
            changes.append((start, seq, d, size(op)))
        elif op.kind == releaser:
            changes.append((end, seq, d, -size(op)))
        elif op.kind in TRANSFER:
            peer = schedule.device_of(op.microbatch, op.peer)
            moved = size(op) if op.kind == "EVICT" else -size(op)
            changes += [(start, seq, d, -moved), (start, seq, peer, moved)]
    held = [zero] * schedule.devices
    peak = [zero] * schedule.devices
    for _time, _frees_first, _seq, d, delta in sorted((t, delta > 0, seq, d, delta)
                                                       for t, seq, d, delta in changes):
        held[d] += delta
        peak[d] = max(peak[d], held[d])
    return tuple(peak)
