"""``python -m benchmarks.mirrored``: a custom training loop under ``MirroredStrategy`` over two
logical CPUs, three ways, each in a fresh process (the CPU is split before TensorFlow starts):

- ``eager``: ``strategy.run(step)`` with ``tf.GradientTape``, TensorFlow alone (each call runs
  the replicas' steps in threads of their own, taking turns);
- ``terra``: the same loop with ``terra.TerraGradientTape`` (Terra's defaults, cost budget
  included);
- ``function``: ``strategy.run`` and the reduction inside one ``tf.function``, as TF advises.

The loop is TF's custom-loop recipe on an MLP (``--width`` units, two hidden layers) with Adam,
a global batch of 64. Reported: steps/s over the second half of ``--steps`` (tracing and graph
building come before), the median of ``--repeats`` rounds, and whether the losses equal the
eager run's bit for bit.

    python -m benchmarks.mirrored --steps 200 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("eager", "terra", "function")


def _child(mode, steps, width):
    import numpy as np
    import tensorflow as tf

    import terra

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf.keras.Sequential([tf.keras.Input((64,)),
                                     tf.keras.layers.Dense(width, activation="relu"),
                                     tf.keras.layers.Dense(width, activation="relu"),
                                     tf.keras.layers.Dense(10)])
        optimizer = tf.keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)  # not inside the tf.function's first call
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * 64, 64)).astype("float32")
    y = rng.integers(0, 10, steps * 64).astype("int32")
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    tape_cls = terra.TerraGradientTape if mode == "terra" else tf.GradientTape

    def step_fn(x, y):
        with tape_cls() as tape:
            loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)),
                                              global_batch_size=64)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def step(x, y):
        return strategy.reduce("SUM", strategy.run(step_fn, args=(x, y)), axis=None)

    if mode == "function":
        step = tf.function(step)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    losses, began = [], None
    for i, (bx, by) in enumerate(strategy.experimental_distribute_dataset(dataset)):
        if i == steps // 2:
            began = time.perf_counter()
        losses.append(step(bx, by))
    losses = [float(v) for v in losses]  # read after the loop: no wait in the timed steps
    took = time.perf_counter() - began
    stats = vars(terra.stats()) if mode == "terra" else {}
    return {"rate": (steps - steps // 2) / took, "losses": losses,
            "coexecuted": stats.get("coexecuted"), "phase": stats.get("phase")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    results = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            done = subprocess.run([sys.executable, "-m", "benchmarks.mirrored", "--child", mode,
                                   str(args.steps), str(args.width)], capture_output=True,
                                  text=True, env=env, check=True)
            results[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
    eager = results["eager"][0]["losses"]
    for mode in MODES:
        runs = results[mode]
        rates = sorted(r["rate"] for r in runs)
        same = all(r["losses"] == eager for r in runs)
        extra = f", co-executed {runs[0]['coexecuted']} of {args.steps}, phase " \
                f"{runs[0]['phase']}" if mode == "terra" else ""
        print(f"{mode:9s} {statistics.median(rates):8.1f} steps/s (rounds {rates[0]:.1f}-"
              f"{rates[-1]:.1f})  losses equal eager's: {same}{extra}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
    else:
        main()
