"""The names emission gives the graph values it keeps while it builds the function's body
(its environment): a node's output (:class:`Out`), an external value an input reads
(:class:`Read`), the value a slot with several producers takes on the path run
(:class:`Phi`). Typed, so that an output and an input of one node never share a key; the
switch-cases' exports (:func:`exports_of`) and the phi slots each value updates
(``graph_builder.feeds_and_fetches``) are keyed by them too."""

import dataclasses

from terra.nodes import SlotKind, relax


@dataclasses.dataclass(frozen=True, slots=True)
class Out:
    """Emission key of output ``out`` of ``node``'s graph op."""

    node: object
    out: int


@dataclasses.dataclass(frozen=True, slots=True)
class Read:
    """Emission key of the external value input ``index`` of ``node`` reads (fed, captured
    or constant), which ``same`` slots of later nodes read again."""

    node: object
    index: int


@dataclasses.dataclass(frozen=True, slots=True)
class Phi:
    """Emission key of the value a slot with several producers takes on the path run (the
    slot's id): whichever producer ran last defines it."""

    slot: int


def producer_key(kind, node, out):
    """The key of what a ``node`` (``Out``) or ``same`` (``Read``) slot's producer gives."""
    return Out(node, out) if kind is SlotKind.NODE else Read(node, out)


def value_key(slot):
    """The key under which emission keeps the graph value a ``node``/``same`` slot reads."""
    if len(slot.alts) > 1:
        return Phi(id(slot))
    return producer_key(slot.kind, *slot.alts[0])


def spec(key, slots):
    """(dtype enum, shape) of an emission key's value, for a branch's placeholder."""
    if type(key) is Out:
        return key.node.out_specs[key.out][1], key.node.out_relaxed[key.out]
    if type(key) is Read:
        slot = key.node.inputs[key.index]
        return slot.dtype, slot.shape
    phi = slots[key.slot]
    specs = [spec(producer_key(phi.kind, *p), slots) for p in phi.alts]
    shape = specs[0][1]
    for _, other in specs[1:]:
        shape = relax(shape, other)
    return specs[0][0], shape


def exports_of(planned, steps):
    """Per switch-case: the emission keys its branches must return (read by a later one)."""
    sc_of = {}
    for j, (sc, _, _) in enumerate(planned):
        for case in sc.cases:
            for head in case.block:
                sc_of[head] = j
                for body_step in steps[head].body:
                    sc_of[body_step.node] = j
    exports = [dict() for _ in planned]  # ordered sets
    for node, step in steps.items():
        for slot in step.slots:
            if slot.kind not in (SlotKind.NODE, SlotKind.SAME):
                continue
            key = value_key(slot)
            for p, _ in slot.alts:
                if sc_of[p] != sc_of[node]:
                    exports[sc_of[p]][key] = None
    return [list(e) for e in exports]
