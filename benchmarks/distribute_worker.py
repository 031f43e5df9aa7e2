"""One run of the ``tf.distribute`` benchmark: the custom-loop recipe under ``MirroredStrategy``.

``python -m benchmarks.distribute_worker '<json spec>'`` (started by ``benchmarks.distribute``,
one fresh process per run, as ``benchmarks.worker``) splits the CPU into ``replicas`` logical
devices, builds the program and trains it in one of three modes:

- ``eager``: TensorFlow's custom-loop recipe as its guide writes it, run eagerly (model and
  optimizer in ``strategy.scope()``, ``experimental_distribute_dataset``,
  ``strategy.run(step_fn)`` with a ``tf.GradientTape`` in ``step_fn``,
  ``tf.nn.compute_average_loss`` over the global batch, ``strategy.reduce("SUM", ...)``);
- ``terra``: the same code after ``terra.enable()``, Terra's defaults: whatever Terra does with
  the replicas' tapes is what is measured, and ``terra.stats()`` says what it was;
- ``function``: the same distributed step (``strategy.run`` and the reduce) wrapped in
  ``tf.function``, as TensorFlow recommends.

The split must happen before anything initialises TensorFlow's devices, which is why each run
has a process of its own (a second split in one process raises). The program is built the
same way in every mode from ``seed``: the same data, the same initial weights.

Timing follows ``benchmarks.worker``: ``warmup`` steps run first and their losses are converted
(which waits for everything they started), then ``steps`` steps are timed up to and including
the conversion of their losses, which the loop keeps as tensors and converts after it, so the
timing adds no sync point of its own.
"""

from __future__ import annotations

import time
import traceback

from benchmarks.worker import serve

MODES = ("eager", "terra", "function")
# the program: a Keras 3 MLP large enough that its kernels are a fair share of a step (two
# 256-wide layers), small enough that a run of ~60 steps takes seconds on a busy core
INPUTS, HIDDEN, CLASSES = 128, (256, 256), 10
GLOBAL_BATCH = 64
LEARNING_RATE = 1e-3
STATS = ("iterations", "traces", "coexecuted", "plain_tapes", "fallbacks", "graph_generations",
         "phase")
EXPLAIN_LINES = 12  # of terra.explain() kept in the result


def split_cpu(replicas: int) -> list[str]:
    """Split the physical CPU into ``replicas`` logical devices (before TensorFlow initialises
    its devices) and return their names."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def build(strategy, steps: int, seed: int):
    """The program under ``strategy``: (the distributed step, the distributed dataset's
    iterator). The distributed step runs ``step_fn`` on every replica and sums the replicas'
    losses; ``steps`` global batches of synthetic data drawn from ``seed``."""
    import keras
    import numpy as np
    import tensorflow as tf

    keras.utils.set_random_seed(seed)  # the initial weights
    with strategy.scope():
        model = keras.Sequential([keras.Input((INPUTS,))]
                                 + [keras.layers.Dense(n, activation="relu") for n in HIDDEN]
                                 + [keras.layers.Dense(CLASSES)])
        optimizer = keras.optimizers.Adam(LEARNING_RATE)
        # its slots now, not at the first apply_gradients: a tf.function that creates them
        # on its first call under MirroredStrategy fails ("You must feed a value for
        # placeholder tensor 'cond/...'"); built here in every mode, so the modes run one code
        optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * GLOBAL_BATCH, INPUTS)).astype("float32")
    y = rng.integers(0, CLASSES, steps * GLOBAL_BATCH).astype("int32")
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step_fn(x, y):
        with tf.GradientTape() as tape:  # Terra's after terra.enable()
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    def distributed_step(x, y):
        per_replica = strategy.run(step_fn, args=(x, y))
        return strategy.reduce("SUM", per_replica, axis=None)

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH, drop_remainder=True)
    return distributed_step, iter(strategy.experimental_distribute_dataset(dataset))


def run(mode: str, replicas: int, steps: int, warmup: int, seed: int = 0) -> dict:
    """Train ``warmup + steps`` steps in ``mode`` on ``replicas`` logical CPUs; never raises
    (an error is part of the result)."""
    result = dict(mode=mode, replicas=replicas, steps=steps, warmup=warmup, seed=seed)
    phase = "set-up"
    try:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODES)}")
        devices = split_cpu(replicas)  # before anything else initialises TensorFlow
        import tensorflow as tf

        if mode == "terra":
            import terra

            terra.enable()
        strategy = tf.distribute.MirroredStrategy(devices)
        result["devices"] = devices
        result["replicas_in_sync"] = strategy.num_replicas_in_sync
        import keras

        result["keras_version"] = keras.__version__
        result["tensorflow"] = tf.__version__
        phase = "build"
        distributed_step, batches = build(strategy, warmup + steps, seed)
        if mode == "function":
            distributed_step = tf.function(distributed_step)
        phase = "warm-up"
        start = time.perf_counter()
        losses = [float(distributed_step(*next(batches))) for _ in range(warmup)]
        result["warmup_s"] = time.perf_counter() - start
        phase = "timed steps"
        start = time.perf_counter()
        timed = [distributed_step(*next(batches)) for _ in range(steps)]
        losses += [float(loss) for loss in timed]
        result["timed_s"] = elapsed = time.perf_counter() - start
        result["steps_per_s"] = steps / elapsed
        result["losses"] = losses
        if mode == "function":
            result["traces"] = distributed_step.experimental_get_tracing_count()
    except Exception as e:  # reported, not handled: a failing mode is a result
        result["error"] = f"{type(e).__name__} during {phase}: {str(e).strip()[:300]}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if mode == "terra":
        result.update(_terra_report())
    return result


def _terra_report() -> dict:
    """``terra.stats()``'s counters and the start of ``terra.explain()`` (why tapes ran
    plainly, if they did)."""
    try:
        import terra

        stats = terra.stats()
        explain = str(terra.explain())
        return dict(terra_stats={f: getattr(stats, f) for f in STATS},
                    explain="\n".join(explain.splitlines()[:EXPLAIN_LINES]))
    except Exception as e:  # the report must not hide the run's own outcome
        return dict(report_error=f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    serve(run)
