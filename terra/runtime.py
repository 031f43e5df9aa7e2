"""The runtime: iterations, phases, and the hand-offs between the stages.

An iteration starts when an outermost Terra tape is entered and ends when the next one is.
Phases: ``warmup`` (eager, untraced: Keras creates optimizer slots in the first step),
``tracing`` (eager + Recorder until a trace adds nothing to the TraceGraph), ``instantiating``
(one iteration eager while TF instantiates the new graph in the background; the next waits
for TF if need be and co-executes, ``terra.background``),
``coexecution`` (PythonRunner + GraphRunner), ``waiting`` (eager until the cost budget affords
building the graph again) and ``eager`` when the TraceGraph cannot be co-executed
(``explain()`` says why). A fallback returns from co-execution to tracing mid-iteration,
or, where building the graph again would not pay, to ``detour``: the rest of that iteration
runs eagerly and untraced, and the next one co-executes with the graph kept.

The :class:`Runtime` owns the phase and changes it; its collaborators each own one concern
and act on what it hands them: the doors (``terra.doors``) and the tape marks
(``terra.marks``) route ops and tape calls by phase, the graph lifecycle
(``terra.lifecycle``) turns traces into graphs and decides when building one pays, and the
event log (``terra.events``) keeps what happened for ``explain()`` (``terra.report``).
Leaving co-execution (``Runtime.handle``, ``Runtime.leave``) is the runtime's own, since it
changes the phase, the recorder and the runners together; it is written apart, in
``terra.exits``. While a profiler records, each phase of an
iteration is a span on the loop's thread, begun and ended here (``terra.profiling``).
"""

import dataclasses
import gc
import threading
import time

from tensorflow.python.eager import context
from tensorflow.python.framework import errors

from terra import (
    events,
    function_regions,
    hooks,
    interception,
    layer_regions,
    library_regions,
    profiling,
    replicas,
    syncs,
    verify,
)
from terra.clocks import Clocks
from terra.config import config
from terra.divergence import (
    Divergence,
    GraphFailed,
)
from terra.doors import CoexecDoor, TracingDoor
from terra.exits import Exits
from terra.graph_runner import GraphRunner, Job, Watchdog
from terra.lifecycle import GiveUp, GraphLifecycle, Pause
from terra.location import Sites
from terra.marks import TapeMarks
from terra.python_runner import Iteration, PythonRunner
from terra.trace import Recorder

# how long an iteration's start waits for the GraphRunner's thread to take its job (past
# that, the graph starts at Python's next release of the interpreter, as it would without)
_HANDOVER = 0.05


@dataclasses.dataclass
class Stats:
    """Counters of the current runtime (``terra.stats()``)."""

    iterations: int = 0
    traces: int = 0
    fallbacks: int = 0
    graph_generations: int = 0
    coexecuted: int = 0
    phase: str = "warmup"
    python_stall: float = 0.0  # seconds the PythonRunner waited for the graph
    graph_exec: float = 0.0  # seconds the GraphRunner spent in graph calls
    graph_idle: float = 0.0  # seconds the GraphRunner waited for the next iteration
    skipped_calls: int = 0  # library calls (optimizer updates) the skeleton skipped
    skipped_layer_calls: int = 0  # Keras layer calls the skeleton skipped (layer_regions)
    skipped_function_calls: int = 0  # TF function calls it skipped (function_regions)
    verified: int = 0  # iterations verify mode ran again eagerly and compared (terra.verify)
    verify_differences: int = 0  # values and variables they found differing from eager's
    verify_time: float = 0.0  # seconds verify mode took (not booked to Terra's ledger)
    plain_tapes: int = 0  # tape enters that acted as plain GradientTapes (explain() says why)
    snapshots: int = 0  # co-executed iterations whose written variables were read first
    # the iterations begun in co-execution: seconds of wall time, the CPU time of the loop's
    # thread, and of every other thread (the graph's kernels run in TF's thread pools, not in
    # the GraphRunner's thread), to see whether the two runners contend for the cores
    coexec_wall: float = 0.0
    python_cpu: float = 0.0
    graph_cpu: float = 0.0


