"""Input Feeding / Output Fetching channels: one unbounded TF FIFO queue per point.

Unbounded because a bounded queue deadlocks when the graph produces a value Python never
reads (docs/architecture.md §3.6). Every queue gets its own ``shared_name``: eagerly created
queues with equal attributes otherwise share one resource (the kernel is cached and creates
its queue once), and two fetch points of the same shape would swap values.

Terra's own queue ops go straight to ``quick_execute`` / ``execute_with_cancellation`` so
the interception doors never see them.
"""

import itertools
import threading

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context, execute
from tensorflow.python.eager import executor as executor_lib
from tensorflow.python.ops import gen_data_flow_ops

_ids = itertools.count()
_feeder = executor_lib.new_executor(enable_async=True)


class Channel:
    """One FIFO queue carrying a single tensor per iteration in which its point runs."""

    __slots__ = ("handle", "dtype", "shape", "lock", "taken", "_attrs")

    def __init__(self, dtype: int, shape):
        self.dtype, self.shape = dtype, shape
        exact = shape is not None and None not in shape
        self.handle = gen_data_flow_ops.fifo_queue_v2(
            component_types=[dtype], shapes=[list(shape)] if exact else [], capacity=-1,
            shared_name=f"terra_channel_{next(_ids)}")
        self.lock = threading.Lock()
        self.taken = 0  # values dequeued so far (fetch channels)
        self._attrs = ("component_types", [dtype], "timeout_ms", -1)

    def put(self, t):
        """Enqueue without waiting: on TF's async executor of the feeding thread (FIFO, one
        C++ thread, no GIL). Run synchronously, the enqueue would hand the value to the
        graph's waiting dequeue and go on to execute the graph ops that became ready, inline
        in the caller: the PythonRunner would compute part of the graph itself."""
        ctx = context.context()
        handle = ctx._context_handle
        own = pywrap_tfe.TFE_ContextGetExecutorForThread(handle)
        pywrap_tfe.TFE_ContextSetExecutorForThread(handle, _feeder.handle())
        try:
            execute.quick_execute("QueueEnqueueV2", 0, [self.handle, t],
                                  ("Tcomponents", [self.dtype], "timeout_ms", -1), ctx)
        finally:
            pywrap_tfe.TFE_ContextSetExecutorForThread(handle, own)

    def get(self, cancellation_manager):
        """Blocking dequeue; raises ``CancelledError`` when the manager is cancelled."""
        out = execute.execute_with_cancellation(
            "QueueDequeueV2", 1, [self.handle], self._attrs, context.context(),
            cancellation_manager)
        self.taken += 1
        return out[0]

    def drain(self):
        """Empty the queue and count from zero again: a cancelled iteration may have left
        values in it that no later iteration must read (feeds the graph never took, fetches
        Python never asked for). Call only while no job runs and after :func:`settle`."""
        ctx = context.context()
        left = execute.quick_execute("QueueSizeV2", 1, [self.handle], (), ctx)[0].numpy()
        for _ in range(int(left)):
            execute.quick_execute("QueueDequeueV2", 1, [self.handle], self._attrs, ctx)
        self.taken = 0

    def get_nth(self, n, cancellation_manager):
        """The value with index ``n`` (0-based, in enqueue order), skipping older ones."""
        with self.lock:
            if n < self.taken:
                raise IndexError(f"value {n} of this channel was already consumed")
            value = None
            while self.taken <= n:
                value = self.get(cancellation_manager)
            return value


def settle():
    """Wait until every value put so far is in its queue (puts run on an async executor)."""
    _feeder.wait()
