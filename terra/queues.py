"""Input Feeding / Output Fetching channels: one unbounded TF FIFO queue per point.

Unbounded because a bounded queue deadlocks when the graph produces a value Python never
reads (docs/architecture.md §3.6). Every queue gets its own ``shared_name``: eagerly created
queues with equal attributes otherwise share one resource (the kernel is cached and creates
its queue once), and two fetch points of the same shape would swap values.

Terra's own queue ops go straight to ``quick_execute`` so the interception doors never see
them.

A wait that must end early is ended by closing its queue, never by cancelling the dequeue: a
dequeue of a closed, empty queue fails with ``OutOfRange``, which TF reports to the caller
only, while a cancelled one makes TF log warnings on stderr ("Skipping cancelled dequeue
attempt with queue not closed" from the queue, and "Local rendezvous is aborting with
status: CANCELLED" from an aborted function; an ``OUT_OF_RANGE`` abort is a normal end to
it). A closed queue stays closed: :meth:`Channel.reopen` puts a new one in its place, under
its name, which the handle the graph captured names.
TF still cancels, itself, the other dequeues of a function one of whose dequeues ended so;
:func:`close_all` keeps what it logs then off stderr.
"""

import contextlib
import itertools
import os
import re
import tempfile
import threading

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context, execute
from tensorflow.python.eager import executor as executor_lib

_ids = itertools.count()
_feeder = executor_lib.new_executor(enable_async=True)
_closing = threading.Lock()  # a channel is closed once, whichever thread gets there first


class Channel:
    """One FIFO queue carrying a single tensor per iteration in which its point runs."""

    __slots__ = ("handle", "dtype", "shape", "lock", "taken", "closed", "_attrs", "_queue")

    def __init__(self, dtype: int, shape):
        self.dtype, self.shape = dtype, shape
        exact = shape is not None and None not in shape
        # what creates its queue, by name: again, in place of a closed one (``reopen``)
        self._queue = ("component_types", [dtype], "shapes", [list(shape)] if exact else [],
                       "capacity", -1, "container", "", "shared_name",
                       f"terra_channel_{next(_ids)}")
        self.handle = self._create()
        self.lock = threading.Lock()
        self.taken = 0  # values dequeued so far (fetch channels)
        self.closed = False
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

    def get(self):
        """Blocking dequeue; raises ``OutOfRangeError`` once the channel is closed and empty."""
        out = execute.quick_execute("QueueDequeueV2", 1, [self.handle], self._attrs,
                                    context.context())
        self.taken += 1
        return out[0]

    def close(self):
        """End the waits on this channel: a dequeue waiting for it, or coming after the
        values already in it, raises ``OutOfRangeError``; an enqueue fails. From any thread;
        closing a closed channel does nothing."""
        with _closing:
            if self.closed:
                return
            self.closed = True
            execute.quick_execute("QueueCloseV2", 0, [self.handle],
                                  ("cancel_pending_enqueues", False), context.context())

    def reopen(self):
        """A new, empty queue in place of a closed one, once no op uses it. The closed queue
        is deleted from its resource manager and the op that created it runs again: TF's
        kernel for it is cached and keeps only a weak reference to its queue, so it creates
        one under the same name, and every handle of the channel (the one the graph
        captured) names the new queue; no queue is left behind."""
        execute.quick_execute("DestroyResourceOp", 0, [self.handle],
                              ("ignore_lookup_error", True), context.context())
        self._create()
        self.closed = False
        self.taken = 0

    def _create(self):
        """Run the op creating this channel's unbounded queue; its handle."""
        return execute.quick_execute("FIFOQueueV2", 1, [], self._queue, context.context())[0]

    def drain(self):
        """Empty the queue and count from zero again: a cancelled iteration may have left
        values in it that no later iteration must read (feeds the graph never took, fetches
        Python never asked for). Call only while no job runs and after :func:`settle`."""
        ctx = context.context()
        left = execute.quick_execute("QueueSizeV2", 1, [self.handle], (), ctx)[0].numpy()
        for _ in range(int(left)):
            execute.quick_execute("QueueDequeueV2", 1, [self.handle], self._attrs, ctx)
        self.taken = 0

    def get_nth(self, n):
        """The value with index ``n`` (0-based, in enqueue order), skipping older ones."""
        with self.lock:
            if n < self.taken:
                raise IndexError(f"value {n} of this channel was already consumed")
            value = None
            while self.taken <= n:
                value = self.get()
            return value


# the line TF logs for each of an aborted function's dequeues it cancels on an open channel
_CANCELLED_BY_TF = re.compile(
    rb"^[^\n]*\] terra_channel_\d+: Skipping cancelled dequeue attempt with queue not closed\n",
    re.MULTILINE)


def close_all(channels):
    """Close ``channels``, the inputs of a graph whose job is to stop
    (``SymbolicGraph.close_inputs``).

    Closing the first of them a dequeue of the graph waits on ends that dequeue, and the
    function aborts; TF then cancels its other waiting dequeues at once, in this thread, and
    logs a warning for each whose channel is not closed yet ("terra_channel_7: Skipping
    cancelled dequeue attempt with queue not closed"). No order of closing avoids it when
    the graph waits on two channels or more (the inputs of an iteration's first ops, say),
    so those lines, which name Terra's channels, are kept off stderr while they are closed
    (:func:`_stderr_without`)."""
    with _stderr_without(_CANCELLED_BY_TF):
        for channel in channels:
            channel.close()


@contextlib.contextmanager
def _stderr_without(unwanted):
    """File descriptor 2 goes to a spool for the ``with`` body; then what was written to it
    (by TF, or by another thread meanwhile), less the lines ``unwanted`` matches, goes to
    stderr, in order. Without a stderr or a temporary directory the body runs as it is."""
    try:
        spool = tempfile.TemporaryFile()
    except OSError:
        spool = None
    try:
        stderr = os.dup(2) if spool is not None else None
    except OSError:
        stderr = None
    if stderr is None:
        try:
            yield
        finally:
            if spool is not None:
                spool.close()
        return
    with spool:
        os.dup2(spool.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(stderr, 2)
            os.close(stderr)
            spool.seek(0)
            kept = unwanted.sub(b"", spool.read())
            while kept:
                kept = kept[os.write(2, kept):]


def settle():
    """Wait until every value put so far is in its queue (puts run on an async executor)."""
    _feeder.wait()