class Runtime(Exits):
    """The coordinator of one run: the phase, the iteration under way, the current graph and
    its runners, and which door the interception layer calls. What the graph is built from,
    and whether building it pays, is its :class:`GraphLifecycle`'s."""

    def __init__(self):
        self.stats = Stats()
        self.sites = Sites()
        self.open_tapes = []
        self.entry = None  # where the user's code entered this iteration (location.entry_point)
        self.recorder = None
        self.runner = None
        self.graph = None
        self.unsupported = None
        self.events = events.EventLog()  # fallbacks and other notes for explain()
        self.fallbacks_in_a_row = 0  # since the last co-executed iteration
        self.lifecycle = GraphLifecycle(self.stats, self.events.note)
        self._began = None  # (phase, start time, site it fell back at or False): this iteration
        self._cpu_began = None  # the process's CPU time when it began
        self._clocks = Clocks()  # the co-executed iteration's wall and CPU times
        self.span = profiling.Phase()  # the profiler's span of the phase under way
        self.syncs = syncs.SyncLog()  # where Python waited for the graph (explain())
        self.ctx = context.context()
        # the training loop's thread, and the thread whose ops and tapes Terra serves now:
        # the loop's, or one of the replica threads of a MirroredStrategy.run it called,
        # which take turns with it (``terra.replicas``); optimizer regions are recorded and
        # skipped only on the loop's thread outside such a run (an update spans a replica's
        # merge_call, and the turns of others)
        self.loop_thread = replicas.loop_thread_of_current()
        self.owner = threading.get_ident()
        self.update_owner = None if replicas.in_run() else self.owner
        # layer and function regions, which lie within one replica's turn: also in a run's
        # threads, until one spanned a turn (a layer that synchronizes the replicas)
        self.layer_owner = self.owner
        self.layers_in_runs = True
        self.run = None  # the strategy.run (its Coordinator) this iteration's tapes are in
        self._graph_runner = None
        self._watchdog = None
        self.tracing_door = TracingDoor(self)
        self.coexec_door = CoexecDoor(self)
        self.marks = TapeMarks(self)
        self.regions = library_regions.LibraryRegions(self.events.note)
        self.layers = layer_regions.LayerRegions(self.events.note)
        self._offs = 0  # regions turned off when the last trace finished
        self.verifier = verify.Verifier(self.stats)
        library_regions.install()
        layer_regions.install()
        function_regions.install()
        hooks.install()
        interception.install()
        interception.set_handler(self.tracing_door)

    @property
    def phase(self):
        return self.stats.phase

    @phase.setter
    def phase(self, value):
        self.stats.phase = value

    @property
    def graph_runner(self):
        if self._graph_runner is None:
            self._graph_runner = GraphRunner(self._graph_error)
            self._watchdog = Watchdog()
        return self._graph_runner

    # -- iterations -----------------------------------------------------------------------
    def next_iteration(self):
        """The outermost tape is entered: the iteration before ends (and is booked), the next
        one begins in the phase that follows."""
        interception.converted.clear()
        self._end_iteration()
        self._clocks.stop(self.stats)
        self.span.end()
        self._book()
        self._begin_iteration()
        if self.phase == "coexecution":
            self._clocks.start()

    def _book(self):
        """Enter the iteration that just ended in the cost ledger; stop if Terra is not
        earning back what it costs (``terra.budget``)."""
        try:
            self.lifecycle.book(self._began, judge=self.phase in ("tracing", "coexecution"),
                                cpu_began=self._cpu_began)
        except Pause as why:
            self._pause(str(why))
        except GiveUp as why:
            self._give_up(str(why))
        self._began = None

    def _begin_iteration(self):
        self.lifecycle.begin_iteration()
        self.sites.begin_iteration()
        s = self.stats
        s.iterations += 1
        if self.phase == "warmup" and s.iterations > config.warmup or \
                self.phase == "waiting" and self.lifecycle.may_build():
            self.phase = "tracing"
        if self.phase == "instantiating":  # (waits for TF at the iteration set for it)
            try:
                graph = self.lifecycle.instantiated()
            except GiveUp as why:
                self._give_up(str(why))
                graph = None
            if graph is not None:
                self._install(graph)
        began, self._cpu_began = time.perf_counter(), time.process_time()
        if self.phase == "tracing":
            self._start_recording()
        elif self.phase == "coexecution":
            # the previous iteration's job is done: the runner waits for it at its path's end
            job = Job(self.graph, s.iterations)
            it = Iteration(job)
            self.span.begin("terra_coexecute", step_num=s.iterations)
            if not config.lazy:  # lazy: the PythonRunner submits when it first waits
                self.graph_runner.start(job, _HANDOVER)
            self.runner.begin(it)
            interception.set_handler(self.coexec_door)
        elif self.phase in ("warmup", "eager", "waiting", "instantiating"):
            # plain eager speed: the door only swaps stand-ins for values, and none is alive
            interception.set_handler(self.tracing_door if hooks.tensors else None)
        self._began = (self.phase, began, False)

    def _end_iteration(self):
        try:
            if self.coexecuting():
                if not self.runner.at_end():
                    self.leave(Divergence("the iteration ended before the recorded one did",
                                        "early end"))
                else:
                    self._close_iteration()
        except (GraphFailed, errors.OpError, verify.DivergenceError):  # the user's error,
            raise  # reproduced eagerly, or the difference verify mode was asked to raise
        except Exception as err:  # noqa: BLE001 - Terra's own failure
            self.fail_safe(err)
        if self.phase == "tracing" and self.recorder is not None:
            self._finish_trace()
        elif self.phase == "detour":  # the graph was kept: the next iteration co-executes
            self.phase = "coexecution"

    def _close_iteration(self):
        """The whole path was matched: sweep the iteration's stand-ins (falling back if one
        that Python still holds has no value the graph returns) and count it."""
        self.sites.release()  # the frames of the last stack walked hold stand-ins
        try:
            self.runner.end_path()
        except GraphFailed as why:  # the replay raises the error at the user's line
            self.leave(why)
            return
        kept = self.verifier.keep(self.runner.it)  # verify mode: the k-th iteration's results
        uncovered = self.runner.finish()
        if uncovered:  # the replay gives every one of them its value
            self.leave(Divergence("a tensor outlived its iteration but the graph does not "
                                "return it", "new fetch point"))
        else:
            self.stats.coexecuted += 1
            self.fallbacks_in_a_row = 0
            self.runner.it = None
            if kept is not None:
                self._verify(kept)

    def _verify(self, kept):
        """Verify mode: run the iteration just closed again eagerly and compare
        (``terra.verify``); the ledger does not book that time, which the user chose. A
        difference ends co-execution for the run (the variables are eager's), then raises
        or warns; Terra's own failure (``fail_safe``) leaves the graph's results standing."""
        spent, cpu = self.stats.verify_time, time.process_time()
        try:
            difference = self.verifier.check(kept, self)
        except Exception as err:  # noqa: BLE001 - Terra's own failure
            self.fail_safe(err)
            difference = None
        if self._began is not None:
            phase, start, fell = self._began
            self._began = (phase, start + self.stats.verify_time - spent, fell)
            self._cpu_began += time.process_time() - cpu
        if difference is not None:
            self._give_up(f"verify mode: {difference}")
            verify.report(difference)

    def path_ended(self, why):
        """An op after the end of the matched path, or off a path whose rest has no effects
        (``PythonRunner.rest_without_effects``), with no tape open: the iteration's graph work
        is done (typically the loop is over and Python reads results, or Keras ends an epoch
        where the traces drew the next batch). Close it and run the op eagerly, untraced,
        like any op between iterations: no replay, no new trace. With a tape open the op may
        need recording: fall back."""
        if not self.end_here():
            self.leave(why)

    def end_here(self) -> bool:
        """Close the iteration here (the rest of its path, if any, has no effects) and go on
        eagerly as between iterations, if no tape is open (an op in it may still need
        recording); whether it was closed. An op after the path's end comes here
        (:meth:`path_ended`), and so does a read, once the whole path is matched, of a value
        the graph computes after its commit gate (``terra.commit``): closing the iteration
        lets the graph write without a snapshot of every written variable first (YOLOv3's
        Adam: ~4 ms a step)."""
        if self.open_tapes:
            return False
        self._close_iteration()
        self.span.end()
        if self.phase == "coexecution":
            interception.set_handler(self.tracing_door)
        return True

    def _start_recording(self):
        if config.freeze_gc:  # a trace allocates enough to set off a full collection
            gc.freeze()
        self.span.begin("terra_trace", step_num=self.stats.iterations)
        self.recorder = Recorder(hooks.tensors, hooks.original_numpy, self.sites)
        self.recorder.aborted = False
        self.ctx.add_op_callback(self.recorder.callback)
        interception.set_handler(self.tracing_door)

    def _finish_trace(self):
        """Hand the finished trace to the lifecycle, and move to the phase it leads to."""
        self.span.end()
        rec, self.recorder = self.recorder, None
        self.ctx.remove_op_callback(rec.callback)
        rec.finish()
        offs, self._offs = self._offs, self.layers.offs + self.regions.offs
        try:
            covered = self.lifecycle.merge(rec, recorded_otherwise=offs != self._offs)
            if covered is not None:
                self.stats.traces += 1
            if covered is False and not self.lifecycle.merged:
                self.phase = "waiting"  # the first trace predicts the graph would wait
                return
            if not covered or self.layers.branched(self.lifecycle.tracegraph):
                return  # (a user's layer region turned off: trace on, its layers regions)
            if not self.lifecycle.should_generate(self.fallbacks_in_a_row):
                self.phase = "waiting"  # eager until the budget affords building it again
                return
            graph = self.lifecycle.generate()
        except GiveUp as why:
            self._give_up(str(why))
            return
        if graph is None:  # eager iterations until TF has instantiated it
            self.phase = "instantiating"
        else:
            self._install(graph)

    def _install(self, graph):
        self.graph = graph
        self.stats.graph_generations += 1
        self.graph_runner  # noqa: B018 - starts the GraphRunner and watchdog threads
        if self.runner is not None:  # stall time and snapshots of earlier graphs
            self.stats.python_stall += self.runner.stall_time
            self.stats.snapshots += self.runner.snapshots
        self.runner = PythonRunner(self.graph, hooks.tensors, hooks.original_numpy, self._watchdog,
                                   config.timeout, self.handle, self.graph_runner.submit,
                                   self.sites)
        self.runner.waiting.syncs = self.syncs
        self.runner.verifying = self.verifier.will_keep  # its snapshot (terra.commit)
        self.runner.end_here = self.end_here
        self.phase = "coexecution"
        if config.freeze_gc:  # what tracing and generation left behind is not walked again
            gc.collect(1)
            gc.freeze()

    def _pause(self, reason):
        """Co-execution does not pay now: run eagerly, and trace again once the budget
        affords another graph (``Ledger.pause``)."""
        self.events.note("paused", reason + ": running eagerly, and trying again once the "
                         "run is long enough for the budget to afford another graph")
        self.graph = None
        self.phase = "waiting"
        interception.set_handler(self.tracing_door)

    def _give_up(self, reason):
        self.unsupported = reason
        self.events.note("eager", reason)
        self.phase = "eager"
        interception.set_handler(self.tracing_door)

    # -- stats / reset ------------------------------------------------------------------
    def snapshot_stats(self):
        s = dataclasses.replace(self.stats)
        if self.runner is not None:
            s.python_stall += self.runner.stall_time
            s.snapshots += self.runner.snapshots
        if self._graph_runner is not None:
            s.graph_exec = self._graph_runner.busy_time
            s.graph_idle = self._graph_runner.idle_time
            s.snapshots += self._graph_runner.snapshots
        s.skipped_calls = self.regions.skipped
        s.skipped_layer_calls = self.layers.skipped
        s.skipped_function_calls = self.layers.skipped_functions
        self._clocks.add(s)  # the iteration under way
        s.plain_tapes = events.plain_tape_count()
        return s

    def shutdown(self):
        """Finish pending graph work so variables hold their final values (and stop the
        runners even if verify mode raises for the last iteration)."""
        self.lifecycle.shutdown()
        try:
            if self.phase == "coexecution" and self.runner.it is not None:
                if not self.runner.at_end():
                    self.leave(Divergence("terra.reset() in the middle of an iteration",
                                          "early end"))
                else:
                    self.graph_runner.submit(self.runner.it.job)
                    self._close_iteration()
        finally:
            if self.recorder is not None:
                self.ctx.remove_op_callback(self.recorder.callback)
            if self._graph_runner is not None:
                self._graph_runner.stop()
                self._watchdog.stop()
            self.span.end()
            gc.unfreeze()
            interception.set_handler(self.tracing_door if hooks.tensors else None)


_runtime = None


def owner_thread():
    """The thread whose training loop Terra runs (the one that built the runtime), if any."""
    return _runtime.owner if _runtime is not None else None


def current():
    """The runtime if one was built since the last reset, else None (for reading: unlike
    :func:`get`, never builds one)."""
    return _runtime


def get() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime


def stats() -> Stats:
    """Counters: iterations, traces, fallbacks, graph_generations, coexecuted, phase, tapes
    that ran plain, and the time breakdown of the two runners (seconds)."""
    if _runtime is None:  # no tape has run under Terra: tapes may still have run plain
        return Stats(plain_tapes=events.plain_tape_count())
    return _runtime.snapshot_stats()


def reset():
    """Forget the TraceGraph, the graph and the counters; the next tape starts afresh."""
    global _runtime
    try:
        if _runtime is not None:
            _runtime.shutdown()
    finally:
        _runtime = None
        events.forget_plain_tapes()
