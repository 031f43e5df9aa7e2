"""The benchmark programs: ordinary imperative TF2 training loops on synthetic data.

Every program is a class with the same small interface::

    prog = load("mlp")(config="quick", seed=0, tape=tf.GradientTape)
    for batch in prog.batches(steps):          # per-step inputs (tensors, numpy, python)
        out = step_fn(*batch)                  # step_fn = prog.train_step, or a tf.function of it
        loss = prog.after_step(out)            # the rest of the loop body (logging, attributes)

``train_step`` is one training step written with ``with self.tape() as tape:`` so that the
harness can swap in ``terra.TerraGradientTape``; it returns the loss tensor (or a tuple of loss
tensors) without materializing it, unless materializing is the program's point. ``after_step``
is the part of the loop body after the step call; it is eager in every mode (that is where a
program logs with ``.numpy()`` or reads an attribute its step wrote) and by default returns
``out`` unchanged. :func:`run` is that loop.

Two programs built with the same seed see the same data and the same initial weights, and all
randomness inside a step comes from seeded generators: Keras 3's seed generators and
``base.SeedStream`` (stateless ops plus a seed variable), or under tf_keras its layers' random
ops seeded from the global seed. So eager, ``tf.function`` and Terra runs of one program are
comparable loss by loss.

The programs take ``keras`` from ``benchmarks.programs.base``: Keras 3, or tf_keras when the
process was started with ``TF_USE_LEGACY_KERAS=1`` (``python -m benchmarks --keras 2``).

This module does not import TensorFlow (the harness process must not); the program modules and
:class:`Program` (``benchmarks.programs.base``) do.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple


class Entry(NamedTuple):
    target: str  # "module:Class" in this package
    warmup: int  # default warm-up steps (quick config): tracing, graph generation, XLA compiles
    steps: int  # default timed steps (quick config): roughly 1-5 s of eager time
    # Losses compared with eager's: all steps, or only the first n where training is chaotic
    # (graph-level rewrites change rounding and the program amplifies it; see resnet50). Terra
    # without XLA rounds as eager does and is compared over every step (``Mode.exact``).
    compare_steps: int | None = None
    # Draws TF random numbers inside the step (dropout, noise). Under XLA the stateless random
    # ops yield other numbers than TF's kernels, so AutoGraph+XLA cannot match eager's losses
    # (Terra+XLA leaves random ops out of XLA's clusters).
    random: bool = False
    # Eager's own losses vary between runs (multi-threaded kernels whose reduction order
    # depends on timing): every mode of this program runs with TF's op determinism, which
    # costs speed (the MLP's eager step: ~13 -> ~18 ms), so only where it is needed.
    op_determinism: bool = False


REGISTRY = {
    "mlp": Entry("mlp:MLP", 10, 200),
    "convnet": Entry("convnet:ConvNet", 10, 100),
    # Terra's graph is instantiated in the background while iterations 4-8 run eagerly
    # (an eager step is ~0.5 s): with fewer warm-up steps the timed ones began with eager
    # steps, start-up that the start-up column reports, not the speed of the steps after it.
    "resnet50": Entry("resnet50:ResNet50", 9, 8, compare_steps=1),
    "bert_qa": Entry("bert_qa:BertQA", 8, 20, random=True),
    # likewise: its graph is instantiated while iterations 4-9 run eagerly (~0.2 s each)
    "yolov3": Entry("yolov3:YOLOv3", 12, 12),
    "dcgan": Entry("dcgan:DCGAN", 8, 30, random=True),
    "gpt2": Entry("gpt2:GPT2", 12, 20, random=True),
    "bert_cls": Entry("bert_cls:BertCls", 8, 20, random=True),
    "dropblock": Entry("dropblock:DropBlock", 8, 40, random=True),
    # Grappler's rewrites round differently from eager kernels (2e-7 relative at the first
    # co-executed step; bit-identical with Grappler off) and the random down-sampling
    # amplifies it to ~3e-4 within ten steps: compared over the warm-up steps.
    "sdpoint": Entry("sdpoint:SDPoint", 12, 20, compare_steps=12),
    "fasterrcnn": Entry("fasterrcnn:FasterRCNN", 10, 40, op_determinism=True),
    "music_transformer": Entry("music_transformer:MusicTransformer", 8, 24, random=True),
}

# The ten programs of the paper's evaluation (Table 3.1 / Fig. 3.10), in its order.
PAPER = [
    "resnet50", "bert_qa", "yolov3", "dcgan", "gpt2",
    "bert_cls", "dropblock", "sdpoint", "fasterrcnn", "music_transformer",
]


def load(name: str):
    """The program class registered under ``name`` (imports TensorFlow)."""
    try:
        module, cls = REGISTRY[name].target.split(":")
    except KeyError:
        raise KeyError(f"unknown program {name!r}; known: {', '.join(REGISTRY)}") from None
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls)


def run(program, steps: int, step_fn=None) -> list:
    """Run ``steps`` training steps; return the losses as floats (tuples for multi-loss steps).

    Loss tensors are only converted after the loop, so the loop itself adds no sync point
    beyond those the program makes.
    """
    step_fn = step_fn or program.train_step
    losses = []
    for batch in program.batches(steps):
        losses.append(program.after_step(step_fn(*batch)))
    return [_to_float(loss) for loss in losses]


def _to_float(loss):
    if isinstance(loss, (tuple, list)):
        return tuple(float(x) for x in loss)
    return float(loss)


def __getattr__(name):
    if name == "Program":  # lazily: it needs TensorFlow
        from benchmarks.programs.base import Program

        return Program
    raise AttributeError(name)
