"""Pipeline-parallel schedules as data: which operation each device runs, in which order.

A schedule fixes only the *order* of the operations on each device; when each one runs follows
from the dependencies and the operations' costs (:mod:`terra.pipeline.simulator`). Keeping the
order as plain data lets one object drive the exact simulator, the text chart and the
TensorFlow runner, so the numbers the simulator reports are those of the order the runner runs.

A micro-batch visits the stages ``0 .. num_stages - 1`` forward and back; ``routes[m][s]`` is the
device that runs stage ``s`` of micro-batch ``m``. Every micro-batch takes the same route except
under BitPipe, whose "up" pipeline runs the model's stages on the devices in reverse.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple

KINDS = ("gpipe", "1f1b", "interleaved", "bitpipe", "2bp-gpipe", "2bp-1f1b", "bpipe")
COMPUTE = ("F", "B", "W")
TRANSFER = ("EVICT", "LOAD")


class Op(NamedTuple):
    """One operation of one micro-batch on one stage.

    ``kind`` is ``F`` (forward), ``B`` (the whole backward, or only dL/dx "backward-p1" when the
    schedule splits the backward as 2BP does), ``W`` (2BP's dL/dw "backward-p2"), or BPipe's
    ``EVICT`` / ``LOAD`` of the micro-batch's saved activations to / from stage ``peer``.
    """

    kind: str
    microbatch: int
    stage: int
    peer: int | None = None

    def __str__(self):
        if self.kind in TRANSFER:
            return f"{self.kind}({self.microbatch},{self.stage}->{self.peer})"
        return f"{self.kind}{self.microbatch}.{self.stage}"


@dataclass(frozen=True)
class Schedule:
    """The ordered operations of every device (``per_device[d]``) of one training step."""

    kind: str
    devices: int
    microbatches: int
    chunks: int
    routes: tuple[tuple[int, ...], ...]
    per_device: tuple[tuple[Op, ...], ...]

    def __post_init__(self):
        _validate(self)

    @property
    def num_stages(self) -> int:
        return len(self.routes[0])

    @property
    def split_backward(self) -> bool:
        """True when the backward is 2BP's two operations, ``B`` (p1) then ``W`` (p2)."""
        return any(op.kind == "W" for ops in self.per_device for op in ops)

    def device_of(self, microbatch: int, stage: int) -> int:
        return self.routes[microbatch][stage]

    def __str__(self):
        # Local import: the chart needs the simulator, which needs this module.
        from terra.pipeline.charts import text_chart

        return text_chart(self)


def _validate(schedule: Schedule) -> None:
    """Reject an order that misses, repeats or misplaces an operation.

    The simulator and the runner trust the order; a hand-written or edited schedule that put a
    stage on the wrong device or dropped a backward would otherwise give wrong numbers quietly.
    """
    if len(schedule.per_device) != schedule.devices:
        raise ValueError(f"{len(schedule.per_device)} op lists for {schedule.devices} devices")
    if len(schedule.routes) != schedule.microbatches:
        raise ValueError(f"{len(schedule.routes)} routes for {schedule.microbatches} microbatches")
    counts = Counter()
    for device, ops in enumerate(schedule.per_device):
        for op in ops:
            if op.kind not in COMPUTE + TRANSFER:
                raise ValueError(f"unknown op kind {op.kind!r}")
            if op.kind in COMPUTE:
                if schedule.device_of(op.microbatch, op.stage) != device:
                    raise ValueError(f"{op} is on device {device}, its route says "
                                     f"{schedule.device_of(op.microbatch, op.stage)}")
                counts[op.kind, op.microbatch, op.stage] += 1
    kinds = ("F", "B", "W") if any(key[0] == "W" for key in counts) else ("F", "B")
    for m in range(schedule.microbatches):
        for s in range(schedule.num_stages):
            for kind in kinds:
                if counts[kind, m, s] != 1:
                    raise ValueError(f"{kind}{m}.{s} appears {counts[kind, m, s]} times")


def schedule(kind: str, devices: int, microbatches: int, chunks: int = 1) -> Schedule:
    """The ``kind`` schedule for ``devices`` devices and ``microbatches`` micro-batches.

    ``chunks`` is the number of model chunks per device of ``interleaved`` (Megatron-LM's v);
    BitPipe always has two per pipeline direction, the other kinds one.
    """
    if devices < 1 or microbatches < 1:
        raise ValueError("devices and microbatches must be positive")
    if kind == "gpipe":
        return _single_route(kind, devices, microbatches, 1, _gpipe_order(devices, microbatches))
    if kind == "1f1b":
        return _single_route(kind, devices, microbatches, 1, _one_f_one_b_order(devices,
                                                                                microbatches))
    if kind == "interleaved":
        return _single_route(kind, devices, microbatches, chunks,
                             _interleaved_order(devices, microbatches, chunks))
    if kind == "2bp-gpipe":
        order = [ops + [Op("W", m, d) for m in range(microbatches)]
                 for d, ops in enumerate(_gpipe_order(devices, microbatches))]
        return _single_route(kind, devices, microbatches, 1, order)
    if kind == "2bp-1f1b":
        return _single_route(kind, devices, microbatches, 1,
                             _fill_weight_gradients(devices, microbatches))
    if kind == "bitpipe":
        from terra.pipeline.bitpipe import bitpipe  # it builds on this module

        return bitpipe(devices, microbatches)
    if kind == "bpipe":
        from terra.pipeline.bpipe import bpipe  # it builds on this module

        return bpipe(devices, microbatches)
    raise ValueError(f"unknown schedule kind {kind!r}; known: {', '.join(KINDS)}")


def _single_route(kind, devices, microbatches, chunks, order) -> Schedule:
    """Stage ``s`` on device ``s % devices`` for every micro-batch (looping when chunks > 1)."""
    route = tuple(s % devices for s in range(devices * chunks))
    return Schedule(kind, devices, microbatches, chunks, (route,) * microbatches,
                    tuple(tuple(ops) for ops in order))


def _gpipe_order(devices, microbatches):
    """All forwards, then all backwards (fill, then drain)."""
    return [[Op("F", m, d) for m in range(microbatches)] + [Op("B", m, d)
                                                           for m in range(microbatches)]
            for d in range(devices)]


def _one_f_one_b_order(devices, microbatches):
    """PipeDream-Flush: device d runs D-d-1 warm-up forwards, then alternates F and B.

    Holding at most D-d micro-batches is the point: GPipe holds all of them on every device.
    """
    order = []
    for d in range(devices):
        warmup = min(devices - d - 1, microbatches)
        ops = [Op("F", m, d) for m in range(warmup)]
        for i in range(microbatches - warmup):
            ops += [Op("F", warmup + i, d), Op("B", i, d)]
        ops += [Op("B", m, d) for m in range(microbatches - warmup, microbatches)]
        order.append(ops)
    return order


def _interleaved_order(devices, microbatches, chunks):
    """Megatron-LM's interleaved 1F1B: stage c*D + d is chunk c of device d.

    Forwards go through the chunks in groups of D micro-batches (so each device always has the
    next stage's input ready), backwards through the chunks in reverse; device d warms up with
    2(D-d-1) + (v-1)D forwards so its first backward's input has arrived when it is due.
    """
    if microbatches % devices:
        raise ValueError("interleaved needs a number of microbatches that is a multiple of "
                         f"devices ({microbatches} % {devices} != 0)")
    total = microbatches * chunks

    def unit(k, forward):
        group, within = divmod(k, devices)
        chunk = group % chunks
        microbatch = (k // (devices * chunks)) * devices + within
        return microbatch, chunk if forward else chunks - 1 - chunk

    order = []
    for d in range(devices):
        def op(kind, k, d=d):
            microbatch, chunk = unit(k, kind == "F")
            return Op(kind, microbatch, chunk * devices + d)

        warmup = min(2 * (devices - d - 1) + (chunks - 1) * devices, total)
        ops = [op("F", k) for k in range(warmup)]
        for i in range(total - warmup):
            ops += [op("F", warmup + i), op("B", i)]
        ops += [op("B", k) for k in range(total - warmup, total)]
        order.append(ops)
    return order


def _fill_weight_gradients(devices, microbatches):
    """2BP on 1F1B: a device's idle slot before a backward-p1 runs a pending backward-p2.

    As the 2BP paper describes it: after a micro-batch's p1 every intermediate its p2 needs is
    stored, so the device fills the wait for the next p1 with p2s of earlier micro-batches and
    runs the p2s still pending after its last p1 back to back. The waits are those of 1F1B with
    forward = p1 = p2 (Table 1's assumption): a p2 goes only where a whole one fits, so filling
    never delays a forward or a p1 and the waits stay where they were.
    """
    from terra.pipeline.simulator import simulate  # it imports this module

    base = _single_route("1f1b", devices, microbatches, 1,
                         _one_f_one_b_order(devices, microbatches))
    timing = simulate(base, forward=1, backward=1)
    order = [[] for _ in range(devices)]
    for d in range(devices):
        pending, clock = [], 0
        for op, start, end in timing.device_timeline(d):
            while pending and clock + 1 <= start:
                order[d].append(Op("W", pending.pop(0), d))
                clock += 1
            order[d].append(op)
            clock = end
            if op.kind == "B":
                pending.append(op.microbatch)
        order[d] += [Op("W", m, d) for m in pending]
    return order
