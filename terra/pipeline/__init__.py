"""Pipeline parallelism: schedules as data, their exact simulation, and a TensorFlow runner.

``schedule(kind, devices, microbatches, chunks)`` builds the order of operations of GPipe, 1F1B,
interleaved 1F1B, BitPipe, 2BP on GPipe or 1F1B, or BPipe; ``simulate`` times it exactly;
``Pipeline`` trains a model cut into stages with it, one stage per TensorFlow device.
"""

from terra.pipeline.execution import Pipeline, default_devices, logical_cpus
from terra.pipeline.partition import Stage, split_model
from terra.pipeline.schedules import KINDS, Op, Schedule, schedule
from terra.pipeline.simulator import Simulation, simulate

__all__ = ["KINDS", "Op", "Pipeline", "Schedule", "Simulation", "Stage", "default_devices",
           "logical_cpus", "schedule", "simulate", "split_model"]
