"""Feature snippets: small templates with a sampling function, composed into a program.

A feature's ``make(rng, tag, base)`` draws its parameters and returns the statements it adds,
per *slot* of the program skeleton (see ``program.render``). ``tag`` (``f0``, ``f1``, ...)
prefixes every name a snippet introduces, so any subset of features composes and any of them
can be dropped again by the minimizer. Statements are whole Python statements (an ``if`` with
its block is one), so dropping one leaves valid code.

Slots, in program order: ``helpers`` (before the loop), ``shape`` (choose ``batch``/``seq``),
``top`` (loop body before the tape), ``tape_args``/``tape_with`` (the ``with`` line: arguments
of the main tape, further tapes opened with it), ``forward`` (inside the tape, rewrites ``h``),
``loss`` (inside the tape, rewrites ``loss``), ``grads`` (rewrites ``grads`` before the update),
``after`` (after the update and the loss log), ``end`` (after the loop; writes ``out``).
"""

import dataclasses
import random
from collections.abc import Callable

SLOTS = ("helpers", "shape", "top", "tape_args", "tape_with", "forward", "loss", "grads",
         "after", "end")


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    make: Callable  # (rng, tag, base) -> {slot: [statement, ...]}
    fits: Callable  # (base) -> bool: whether the feature makes sense for this model


@dataclasses.dataclass(frozen=True)
class Snippet:
    """One drawn feature: its name and its statements per slot (tuples, so it is hashable)."""

    feature: str
    slots: tuple[tuple[str, tuple[str, ...]], ...]

    def statements(self, slot: str) -> tuple[str, ...]:
        return dict(self.slots).get(slot, ())

    def without(self, slot: str, index: int) -> "Snippet":
        kept = tuple((name, tuple(s for i, s in enumerate(body) if (name, i) != (slot, index)))
                     for name, body in self.slots)
        return Snippet(self.feature, tuple((name, body) for name, body in kept if body))


REGISTRY: dict[str, Feature] = {}


def feature(name: str, fits: Callable = lambda base: True):
    """Register ``make`` under ``name``; features are drawn from REGISTRY in this order."""
    def register(make):
        REGISTRY[name] = Feature(name, make, fits)
        return make
    return register


def draw(rng: random.Random, tag: str, feat: Feature, base) -> Snippet:
    slots = feat.make(rng, tag, base)
    unknown = set(slots) - set(SLOTS)
    if unknown:
        raise ValueError(f"feature {feat.name} writes unknown slots {sorted(unknown)}")
    return Snippet(feat.name, tuple((s, tuple(slots[s])) for s in SLOTS if slots.get(s)))
