"""Child process of the pipeline execution tests: TensorFlow's devices must be configured
before TensorFlow initialises them, which a pytest process that already ran TF has done.

``python tests/pipeline_worker.py schedules`` trains a model on 4 logical CPUs with every
schedule; ``... multihost`` runs it on two in-process ``tf.distribute.Server``s. Each prints one
JSON line of results for the parent test to check.
"""

import json
import os
import socket
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import terra.pipeline as tp  # noqa: E402
from terra.pipeline.charts import default_costs  # noqa: E402

# Float64 makes the comparison with the unpipelined step about the schedule, not about float32
# rounding of a sum taken in another order.
keras.backend.set_floatx("float64")
tf.get_logger().setLevel("ERROR")  # each schedule's Pipeline traces its own step function
WIDTH, LAYERS, BATCH = 16, 8, 32
LOSS = keras.losses.MeanSquaredError()
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("bitpipe", 2), ("2bp-gpipe", 1),
         ("2bp-1f1b", 1), ("bpipe", 1)]


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.layers.Dense(WIDTH, activation="tanh")
                             for _ in range(LAYERS - 1)] + [keras.layers.Dense(WIDTH)])


def data(step):
    x = tf.random.stateless_normal((BATCH, WIDTH), seed=(step, 1), dtype=tf.float64)
    return x, tf.sin(x)


def reference_step(net, optimizer):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, net(x))
        grads = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables))
        return loss, grads
    return step


def stages_of(net, count):
    per = LAYERS // count
    return [tp.Stage(net.layers[i * per:(i + 1) * per]) for i in range(count)]


def compare(plan, devices, steps):
    """Gradients of one step and ``steps`` losses, pipelined and not, from the same weights."""
    net, twin = model(), model()
    x, y = data(0)
    pipe = tp.Pipeline(stages_of(net, plan.num_stages), plan, LOSS,
                       keras.optimizers.Adam(0.01), devices=devices)
    pipe.build(x)
    twin(x)
    twin.set_weights(net.get_weights())
    _, grads = pipe.gradients(x, y)
    with tf.GradientTape() as tape:
        loss = LOSS(y, twin(x))
    expected = tape.gradient(loss, twin.trainable_variables)
    ref = reference_step(twin, keras.optimizers.Adam(0.01))
    losses, ref_losses = [], []
    for step in range(steps):
        xs, ys = data(step)
        losses.append(float(pipe.train_step(xs, ys)))
        ref_losses.append(float(ref(xs, ys)[0]))
    return {"grads": [g.numpy().tolist() for g in grads],
            "expected": [g.numpy().tolist() for g in expected],
            "losses": losses, "ref_losses": ref_losses,
            "peak_bytes": list(pipe.peak_bytes),
            "devices": sorted({v.value.device for v in pipe.trainable_variables})}


def schedules():
    devices = tp.logical_cpus(4)
    out = {}
    for kind, chunks in KINDS:
        plan = tp.schedule(kind, 4, 8, chunks=chunks)
        out[kind] = compare(plan, devices, 20)
        simulated = tp.simulate(plan, **default_costs(plan))
        out[kind]["simulated"] = [str(held) for held in simulated.peak_activations]
    net = model()
    net(data(0)[0])
    out["split"] = [len(stage.layers) for stage in tp.split_model(net, 4, data(0)[0])]
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multihost():
    cluster = tf.train.ClusterSpec({"worker": [f"127.0.0.1:{free_port()}" for _ in range(2)]})
    servers = [tf.distribute.Server(cluster, job_name="worker", task_index=i)
               for i in range(2)]
    tf.config.experimental_connect_to_cluster(cluster)
    devices = [f"/job:worker/replica:0/task:{i}/device:CPU:0" for i in range(2)]
    out = {kind: compare(tp.schedule(kind, 2, 4), devices, 5) for kind in ("gpipe", "1f1b")}
    out["servers"] = len(servers)
    return out


if __name__ == "__main__":
    result = {"schedules": schedules, "multihost": multihost}[sys.argv[1]]()
    print(json.dumps(result, default=lambda v: np.asarray(v).tolist()))
