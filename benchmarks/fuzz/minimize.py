"""Shrink a failing program while it still fails the same way (same kind; for a crash, the
same exception type).

Greedy one-at-a-time reduction in the spirit of delta debugging ("Simplifying and Isolating
Failure-Inducing Input"), on the program's structure rather than its text: drop whole feature
snippets, then single statements, then simplify the base (no dropout/normalization, plain
logging, no global enablement, manual SGD), then cut steps. A candidate that eager itself
rejects (a dropped statement defined a name used later) is simply not a failure and is
skipped. The program is first run again: a failure that does not repeat (timing-dependent, or
fixed since) is not minimized. Every trial costs two processes, so their number is bounded.
"""

import dataclasses

from .program import Program
from .runner import Result

DEFAULT_TRIALS = 24


def minimize(result: Result, run, trials: int = DEFAULT_TRIALS) -> Result | None:
    """The smallest variant of ``result.program`` found within ``trials`` runs of ``run``, or
    None if the program itself no longer fails the same way when run again."""
    best, left = result, trials

    def attempt(candidate: Program) -> bool:
        nonlocal best, left
        if left <= 0:
            return False
        left -= 1
        outcome = run(candidate)
        if outcome.failed and outcome.signature() == result.signature():
            best = outcome
            return True
        return False

    if not attempt(result.program):  # flaky, or fixed meanwhile: nothing to minimize
        return None
    changed = True
    while changed and left > 0:
        changed = False
        for index in reversed(range(len(best.program.snippets))):
            snippets = best.program.snippets
            changed |= attempt(_with(best.program, snippets[:index] + snippets[index + 1:]))
    for index, slot, k in reversed(best.program.statement_ids()):
        snippets = list(best.program.snippets)
        if index < len(snippets) and k < len(snippets[index].statements(slot)):
            snippets[index] = snippets[index].without(slot, k)
            attempt(_with(best.program, tuple(s for s in snippets if s.slots)))
    for change in _simpler_bases(best.program.base):
        attempt(_with(best.program, base=dataclasses.replace(best.program.base, **change)))
    step, total = best.verdict.get("step"), best.program.steps
    for steps in sorted({6, 8, 10, total - 2, (step or 0) + 2} - {total}):
        if steps < best.program.steps and attempt(_with(best.program, steps=steps)):
            break
    return best


def _simpler_bases(base):
    changes = [{"dropout": False}, {"norm": False}, {"logging": "float"}, {"enable": False},
               {"optimizer": "manual"}, {"loss": "mse"}]
    return [c for c in changes if any(getattr(base, k) != v for k, v in c.items())]


def _with(program: Program, snippets=None, base=None, steps=None) -> Program:
    note = program.origin if "minimized" in program.origin else f"{program.origin}, minimized"
    return dataclasses.replace(
        program, snippets=program.snippets if snippets is None else snippets,
        base=base or program.base, steps=steps or program.steps, origin=note)
