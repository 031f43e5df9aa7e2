"""The PythonRunner's waits for the graph: for a value of a fetch channel, and for an
iteration's graph work to finish (section 3.9).

The graph runs in the GraphRunner's thread; Python blocks only here. A wait submits the
iteration's job first (in lazy mode the graph runs only once Python needs it), is bounded by
the Watchdog's deadline, and is cancelled by the runtime when the graph fails (through
:attr:`Waiting.cm`), so a graph-side error or a hang is raised in Python instead of blocking
it. The time spent here is the runner's stall time, and each wait is booked to the user's line
that caused it (``terra.syncs``) for ``explain()``. While a profiler records, a wait is a
``terra_fetch_wait`` or ``terra_job_wait`` span (``terra.profiling``: checked per wait, since
this is the hot path, and nothing is built when no profiler runs).
"""

import time

from tensorflow.python.eager import cancellation

from terra import syncs
from terra.divergence import GraphFailed
from terra.location import user_location
from terra.plan import where
from terra.profiling import TraceMe, enabled


class Waiting:
    """One runner's waits: the cancellation manager they dequeue under, and the time they
    took."""

    def __init__(self, start, watchdog, timeout):
        self.start = start  # submits a job to the GraphRunner (a no-op once submitted)
        self.watchdog = watchdog
        self.timeout = timeout
        # what a fetch dequeues under: the Watchdog cancels it at the deadline, the runtime
        # when the graph fails; a cancelled one is replaced
        self.cm = cancellation.CancellationManager()
        self.stall_time = 0.0  # seconds Python waited for the graph
        self.syncs = syncs.SyncLog()  # the runtime gives its own, shared by its runners

    def renew(self):
        """A manager that was not cancelled, for the waits of a graph kept after an abandoned
        iteration."""
        self.cm = cancellation.CancellationManager()

    def value(self, channel, visit, job, step, kind=syncs.VALUE):
        """Value ``visit`` of ``channel`` (a fetch channel of ``step``), which ``job``
        computes; the wait is booked as ``kind`` at the user's line (None: not the user's)."""
        return self._wait(lambda: channel.get_nth(visit, self.cm), job, step, kind)

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

    def _wait(self, fetch, job, step, kind):
        """The blocking wait: ``fetch()`` under the deadline. A cancelled dequeue raises why:
        :class:`GraphFailed` if the graph failed, ``TimeoutError`` at the deadline."""
        self.start(job)  # lazy mode: the graph runs only once Python needs it
        span = TraceMe("terra_fetch_wait", op=step.op_type) if enabled() else None
        t0 = time.perf_counter()
        self.watchdog.arm(self.cm, self.timeout)
        try:
            return fetch()
        except Exception as err:  # noqa: BLE001 - cancelled dequeue: find out why
            self.watchdog.disarm()
            self.cm = cancellation.CancellationManager()
            if job is not None and job.error is not None:
                raise GraphFailed(job) from None
            if self.watchdog.fired:
                raise TimeoutError(
                    f"Terra: waited {self.timeout:.0f}s for the value of {step.op_type} "
                    f"({where(step)}); the graph did not produce it") from err
            raise
        finally:
            self.watchdog.disarm()
            if self.watchdog.fired:  # fired after the value came: the manager is spent
                self.cm = cancellation.CancellationManager()
            took = time.perf_counter() - t0
            self.stall_time += took
            if span is not None:
                span.Stop()
            if kind is not None:
                self.syncs.add(kind, took, user_location())

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
