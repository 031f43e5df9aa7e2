"""The PythonRunner's waits for the graph: for a value of a fetch channel, and for an
iteration's graph work to finish (section 3.9).

The graph runs in the GraphRunner's thread; Python blocks only here. A wait submits the
iteration's job first (in lazy mode the graph runs only once Python needs it), is bounded by
the Watchdog's deadline, and is ended by the runtime when the graph fails
(:meth:`Waiting.graph_failed`), so a graph-side error or a hang is raised in Python instead of
blocking it. Both end it by closing the channel it waits on (``terra.queues``: TF logs a
cancelled dequeue, not a closed queue). The time spent here is the runner's stall time, and
each wait is booked to the user's line that caused it (``terra.syncs``) for ``explain()``.
While a profiler records, a wait is a ``terra_fetch_wait`` or ``terra_job_wait`` span
(``terra.profiling``: checked per wait, since this is the hot path, and nothing is built when
no profiler runs).
"""

import time

from tensorflow.python.framework import errors

from terra import syncs
from terra.divergence import GraphFailed
from terra.location import user_location
from terra.plan import where
from terra.profiling import TraceMe, enabled


class Waiting:
    """One runner's waits: the channel waited on now, and the time they took."""

    def __init__(self, start, watchdog, timeout):
        self.start = start  # submits a job to the GraphRunner (a no-op once submitted)
        self.watchdog = watchdog
        self.timeout = timeout
        # the channel a wait is blocked on: what the runtime closes when the graph fails
        self.channel = None
        self.stall_time = 0.0  # seconds Python waited for the graph
        self.syncs = syncs.SyncLog()  # the runtime gives its own, shared by its runners

    def graph_failed(self):
        """The graph failed on its own (called from the GraphRunner's thread, after the
        job's error is set): end the wait in progress, if any; a later one raises at once.
        The channel closed is of a graph that no longer runs, and is opened again if the
        graph is kept (``SymbolicGraph.rewind``)."""
        channel = self.channel
        if channel is not None:
            channel.close()

    def value(self, channel, visit, job, step, kind=syncs.VALUE):
        """Value ``visit`` of ``channel`` (a fetch channel of ``step``), which ``job``
        computes; the wait is booked as ``kind`` at the user's line (None: not the user's)."""
        return self._wait(channel, visit, job, step, kind)

    def unread(self, it):
        """The values of the fetch channels the iteration ``it`` passed that Python did not
        read, by (step, visit, output): taken, so the unbounded channels do not grow."""
        got = {}
        for step, visit in it.fetch_visits:
            for k, channel in enumerate(step.fetch):
                if channel is not None and channel.taken <= visit:
                    # the job is done: Terra's own read, not a wait of the user's
                    got[(step, visit, k)] = self.value(channel, visit, it.job, step, None)
        return got

    def _wait(self, channel, visit, job, step, kind):
        """The blocking wait for value ``visit`` of ``channel``, under the deadline. A wait
        ended early raises why: :class:`GraphFailed` if the graph failed, ``TimeoutError``
        at the deadline (then even if the value came as the deadline passed: the channel is
        closed, the iteration cannot go on)."""
        self.start(job)  # lazy mode: the graph runs only once Python needs it
        span = TraceMe("terra_fetch_wait", op=step.op_type) if enabled() else None
        t0 = time.perf_counter()
        # set before the job's error is read: a graph failing after that read closes it
        self.channel = channel
        self.watchdog.arm(channel, self.timeout)
        try:
            value = None if _failed(job) else channel.get_nth(visit)
        except errors.OutOfRangeError:  # closed: by the watchdog, or as the graph failed
            value = None
        finally:
            self.watchdog.disarm()
            self.channel = None
            took = time.perf_counter() - t0
            self.stall_time += took
            if span is not None:
                span.Stop()
            if kind is not None:
                self.syncs.add(kind, took, user_location())
        if _failed(job):
            raise GraphFailed(job)
        if self.watchdog.fired:
            raise TimeoutError(
                f"Terra: waited {self.timeout:.0f}s for the value of {step.op_type} "
                f"({where(step)}); the graph did not produce it")
        if value is None:
            raise RuntimeError(f"Terra: the channel of {step.op_type} ({where(step)}) was "
                               "closed while its iteration ran")
        return value

    def job(self, job, step):
        """Wait for ``job`` to finish (the path's end at ``step``): raises
        :class:`GraphFailed` if the graph failed on its own, ``TimeoutError`` at the
        deadline."""
        self.start(job)
        if job.done.is_set():  # waited for already (the path's last op, then the tape enter)
            finished = True
        else:
            span = TraceMe("terra_job_wait", op=step.op_type) if enabled() else None
            t0 = time.perf_counter()
            finished = job.done.wait(self.timeout)
            took = time.perf_counter() - t0
            self.stall_time += took
            if span is not None:
                span.Stop()
            self.syncs.add(syncs.END, took, user_location())
        if not finished:
            raise TimeoutError(f"Terra: waited {self.timeout:.0f}s for the graph iteration "
                               f"that computes {step.op_type} ({where(step)})")
        if job.error is not None and not job.cancelled:
            raise GraphFailed(job)


def _failed(job):
    """Whether ``job`` (None: Terra's read after the job) failed on its own."""
    return job is not None and job.error is not None and not job.cancelled
