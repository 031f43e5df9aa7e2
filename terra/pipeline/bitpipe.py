"""BitPipe: two V-shaped interleaved pipelines in opposite directions, merged on one set of
devices ("BitPipe: Bidirectional Interleaved Pipeline Parallelism for Accelerating Large Models
Training").

The model is cut into 2D stages. The "down" pipeline runs stages 0..D-1 on devices 0..D-1 and
stages D..2D-1 back on devices D-1..0 (a V, so the middle hand-off is a local copy); the "up"
pipeline is its mirror image. Of every D micro-batches (a basic unit) the first D/2 go down and
the last D/2 up. Each pipeline injects a micro-batch every second slot, so on every device the
two pipelines' first-arm forwards alternate without colliding, as in the paper's Figure 3.

The order is found by list scheduling at the paper's costs (a chunk's forward one slot, its
backward two): at each slot a free device runs a ready backward before a ready forward, the
earliest-ready first. For D = 4 this gives Figure 3's order on every device (a test checks it).
A later unit's micro-batches enter once the previous unit's forwards have all left the entry
device, so they fill the previous unit's drain, as the paper's "scale to more micro-batches"
does with its basic units.
"""

from __future__ import annotations

from terra.pipeline.schedules import Op, Schedule


def routes(devices: int, microbatches: int):
    half = devices // 2
    down = tuple(s if s < devices else 2 * devices - 1 - s for s in range(2 * devices))
    up = tuple(devices - 1 - d for d in down)
    return tuple(down if m % devices < half else up for m in range(microbatches))


def bitpipe(devices: int, microbatches: int) -> Schedule:
    if devices % 2 or microbatches % devices:
        raise ValueError("bitpipe needs an even number of devices and a number of microbatches "
                         f"that is a multiple of it (got {devices}, {microbatches})")
    route = routes(devices, microbatches)
    stages = 2 * devices
    cost = {"F": 1, "B": 2}
    pending = [[] for _ in range(devices)]
    for m in range(microbatches):
        for s in range(stages):
            for kind in ("F", "B"):
                pending[route[m][s]].append(Op(kind, m, s))
    finish, order, busy_until = {}, [[] for _ in range(devices)], [0] * devices
    unit_entered = {}  # (unit, pipeline) -> slot when its last stage-0 forward ended

    def ready_at(op):
        """The slot from which ``op`` may start, or None while an input is missing."""
        deps = []
        if op.kind == "F" and op.stage:
            deps.append(("F", op.microbatch, op.stage - 1))
        if op.kind == "B":
            deps.append(("F", op.microbatch, op.stage))
            if op.stage < stages - 1:
                deps.append(("B", op.microbatch, op.stage + 1))
        if any(dep not in finish for dep in deps):
            return None
        slot = max([finish[dep] for dep in deps], default=0)
        if op.kind == "F" and op.stage == 0:
            unit, within = divmod(op.microbatch, devices)
            pipeline, index = divmod(within, devices // 2)
            if unit and (unit - 1, pipeline) not in unit_entered:
                return None
            entered = unit_entered[unit - 1, pipeline] if unit else 0
            slot = max(slot, entered + 2 * index)
        return slot

    time, left = 0, sum(len(ops) for ops in pending)
    while left:
        for d in range(devices):
            if busy_until[d] > time:
                continue
            candidates = []
            for op in pending[d]:
                slot = ready_at(op)
                if slot is not None and slot <= time:
                    candidates.append(((op.kind != "B", slot, op.microbatch, op.stage), op))
            if not candidates:
                continue
            op = min(candidates)[1]
            pending[d].remove(op)
            order[d].append(op)
            busy_until[d] = finish[op.kind, op.microbatch, op.stage] = time + cost[op.kind]
            left -= 1
            _note_entry(op, devices, finish, unit_entered)
        time += 1
    return Schedule("bitpipe", devices, microbatches, 2, route,
                    tuple(tuple(ops) for ops in order))


def _note_entry(op, devices, finish, unit_entered):
    """Record when a unit's last micro-batch of a pipeline has run its first stage."""
    if op.kind != "F" or op.stage:
        return
    unit, within = divmod(op.microbatch, devices)
    half = devices // 2
    first = unit * devices + (0 if within < half else half)
    members = range(first, first + half)
    if all(("F", m, 0) in finish for m in members):
        unit_entered[unit, within // half] = max(finish["F", m, 0] for m in members)
