"""Execution modes: how one program's ``train_step`` is run.

AutoGraph modes wrap the step in ``tf.function`` (the paper compiles a single training step the
same way); Terra modes swap the tape for ``terra.TerraGradientTape`` after ``terra.reset()`` and
``terra.configure(...)``. The floor mode answers every op of its timed steps from a recorded
step (``benchmarks.floor``). Terra is imported only by Terra modes, so the baselines and the
floor run on an untouched TensorFlow. TensorFlow itself is imported on use: the harness
process imports this module and must stay TensorFlow-free.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Mode:
    name: str
    label: str  # for tables and the chart
    autograph: bool = False  # wrap train_step in tf.function
    jit_compile: bool = False  # ... with XLA
    terra: dict | None = None  # terra.configure(...) keywords; None = plain tf.GradientTape
    floor: bool = False  # timed steps answered from the last warm-up step (benchmarks.floor)

    @property
    def xla(self) -> bool:
        return self.jit_compile or bool(self.terra and self.terra.get("xla"))

    @property
    def exact(self) -> bool:
        """Its graph rounds as eager does (Terra without XLA): its losses are compared over
        every step, also where a program's training amplifies a last-bit difference."""
        return self.terra is not None and not self.xla


MODES = {m.name: m for m in [
    Mode("eager", "Eager"),
    Mode("autograph", "AutoGraph", autograph=True),
    Mode("autograph_xla", "AutoGraph+XLA", autograph=True, jit_compile=True),
    Mode("terra", "Terra", terra=dict(disable=False, xla=False, lazy=False)),
    Mode("terra_xla", "Terra+XLA", terra=dict(disable=False, xla=True, lazy=False)),
    Mode("terra_lazy", "Terra LazyEval", terra=dict(disable=False, xla=False, lazy=True)),
    Mode("floor", "Floor", floor=True),
]}

# The AutoGraph mode a Terra mode is compared with ("x AutoGraph" column).
AUTOGRAPH_PEER = {"terra": "autograph", "terra_xla": "autograph_xla", "terra_lazy": "autograph"}


def tape_for(mode: Mode):
    """The tape class a program of this mode is built with (configures Terra first)."""
    if mode.floor:
        from benchmarks.floor import FloorTape

        return FloorTape
    if mode.terra is None:
        import tensorflow as tf

        return tf.GradientTape
    import terra

    terra.reset()
    terra.configure(**mode.terra)
    return terra.TerraGradientTape


def step_fn_for(mode: Mode, program, warmup: int):
    """What the loop calls each step; the floor's records warm-up step ``warmup``."""
    if mode.floor:
        from benchmarks.floor import Floor

        return Floor(program.train_step, record_at=warmup)
    if mode.autograph:
        import tensorflow as tf

        return tf.function(program.train_step, jit_compile=mode.jit_compile)
    return program.train_step


def finish(mode: Mode) -> None:
    """End a Terra mode's state before the next run in the same process (``--inprocess``): its
    last iteration would otherwise take in the ops of whatever runs next."""
    if mode.terra is not None:
        import terra

        terra.reset()


def terra_stats(mode: Mode) -> dict | None:
    """Every public field of ``terra.stats()`` (counters, phase, timing breakdown if present)."""
    if mode.terra is None:
        return None
    import terra

    stats = terra.stats()
    if dataclasses.is_dataclass(stats):
        fields = dataclasses.asdict(stats)
    else:
        fields = {k: getattr(stats, k) for k in dir(stats) if not k.startswith("_")}
    return {k: v for k, v in fields.items()
            if isinstance(v, (int, float, str, bool, type(None)))}
