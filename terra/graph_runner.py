"""GraphRunner: executes the symbolic graph, one call per iteration, in its own thread.

Each iteration is a :class:`Job`. A job is stopped by closing the channels its graph reads
(``SymbolicGraph.close_inputs``): the graph runs only Terra's channels' dequeues and ops that
do not block (a stateful op runs in Python, ``opdefs.OpInfo.in_graph``), so it then ends at
the first value Python has not fed, without TF logging it (``terra.queues``). For a graph
without a commit gate (``terra.commit``) the runner snapshots the variables the graph writes
before the call (reads alias the buffers; TF copies on write), which is what a fallback
restores; a gated graph writes nothing until Python's token, which decides whether Python
snapshots. Jobs run strictly in order, so the snapshot of job *i* is the state at the start
of iteration *i*. While a profiler records, each call is a ``terra_graph_step`` span with
the iteration's number as ``step_num`` (``terra.profiling``).
"""

import queue
import threading
import time

from tensorflow.python.eager import context, execute

from terra import profiling


class Job:
    __slots__ = ("graph", "step", "done", "entered", "error", "snapshot", "cancelled",
                 "submitted", "started", "exec_time", "committed", "ready", "early")

    def __init__(self, graph, step=0):
        self.graph = graph
        self.step = step  # the iteration's number, for the profiler's step view
        self.done = threading.Event()
        self.entered = threading.Event()  # the runner's thread is in TF's call, or done
        self.error = self.snapshot = None
        self.early = None  # the snapshot of the variables a gated graph writes before its gate
        self.cancelled = self.submitted = self.started = False
        self.committed = False  # the commit token was sent (terra.commit)
        self.ready = False  # Python saw every op before the commit gate run
        self.exec_time = 0.0


class GraphRunner:
    def __init__(self, on_error):
        self._jobs = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._on_error = on_error  # called from this thread when a job fails on its own
        self.busy_time = 0.0
        self.idle_time = 0.0
        self.snapshots = 0  # jobs snapshotted before their call (graphs without a gate)
        self._thread = threading.Thread(target=self._loop, name="terra-graph-runner",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: Job):
        """Queue ``job`` (once); jobs run in submission order."""
        with self._lock:
            if job.submitted or job.cancelled:
                return
            job.submitted = True
        self._jobs.put(job)

    def start(self, job: Job, timeout: float):
        """Submit ``job`` and hand this runner's thread the interpreter until it is inside
        the graph's call (at most ``timeout`` seconds). Without the handover the submitting
        thread keeps the GIL while it runs Python, and the graph would start only when that
        thread next releases it: at its first eager op (a feed's enqueue, which then waits
        for this thread's Python), its first wait, or the interpreter's switch interval.
        Only for a graph called without a snapshot first: the wait would hold the snapshot's
        time too, which the submitting thread can spend running Python."""
        self.submit(job)
        g = job.graph
        if (g.snapshot_fn is None or g.commit is not None) and g.early_fn is None:
            job.entered.wait(timeout)

    def cancel(self, job: Job):
        """Stop ``job`` (``fallback.restore`` waits for it). Of a job that started, the
        channels its graph reads are closed: the call ends at the first value Python has
        not fed, or at its end if every value was fed (cancelling its call would not stop a
        running kernel either)."""
        with self._lock:
            job.cancelled = True
            if not job.submitted:  # lazy mode: never started, nothing to undo
                job.done.set()
            running = job.started
        if running:  # else the loop skips it
            job.graph.close_inputs()

    def stop(self):
        self._jobs.put(None)

    def _loop(self):
        ctx = context.context()
        while True:
            t0 = time.perf_counter()
            job = self._jobs.get()
            self.idle_time += time.perf_counter() - t0
            if job is None:
                return
            with self._lock:
                job.started = not job.cancelled
            if job.started:
                with profiling.trace("terra_graph_step", step_num=job.step, _r=1):
                    self._run(job, ctx)
            job.entered.set()
            job.done.set()

    def _run(self, job, ctx):
        g = job.graph
        t0 = time.perf_counter()
        try:
            if g.snapshot_fn is not None and g.commit is None:
                job.snapshot = g.snapshot_fn()
                self.snapshots += 1
            elif g.early_fn is not None:
                job.early = g.early_fn()
            job.entered.set()
            execute.quick_execute(g.fn_name, 0, g.captures, g.call_attrs, ctx)
        except Exception as e:  # noqa: BLE001 - every failure is handed to the PythonRunner
            job.error = e
            if not job.cancelled:
                self._on_error(job)
        job.exec_time = time.perf_counter() - t0
        self.busy_time += job.exec_time


class Watchdog:
    """One thread that ends a blocking wait when it exceeds its deadline, by closing the
    channel it waits on (``Channel.close``: the dequeue raises ``OutOfRangeError``).

    Arming does not wake the thread: it looks at the deadline every ``period`` (a quarter of
    the shortest timeout armed, at most a second), so a wait is ended at most that much
    after its deadline. Waking it at every wait, as a condition's ``notify`` does, cost a
    switch of threads per wait: YOLOv3's 67 waits a step took ~1 ms a step more."""

    def __init__(self):
        # arming and disarming take the condition's lock itself (in C: a condition's own
        # ``with`` is a Python frame more, at every wait, out of the caches after one)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._deadline = None
        self._channel = None
        self._stopped = False
        self._period = 1.0
        self.fired = False
        threading.Thread(target=self._loop, name="terra-watchdog", daemon=True).start()

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def arm(self, channel, timeout):
        """Close ``channel`` if the wait on it is not disarmed within ``timeout`` seconds."""
        with self._lock:
            self._channel, self._deadline, self.fired = channel, time.monotonic() + timeout, False
            if timeout < 4 * self._period:  # the thread would look too late: sooner
                self._period = max(timeout / 4, 1e-3)
                self._cond.notify()

    def disarm(self):
        with self._lock:
            self._deadline = None

    def _loop(self):
        with self._cond:
            while not self._stopped:
                if self._deadline is None or time.monotonic() < self._deadline:
                    self._cond.wait(self._period)
                    continue
                self.fired = True
                self._deadline = None
                self._channel.close()
