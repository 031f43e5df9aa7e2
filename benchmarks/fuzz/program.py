"""A program = a base (model, data, loss, optimizer) + a list of feature snippets + a step count.

``generate`` draws one from its seed alone (``random.Random(seed)``), so a program is identified
by its seed and the generation options, and ``python -m benchmarks.fuzz --seed S --count 1``
draws program S again. ``render`` writes it out as the source of a self-contained script: the
training program, then the harness from ``standalone.py``, so the file runs alone. The program
is drawn as data, not text, so the minimizer can drop snippets and statements and render again.
"""

import dataclasses
import random
import textwrap
from pathlib import Path

from . import constants, control, models, state  # noqa: F401  (importing registers the features)
from .snippets import REGISTRY, SLOTS, Snippet, draw

DEFAULT_STEPS = 16
MARKER = "# --- fuzz harness ---\n"


@dataclasses.dataclass(frozen=True)
class Program:
    seed: int
    steps: int
    base: models.Base
    snippets: tuple[Snippet, ...]
    origin: str  # the command that generates this program, or what it was minimized from

    @property
    def features(self) -> list[str]:
        return [s.feature for s in self.snippets]

    def statement_ids(self) -> list[tuple[int, str, int]]:
        """(snippet index, slot, statement index) of every droppable statement."""
        return [(i, slot, k) for i, snip in enumerate(self.snippets) for slot in SLOTS
                for k in range(len(snip.statements(slot)))]


def feature_names(only: list[str] | None = None, disabled: list[str] | None = None) -> list[str]:
    """The features to draw from, in registry order; unknown names raise."""
    unknown = (set(only or []) | set(disabled or [])) - set(REGISTRY)
    if unknown:
        raise ValueError(f"unknown features {sorted(unknown)}; known: {', '.join(REGISTRY)}")
    names = [n for n in REGISTRY if not only or n in only]
    return [n for n in names if n not in (disabled or [])]


def generate(seed: int, steps: int = DEFAULT_STEPS, only=None, disabled=None,
             command: str = "") -> Program:
    rng = random.Random(seed)
    base = models.draw(rng)
    candidates = [REGISTRY[n] for n in feature_names(only, disabled) if REGISTRY[n].fits(base)]
    chosen = rng.sample(candidates, min(rng.randint(2, 6), len(candidates)))
    snippets = tuple(draw(rng, f"f{i}", feat, base) for i, feat in enumerate(chosen))
    return Program(seed, steps, base, snippets, command or f"seed {seed}")


def _block(statements, indent: int) -> list[str]:
    return [textwrap.indent(s, " " * indent) for s in statements]


def _slot(program: Program, slot: str) -> list[str]:
    return [s for snip in program.snippets for s in snip.statements(slot)]


def render(program: Program) -> str:
    """The program's source: a script that trains, then the harness (``main``) that runs it."""
    base = program.base
    features = ", ".join(program.features) or "(none)"
    tape_args = ", ".join(_slot(program, "tape_args"))
    tapes = "".join(f", {t}" for t in _slot(program, "tape_with"))
    body = [
        "def program(tape_cls, log):",
        '    """One imperative training run; returns every logged loss and the final state."""',
        *(["    tape_cls = tf.GradientTape  # the Terra run calls terra.enable() first"]
          if base.enable else []),
        "    K.utils.set_random_seed(SEED)",
        "    random.seed(SEED)",
        "    rng = np.random.default_rng(SEED)",
        "    model = Model()",
        "    params = list(model.trainable_variables)",
        "    extra, optimizers, out, losses = [], [], {}, []",
        "    state = types.SimpleNamespace()",
        "    lr = 0.05",
        *_block(models.optimizer_lines(base), 4),
        *_block(_slot(program, "helpers"), 4),
        "    for step in range(STEPS):",
        "        batch, seq = 8, 4",
        *_block(_slot(program, "shape"), 8),
        "        x, y = make_batch(rng, batch, seq)",
        *_block(_slot(program, "top"), 8),
        f"        with tape_cls({tape_args}) as tape{tapes}:",
        "            h = model.encode(x, training=True)",
        *_block(_slot(program, "forward"), 12),
        "            logits = model.head(h)",
        f"            loss = {models.loss_expression(base)}",
        *_block(_slot(program, "loss"), 12),
        "        grads = tape.gradient(loss, params + extra)",
        "        grads, more = grads[:len(params)], grads[len(params):]",
        *_block(_slot(program, "grads"), 8),
        f"        {models.update_line(base)}",
        "        sgd(zip(more, extra), 0.05)",
        f"        {models.log_line(base)}",
        *_block(_slot(program, "after"), 8),
        *_block(_slot(program, "end"), 4),
        "    optimizer_state = [v for o in optimizers for v in o.variables]",
        '    return {"losses": losses, "variables": list(model.variables) + extra,',
        '            "optimizers": optimizer_state, "out": out}',
    ]
    header = [
        f'"""Fuzz program {program.origin}.',
        "",
        f"Base: {base}.",
        f"Features: {features}.",
        "Run alone: ``python <this file>`` runs it eagerly and under Terra (child processes) and",
        "compares every step's loss and the final variables; exit status 1 on a difference.",
        '"""',
        "",
        *models.imports(base),
        "",
        f"SEED, STEPS = {program.seed}, {program.steps}",
        "D, H, C, V = 6, 8, 3, 20",
        f"LEGACY, ENABLE = {base.legacy}, {base.enable}",
        "",
        "",
        models.model_class(base),
        "",
        models.make_batch(base),
        "",
        HELPERS,
        "",
        *body,
        "",
        "",
    ]
    return "\n".join(header) + harness_source() + (
        '\n\nif __name__ == "__main__":\n    main(program, LEGACY, ENABLE)\n')


HELPERS = '''def sgd(pairs, lr):
    """Hand-written SGD: v.assign_sub(lr * g), sparse gradients scattered (a Keras 3 variable
    has no scatter_sub: densified)."""
    for g, v in pairs:
        if isinstance(g, tf.IndexedSlices) and hasattr(v, "scatter_sub"):
            v.scatter_sub(tf.IndexedSlices(lr * g.values, g.indices))
        elif isinstance(g, tf.IndexedSlices):
            v.assign_sub(lr * tf.convert_to_tensor(g))
        elif g is not None:
            v.assign_sub(lr * g)


def add_grads(a, b):
    if a is None or b is None:
        return b if a is None else a
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)

'''


def harness_source() -> str:
    text = (Path(__file__).parent / "standalone.py").read_text()
    return text[text.index(MARKER):]
