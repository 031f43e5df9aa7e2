"""Training loops under a ``tf.distribute`` strategy: which ones Terra co-executes, and why the
others run eagerly.

Terra serves one thread of control at a time. A strategy whose ``run`` calls the step on the
calling thread keeps that picture: the default strategy, and ``OneDeviceStrategy``, which
calls it under a device scope and a replica context and runs its reductions and variable
updates (``merge_call``, ``extended.update``) inline. Terra co-executes those loops like any
other.

``MirroredStrategy`` on one worker runs an eager ``strategy.run`` through ``mirrored_run``: one
thread per local replica, started anew for every call, taking turns with the loop's thread
(each runs until its ``merge_call`` or the step's end, the merge runs on the loop's thread,
then the replicas resume in order). Terra follows the turns (``terra.replicas``), so a tape in
such a replica thread is Terra's like the loop's own.

Every other strategy that runs replicas in threads (``MultiWorkerMirroredStrategy``, whose
collective ops meet other processes', ``CentralStorageStrategy``, ``ParameterServerStrategy``)
keeps its tapes plain: they act as plain ``tf.GradientTape``s and the step runs eagerly, with
eager's numbers; ``explain()`` and ``terra.stats().plain_tapes`` say so. The same holds for a
tape entered under a mirrored strategy outside ``strategy.run`` (in its scope), whose
iteration would be the loop's thread's alone while replicas run in others.
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
        if replicas.supported(strategy):
            return (f"a tape in a replica thread of {name}.run called from another thread "
                    "than the training loop's")
        return (f"a tape in a replica thread of {name}.run: Terra follows the replica "
                "threads of tf.distribute.MirroredStrategy on one worker only (a multi-worker "
                "strategy's collective ops meet other processes', which one process's graph "
                "cannot order)")
    return (f"a tape under {name} outside strategy.run: its steps run in replica threads, "
            "which Terra follows only from within strategy.run")


def _public_name(cls):
    """The name the user wrote (``tf.distribute.MultiWorkerMirroredStrategy``, whose class is
    ``CollectiveAllReduceStrategy``): TF's export names, kept on the class."""
    exported = cls.__dict__.get("_tf_api_names")
    return f"tf.{exported[0]}" if exported else cls.__name__
