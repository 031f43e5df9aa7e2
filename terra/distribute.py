"""Training loops under a ``tf.distribute`` strategy: which ones Terra co-executes, and why the
others run eagerly.

Terra intercepts the ops of one thread, the training loop's (``terra.interception``), and its
skeleton stands for that thread's Python. A strategy whose ``run`` calls the step on the
calling thread keeps that picture: the default strategy, and ``OneDeviceStrategy``, which
calls it under a device scope and a replica context and runs its reductions and variable
updates (``merge_call``, ``extended.update``) inline. Terra co-executes those loops like any
other.

Every other strategy (``MirroredStrategy``, even over one device,
``MultiWorkerMirroredStrategy``, ``CentralStorageStrategy``, ``ParameterServerStrategy``) runs
an eager ``strategy.run`` through ``mirrored_run``: one thread per local replica, started anew
for every call, taking turns. Each replica's step runs until a ``merge_call`` (the
optimizer's all-reduce), where it pauses and hands its values to the loop's thread, which
reduces the replicas' gradients and updates each replica's copy of the variables before the
replica threads go on. One iteration is then the ops of several threads, interleaved by the
strategy, with values passed between them. Terra's doors, its recorder and its skeleton serve
one thread, so a tape there acts as a plain ``tf.GradientTape`` and the step runs eagerly, with
eager's numbers; ``explain()`` and ``terra.stats().plain_tapes`` say so. The same holds for a
tape entered under such a strategy outside ``strategy.run`` (in its scope).
"""

import threading

from tensorflow.python.distribute import distribute_lib, mirrored_run, one_device_strategy

from terra import replicas


def why_plain():
    """Why a tape entered now must act as a plain GradientTape because of the ``tf.distribute``
    strategy around it, or None where Terra can co-execute it."""
    if not distribute_lib.has_strategy():  # the default strategy: run calls the step inline
        return None
    strategy = distribute_lib.get_strategy()
    if isinstance(strategy.extended, one_device_strategy.OneDeviceExtended):
        return None
    name = _public_name(type(strategy))
    thread = threading.current_thread()
    if replicas.replica_of(thread) is not None:
        return None  # a MirroredStrategy's replica: its turns are the loop's (terra.replicas)
    if isinstance(thread, mirrored_run._MirroredReplicaThread):
        return (f"a tape in a replica thread of {name}.run: an eager strategy.run runs each "
                "replica's step in a thread of its own, new for every call, and reduces the "
                "replicas' values on the loop's thread between them; Terra co-executes the "
                "ops of one thread")
    return (f"a tape under {name} outside strategy.run: its steps run in replica threads, "
            "which Terra does not co-execute")


def _public_name(cls):
    """The name the user wrote (``tf.distribute.MultiWorkerMirroredStrategy``, whose class is
    ``CollectiveAllReduceStrategy``): TF's export names, kept on the class."""
    exported = cls.__dict__.get("_tf_api_names")
    return f"tf.{exported[0]}" if exported else cls.__name__
