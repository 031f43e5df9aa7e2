"""A ``MirroredStrategy``'s collective all-reduce, inside a run Terra follows, as one
``tf.function`` call on the loop's thread.

On CPUs (and GPUs) a ``MirroredStrategy`` reduces the replicas' gradients with
``CollectiveAllReduce``. Eagerly, ``_all_reduce_per_replica_values`` starts a thread pool with
one thread per device, and each thread issues that device's ``CollectiveReduceV2`` ops, which
block until every device's op of the same instance has been issued: the ops of that reduction
come from threads Terra does not serve, concurrently, in no fixed order, and a skeleton
running them for real would reduce its stand-ins' dummy values. In a graph the same method
issues every device's collectives on the calling thread, one after the other, and TF's
executor runs them side by side (``cross_device_ops.CollectiveAllReduce``, its branch for
graphs).

So inside a followed ``strategy.run`` (``terra.replicas``) Terra calls that method through a
``tf.function`` that runs TF's own graph branch: one function call op on the loop's thread,
issued in the merge function's turn, recorded and matched like any other call of a
``tf.function``; TF draws each call's instance key as it does for a function (a value
captured at call time). A collective op is stateful, so the call runs in Python in
co-execution (``opdefs``: not a graph op), on the values the graph computed for its inputs,
and the graph is fed its results. The function reduces each value by itself, as eager
does: the graph branch would pack a device's tensors into one buffer, and over more than two
replicas a ring adds an element's terms in an order that follows where it lies in the buffer
(packed, a four-replica run was 1 ulp off eager's from its second step).
"""

import functools
import weakref

from tensorflow.python.distribute import cross_device_ops, distribute_utils
from tensorflow.python.distribute import values as value_lib
from tensorflow.python.eager import context, def_function

_installed = False
# CollectiveAllReduce -> {(reduce_op, options' fields): tf.function}
_functions = weakref.WeakKeyDictionary()


def install(following):
    """Wrap ``CollectiveAllReduce._all_reduce_per_replica_values`` once per process;
    ``following()`` says whether the calling thread runs a merge of a followed run."""
    global _installed
    if _installed:
        return
    _installed = True
    cls = cross_device_ops.CollectiveAllReduce
    original = cls._all_reduce_per_replica_values

    @functools.wraps(original)
    def _all_reduce_per_replica_values(self, reduce_op, per_replica_values, options):
        if not context.executing_eagerly() or not following():
            return original(self, reduce_op, per_replica_values, options)
        n = len(self._devices)
        values_by_device = [[pr.values[i] for pr in per_replica_values] for i in range(n)]
        outputs_by_device = _function(self, reduce_op, options)(values_by_device)
        return [distribute_utils.regroup(values, wrap_class=value_lib.Mirrored)
                for values in zip(*outputs_by_device)]

    cls._all_reduce_per_replica_values = _all_reduce_per_replica_values


def _function(collective, reduce_op, options):
    """The ``tf.function`` of ``collective``'s graph branch for ``reduce_op`` and
    ``options`` (traced once per structure of its arguments, as any ``tf.function``)."""
    key = (reduce_op, tuple(sorted(vars(options).items())) if options is not None else None)
    table = _functions.setdefault(collective, {})
    fn = table.get(key)
    if fn is None:
        ref = weakref.ref(collective)

        def reduce_by_device(values_by_device):
            self = ref()
            with self._lock:  # TF's graph branch, one value at a time, as eagerly
                return [[self._all_reduce(reduce_op, [value], i, options)[0]
                         for value in values] for i, values in enumerate(values_by_device)]

        fn = table[key] = def_function.function(reduce_by_device, autograph=False)
    return fn
