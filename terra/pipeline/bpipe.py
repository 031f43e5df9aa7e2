"""BPipe: 1F1B with activation balancing between evictor / acceptor stage pairs.

Under 1F1B stage ``s`` of ``p`` holds up to ``p - s`` micro-batches' activations, so the first
stage runs out of memory while the last is nearly empty. BPipe ("Systematic Approaches for
Efficient Training of Deep Learning Models", chapter 4) pairs stage ``s`` with ``p - s - 1``:
the evictor moves activations to its acceptor during the forwards and loads them back before
their backwards, so that no stage holds more than ``ceil((p + 2) / 2)``. :func:`transfer_plan`
is the dissertation's Algorithm 2, line for line, on the 1F1B computation schedule it takes.
"""

from __future__ import annotations

import math

from terra.pipeline.schedules import Op, Schedule, schedule
from terra.pipeline.simulator import simulate


def balanced_limit(stages: int) -> int:
    """mu_opt: an evictor-acceptor pair holds p + 1 micro-batches plus one in flight, halved."""
    return math.ceil((stages + 2) / 2)


def computation_schedule(stages: int, microbatches: int, stage: int):
    """Stage ``stage``'s 1F1B computation decisions ``C``: ``Op`` or ``None`` for a bubble.

    One slot per decision, forward and backward one slot each, as Figure 4.2 draws it: 22
    decisions for stage 0 of p = 4, m = 8, with the first backward at C_7. The steady-phase
    forward that precedes a backward sits in the slot right before it, so a bubble before the
    steady phase comes before that forward (C_6 = F3 there). Algorithm 2's index arithmetic
    (C_{i-3} is the forward before the previous one) relies on that layout.
    """
    base = schedule("1f1b", stages, microbatches)
    timeline = simulate(base, forward=1, backward=1).device_timeline(stage)
    slots = [None] * int(timeline[-1][2])
    for k, (op, start, _end) in enumerate(timeline):
        following = timeline[k + 1] if k + 1 < len(timeline) else None
        if op.kind == "F" and following and following[0].kind == "B":
            start = following[1] - 1
        slots[int(start)] = op
    return slots


def transfer_plan(stages: int, stage: int, microbatches: int, computation):
    """Algorithm 2: the transfer decision ``T_i`` (or ``None``) to run alongside ``C_i``.

    Returns a list as long as ``computation`` of ``("EVICT" | "LOAD", microbatch)`` or None.
    """
    limit = balanced_limit(stages)
    n_evict = min(stages - stage, microbatches) - limit
    evicted = set()
    plan = [None] * len(computation)
    for i, decision in enumerate(computation):
        if decision is None:
            continue
        if decision.kind == "F":
            if limit - 1 <= decision.microbatch < limit - 1 + n_evict:  # warm-up phase
                plan[i] = ("EVICT", computation[i - 1].microbatch)
                evicted.add(computation[i - 1].microbatch)
        elif decision.microbatch in evicted:  # a backward: steady or cool-down phase
            plan[i - 1] = ("LOAD", decision.microbatch)
            evicted.discard(decision.microbatch)
            previous = computation[i - 1]
            if previous is not None and previous.kind == "F":  # steady: keep mu <= mu_opt
                plan[i - 2] = ("EVICT", computation[i - 3].microbatch)
                evicted.add(computation[i - 3].microbatch)
    return plan


def evictors(stages: int) -> list[int]:
    """Stages that transfer at all: those 1F1B makes hold more than the limit."""
    return [s for s in range(stages // 2) if stages - s > balanced_limit(stages)]


def bpipe(stages: int, microbatches: int) -> Schedule:
    """1F1B's order with each evictor's transfers placed before the computation they overlap.

    A transfer runs on its own stream beside a computation, so it takes no compute time; in the
    order it comes right before the operation it accompanies (or, at a bubble, the next one),
    which makes an eviction free its memory as that forward saves a new micro-batch.
    """
    base = schedule("1f1b", stages, microbatches)
    order = [list(ops) for ops in base.per_device]
    for s in evictors(stages):
        computation = computation_schedule(stages, microbatches, s)
        plan = transfer_plan(stages, s, microbatches, computation)
        ops, waiting = [], []
        for decision, transfer in zip(computation, plan):
            if transfer is not None:
                waiting.append(Op(transfer[0], transfer[1], s, stages - s - 1))
            if decision is not None:
                ops += waiting + [decision]
                waiting = []
        order[s] = ops + waiting
    return Schedule("bpipe", stages, microbatches, 1, base.routes,
                    tuple(tuple(ops) for ops in order))
