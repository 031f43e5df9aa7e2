"""Where the two runners' time goes on few cores (``terra.stats()``: ``coexec_wall``,
``python_cpu``, ``graph_cpu``).

On a machine with as many cores as the graph's thread pools have threads, the loop's thread
and the graph's kernels may take turns for the cores instead of overlapping: Python's
skeleton then gets slower while the graph runs. Wall time against the CPU time of each side
tells: Python's CPU near the wall time with the graph's kernels using the other cores is
overlap; the sum of both far above the cores available is contention.
"""

import time


class Clocks:
    """Wall and CPU time of one iteration begun in co-execution: the loop's thread by
    ``thread_time`` (it is the thread that calls :meth:`start` and :meth:`stop`), every
    other thread by the process's CPU time minus that."""

    __slots__ = ("_t0",)

    def __init__(self):
        self._t0 = None

    def start(self):
        self._t0 = (time.perf_counter(), time.thread_time(), time.process_time())

    def add(self, stats):
        """Add the times since :meth:`start` to ``stats`` (if started)."""
        if self._t0 is not None:
            wall, mine, everyone = self._t0
            python = time.thread_time() - mine
            stats.coexec_wall += time.perf_counter() - wall
            stats.python_cpu += python
            stats.graph_cpu += max(0.0, time.process_time() - everyone - python)

    def stop(self, stats):
        self.add(stats)
        self._t0 = None
