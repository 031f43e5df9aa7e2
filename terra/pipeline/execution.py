"""Run one training step of a schedule on TensorFlow devices, one stage per device.

The whole step is one ``tf.function``: every operation of the schedule becomes graph ops placed
with ``tf.device`` on its device, and a control dependency on the previous operation of the same
device makes each device run its operations in the schedule's order. TensorFlow inserts the
cross-device copies of activations and gradients (send / receive between logical devices, gRPC
between ``/job:worker`` tasks).

A stage keeps the *input* of each micro-batch it has run forward and recomputes its forward
inside the backward. A GradientTape's saved tensors cannot be handed to another device, and
BPipe has to move a micro-batch's saved activations to its acceptor and back; keeping the input
makes that a real copy of a real tensor (``tf.identity`` under the peer's device). It also means
the stages must be deterministic functions of their input (no dropout).
"""

from __future__ import annotations

import tensorflow as tf

from terra.pipeline.charts import default_costs
from terra.pipeline.schedules import Schedule
from terra.pipeline.simulator import peak_held, simulate


def logical_cpus(count: int) -> list[str]:
    """Split the host CPU into ``count`` logical devices; call before TensorFlow uses a device."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(count)])
    return [device.name for device in tf.config.list_logical_devices("CPU")]


def default_devices(count: int) -> list[str]:
    """GPUs when there are enough, else logical CPUs (see :func:`logical_cpus`)."""
    for kind in ("GPU", "CPU"):
        names = [device.name for device in tf.config.list_logical_devices(kind)]
        if len(names) >= count:
            return names[:count]
    raise ValueError(f"{count} devices needed; call terra.pipeline.logical_cpus({count}) "
                     "before TensorFlow initialises its devices, or pass devices=")


def _variables(stage):
    return list(getattr(stage, "trainable_variables", []))


class Pipeline:
    """Train ``stages`` (Keras layers / models / :class:`Stage` or callables) with ``schedule``.

    ``loss_fn(y, prediction)`` must average over the batch: a micro-batch's loss is divided by
    the number of micro-batches, so the summed gradients are those of the whole batch's mean.
    """

    def __init__(self, stages, schedule: Schedule, loss_fn, optimizer, devices=None):
        if len(stages) != schedule.num_stages:
            raise ValueError(f"{schedule.kind} with {schedule.devices} devices and "
                             f"{schedule.chunks} chunks needs {schedule.num_stages} stages, "
                             f"got {len(stages)}")
        self.stages = list(stages)
        self.schedule = schedule
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.devices = list(devices or default_devices(schedule.devices))
        # The order in which ops are added to the graph: any order that respects the data
        # dependencies would do, since control dependencies fix each device's own order.
        self._timeline = simulate(schedule, **default_costs(schedule)).timeline
        self.peak_bytes: tuple[int, ...] | None = None
        self._gradients = tf.function(self._run)
        self._train = tf.function(self._train_step)

    @property
    def trainable_variables(self):
        return [v for stage in self.stages for v in _variables(stage)]

    def build(self, x):
        """Create the stages' variables, each on the device of its stage's first use."""
        route = self.schedule.routes[0]
        h = x[: x.shape[0] // self.schedule.microbatches]
        for s, stage in enumerate(self.stages):
            with tf.device(self.devices[route[s]]):
                h = stage(h)

    def gradients(self, x, y):
        """The step's loss and the gradients of :attr:`trainable_variables`, not applied."""
        return self._gradients(x, y)

    def train_step(self, x, y):
        """Run the schedule on ``(x, y)`` and apply the summed gradients; returns the loss."""
        return self._train(x, y)

    def _train_step(self, x, y):
        loss, grads = self._run(x, y)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return loss

    def _run(self, x, y):
        schedule, n = self.schedule, self.schedule.microbatches
        xs, ys = tf.split(x, n), tf.split(y, n)
        last = schedule.num_stages - 1
        saved, sent, tapes, losses, sizes = {}, {}, {}, [], {}
        grads = [[] for _ in self.stages]
        previous = [None] * schedule.devices

        for d, op, _start, _end in self._timeline:
            m, s = op.microbatch, op.stage
            stage = self.stages[s]
            after = [previous[d]] if previous[d] is not None else []
            with tf.device(self.devices[d]), tf.control_dependencies(after):
                if op.kind == "F":
                    saved[m, s] = tf.identity(xs[m] if s == 0 else sent["F", m, s - 1])
                    sizes[m, s] = saved[m, s].shape.num_elements() * saved[m, s].dtype.size
                    out = stage(saved[m, s])
                    if s == last:
                        out = self.loss_fn(ys[m], out) / n
                        losses.append(out)
                    sent["F", m, s] = out
                    marker = out
                elif op.kind == "B":
                    marker = self._backward(op, saved, sent, tapes, grads, last, ys, n)
                elif op.kind == "W":
                    tape, target, upstream = tapes.pop((m, s))
                    weights = tape.gradient(target, _variables(stage), output_gradients=upstream)
                    grads[s].append(weights)
                    marker = tf.group(*weights)
                else:  # a BPipe transfer: a copy to or from the peer, beside the computation
                    where = schedule.device_of(m, op.peer) if op.kind == "EVICT" else d
                    with tf.device(self.devices[where]):
                        saved[m, s] = tf.identity(saved[m, s])
                    continue
            previous[d] = marker
        # What each device holds, in bytes, counted in the order the simulator times the ops
        # (TensorFlow reports no memory statistics for CPU devices).
        self.peak_bytes = peak_held(schedule, self._timeline,
                                    lambda op: sizes[op.microbatch, op.stage], zero=0)
        summed = [tf.add_n(list(parts)) if len(parts) > 1 else parts[0]
                  for s in range(len(self.stages)) if grads[s]
                  for parts in zip(*grads[s])]
        return tf.add_n(losses), summed

    def _backward(self, op, saved, sent, tapes, grads, last, ys, n):
        """dL/d(input) (and dL/dw unless 2BP defers it to ``W``), recomputing the forward."""
        m, s = op.microbatch, op.stage
        stage, inp = self.stages[s], saved.pop((m, s))
        split = self.schedule.split_backward
        with tf.GradientTape(persistent=split) as tape:
            tape.watch(inp)
            target = stage(inp)
            if s == last:
                target = self.loss_fn(ys[m], target) / n
        upstream = None if s == last else sent.pop(("B", m, s + 1))
        if split:
            tapes[m, s] = (tape, target, upstream)
            wrt = [inp]
        else:
            wrt = [inp] + _variables(stage)
        result = tape.gradient(target, wrt, output_gradients=upstream)
        if s:
            sent["B", m, s] = result[0]
        if not split:
            grads[s].append(result[1:])
        return tf.group(*[g for g in result if g is not None])
