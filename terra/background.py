"""The generated graph's instantiation, off the training loop's thread.

TF instantiates a function at its first call (Grappler, placement, partitioning, kernels):
50-200 ms for the small corpus programs, 1.7 s for a MobileNetV3, up to 20 of their
co-executed iterations. Done by the first co-executed iteration, the loop waits for all of it.
Done here, the loop runs an eager iteration meanwhile (eager's speed, nothing to undo).
Instantiation is C++ and releases the GIL, so it overlaps with the loop's Python.

**When co-execution starts.** Not when TF happens to finish: that moves with the machine's
load, and so would the iterations co-executed, and with them every decision the ledger takes
from them. The graph co-executes from a fixed iteration: the one after the iteration that
begins right after generation, which runs eagerly while TF instantiates. There the loop waits
for TF if it is not done (``GraphLifecycle.instantiated``; past ``config.timeout``, Terra
gives up and runs eagerly, saying so in ``explain()``). Why not run more eager iterations
beside the instantiation, as many as the graph's size predicts it takes (counted, so as
deterministic)? On 2 cores the two slow each other (an eager DCGAN step beside it took up to
twice its time), and the run is slower: from the graph's generation to step 30 of the start-up
benchmark, DCGAN took 2.2 s with one eager iteration beside the instantiation and the wait,
against 2.9 s with three (what its size predicted), loss_branch 0.57 against 0.64 s (three),
counter_branch 1.06 against 1.38 s (seven; medians of 4 alternating runs on a loaded
machine). An iteration run eagerly once the graph is ready costs what co-executing it would
have saved; the wait costs at most the rest of the instantiation, which then has the cores.

Generation itself (emitting the graph's ops, Python) stays in the loop's thread: in another
one it takes turns with the loop's Python for the GIL, and each eager op that releases the
GIL for its kernel then waits up to a switch interval to get it back. Measured on the corpus
(2 cores), that made generation 3-4x longer and the eager iterations beside it slower.

Instantiation is triggered by a call whose cancellation manager is already cancelled: TF
instantiates the function for the call, then returns "cancelled before it was started"
without running an op, so no variable or queue is touched.
"""

import threading
import time

from tensorflow.python.eager import cancellation, context, execute
from tensorflow.python.framework import errors


def instantiate(graph):
    """Have TF instantiate ``graph``'s function (and its snapshot function) without running
    any of its ops."""
    cm = cancellation.CancellationManager()
    cm.start_cancel()
    try:
        execute.execute_with_cancellation(graph.fn_name, 0, graph.captures, graph.call_attrs,
                                          context.context(), cm)
    except errors.CancelledError:
        pass
    if graph.snapshot_fn is not None:
        graph.snapshot_fn()  # reads only: its result is dropped


class Instantiation:
    """:func:`instantiate` of ``graph`` in its own thread; ``seconds``: the time it took."""

    def __init__(self, graph, iteration: int):
        self.graph = graph
        self.iteration = iteration  # the loop's iteration when it started
        self.seconds = None
        self._error = None
        self._done = threading.Event()
        threading.Thread(target=self._run, name="terra-instantiate", daemon=True).start()

    def _run(self):
        t0 = time.perf_counter()
        try:
            instantiate(self.graph)
        except Exception as err:  # noqa: BLE001 - handed to the loop's thread
            self._error = err
        self.seconds = time.perf_counter() - t0
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def result(self):
        """The graph, or what instantiating it raised."""
        if self._error is not None:
            raise self._error
        return self.graph
