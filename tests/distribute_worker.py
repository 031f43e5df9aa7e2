"""Programs of the tf.distribute tests, and the worker process of the multi-worker one.

A strategy over two logical CPUs has to split the CPU before TensorFlow initialises its
devices, and ``MultiWorkerMirroredStrategy`` configures the process's one eager context for its
cluster, so these programs run in child processes: the single-host ones through
``assert_same_as_eager(..., env=...)``, the multi-worker one as ``python distribute_worker.py``
with ``TF_CONFIG`` set, once per worker. A worker runs its program eagerly, then under Terra,
and prints one JSON line: both runs' results, ``terra.stats()`` and ``terra.explain()``.
"""

import contextlib
import json
import sys

import tensorflow as tf
from differential import _encode, record_stats, run_both
from tiny_models import classification_data, mlp, state

import terra

GLOBAL_BATCH = 16


def two_cpus():
    """Split the CPU into two logical devices (once: the eager and the Terra run share it)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    if not tf.config.get_logical_device_configuration(cpu):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def distributed_loop(strategy, tape_cls, steps, python_in_step=False, penalty_from=None,
                     synchronized_bn=False, apply_in_tape=False, reduce_in_backward=False):
    """A custom training loop as TensorFlow's guide writes it: model and optimizer in the
    strategy's scope, a per-replica step with the loss averaged over the global batch, the
    step run by ``strategy.run`` and the replicas' losses summed.
    Returns every step's loss, every variable and, per variable, every replica's copy.
    ``python_in_step``: each replica's step also reads its loss in Python, prints it and
    branches on the largest per-example loss (returned too: ``read``). ``penalty_from``: from
    that step on, the second replica's loss gains a weight penalty (a new path in its turn).
    ``synchronized_bn``: a batch normalization synchronized across the replicas after the
    hidden layer, whose forward and backward passes reduce over the replicas.
    ``apply_in_tape``: the gradient and the optimizer's update inside the (persistent) tape's
    ``with`` block, so the tape is open across the update's ``merge_call``.
    ``reduce_in_backward``: the logits' gradient is summed over the replicas in the backward
    pass (a custom gradient), so the gradient call lets the other replicas run."""

    @tf.custom_gradient
    def summed_in_backward(logits):
        def grad(upstream):
            return tf.distribute.get_replica_context().all_reduce("SUM", upstream)
        return tf.identity(logits), grad
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = tf.keras.Sequential([
            tf.keras.Input((20,)), tf.keras.layers.Dense(16),
            tf.keras.layers.BatchNormalization(synchronized=True), tf.keras.layers.ReLU(),
            tf.keras.layers.Dense(5)]) if synchronized_bn else mlp(20, (16,), 5)
        optimizer = tf.keras.optimizers.Adam(1e-2)
    data = classification_data(steps * GLOBAL_BATCH, 20, 5)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def step_fn(x, y):
        with tape_cls(persistent=apply_in_tape) as tape:
            logits = model(x, training=True)
            per_example = loss_fn(y, summed_in_backward(logits) if reduce_in_backward else logits)
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
            if python_in_step and per_example.numpy().max() > 50.0:  # a branch on a value
                loss = loss * 0.5
            if penalty_from is not None and len(losses) >= penalty_from and \
                    tf.distribute.get_replica_context().replica_id_in_sync_group == 1:
                loss += 1e-3 * tf.add_n([tf.nn.l2_loss(w) for w in model.trainable_variables])
            if apply_in_tape:
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
                return loss
        if python_in_step:
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            read.append(float(loss))
            print(f"replica {replica}: loss {read[-1]:.4f}")
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    dataset = tf.data.Dataset.from_tensor_slices(data).batch(GLOBAL_BATCH)
    losses, read = [], []
    for x, y in strategy.experimental_distribute_dataset(dataset):
        per_replica = strategy.run(step_fn, args=(x, y))
        losses.append(float(strategy.reduce("SUM", per_replica, axis=None)))
        record_stats(f"step{len(losses)}")
    copies = [list(strategy.experimental_local_results(v)) for v in model.variables]
    result = {"losses": losses, **state(model, optimizer), "replicas": copies}
    return dict(result, read=read) if python_in_step else result


def mirrored(tape_cls, steps):
    two_cpus()
    return distributed_loop(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), tape_cls,
                            steps)


def mirrored_python_in_step(tape_cls, steps):
    two_cpus()
    return distributed_loop(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), tape_cls,
                            steps, python_in_step=True)


def mirrored_new_path(tape_cls, steps):
    two_cpus()
    return distributed_loop(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), tape_cls,
                            steps, penalty_from=steps // 2)


def mirrored_synchronized_bn(tape_cls, steps):
    two_cpus()
    return distributed_loop(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), tape_cls,
                            steps, synchronized_bn=True)


def mirrored_apply_in_tape(tape_cls, steps):
    two_cpus()
    return distributed_loop(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), tape_cls,
                            steps, apply_in_tape=True)


def mirrored_reduce_in_backward(tape_cls, steps):
    two_cpus()
    return distributed_loop(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]), tape_cls,
                            steps, reduce_in_backward=True)


def mirrored_fit(tape_cls, steps):
    """Keras' ``fit(run_eagerly=True)`` under the strategy, for two epochs of ``steps``
    batches (Terra through ``terra.enabled()``): Keras' own ``strategy.run`` of its step."""
    two_cpus()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    tf.keras.utils.set_random_seed(0)
    with strategy.scope():
        model = mlp(20, (16,), 5)
        model.compile(optimizer=tf.keras.optimizers.Adam(1e-2), run_eagerly=True,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = classification_data(steps * GLOBAL_BATCH, 20, 5)
    with terra.enabled() if tape_cls is not tf.GradientTape else contextlib.nullcontext():
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=2, verbose=0, shuffle=False)
    copies = [list(strategy.experimental_local_results(v)) for v in model.variables]
    return {"losses": history.history["loss"], "model": list(model.variables),
            "replicas": copies}


def one_device(tape_cls, steps):
    """On the second logical CPU, so the strategy's device scope is not the default device."""
    two_cpus()
    return distributed_loop(tf.distribute.OneDeviceStrategy("/cpu:1"), tape_cls, steps)


_strategy = []  # the process's one MultiWorkerMirroredStrategy, shared by both runs


def multi_worker(tape_cls, steps):
    if not _strategy:
        _strategy.append(tf.distribute.MultiWorkerMirroredStrategy())
    return distributed_loop(_strategy[0], tape_cls, steps)


if __name__ == "__main__":
    outcome = run_both(multi_worker, int(sys.argv[1]))
    print(json.dumps(_encode({"eager": outcome.eager, "terra": outcome.terra,
                              "stats": vars(outcome.stats), "explain": outcome.explain})))
