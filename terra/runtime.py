"""The runtime: iterations, phases, and the hand-offs between the stages.

An iteration starts when an outermost Terra tape is entered and ends when the next one is.
Phases: ``warmup`` (eager, untraced: Keras creates optimizer slots in the first step),
``tracing`` (eager + Recorder until a trace adds nothing to the TraceGraph), ``instantiating``
(eager while TF instantiates the new graph in the background, ``terra.background``),
``coexecution`` (PythonRunner + GraphRunner), ``waiting`` (eager until the cost budget affords
building the graph again) and ``eager`` when the TraceGraph cannot be co-executed
(``explain()`` says why). A fallback returns from co-execution to tracing mid-iteration,
or, where building the graph again would not pay, to ``detour``: the rest of that iteration
runs eagerly and untraced, and the next one co-executes with the graph kept.
"""

import dataclasses
import gc
import logging
import threading
import time
import traceback

from tensorflow.python.eager import context
from tensorflow.python.eager.core import _FallbackException
from tensorflow.python.framework import errors, ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.util import nest

from terra import background, budget, functions, interception, materialize, opdefs
from terra import fallback as fallback_lib
from terra.config import config
from terra.divergence import (
    Divergence,
    GraphFailed,
    IterationAborted,
    PathEnded,
    RegionMissed,
)
from terra.graph_builder import generate
from terra.graph_runner import GraphRunner, Job, Watchdog
from terra.location import Sites, user_location
from terra.nodes import NodeKind
from terra.python_runner import Iteration, PythonRunner
from terra.trace import Recorder
from terra.tracegraph import TraceGraph

log = logging.getLogger("terra")
_WARN = ("fallback", "eager", "Terra error", "graph error")  # events worth a warning

_EAGER_PHASES = ("warmup", "eager", "waiting")  # iterations that ran plainly: eager's time
_EagerTensor = ops.EagerTensor
_Variable = resource_variable_ops.BaseResourceVariable


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


# One hook table for the process: stand-ins handed out by any runtime must keep resolving.
_tensors: dict = {}
_original_numpy = None


def _resolve(t):
    return _tensors[t._id].numpy(t)


class TracingDoor:
    """Handler while ops run for real: makes variable reads explicit (the C fast path reads
    variable arguments without telling anyone) and swaps known stand-ins for their values."""

    def __init__(self, runtime):
        self.runtime = runtime

    def _arg(self, a):
        if type(a) is _EagerTensor:
            e = _tensors.get(a._id)
            return a if e is None or not hasattr(e, "runner") else self.runtime.value(e)
        if isinstance(a, _Variable):
            return a.value()
        if isinstance(a, (list, tuple)) and _tensors:
            items = [self._arg(x) for x in a]
            if all(x is y for x, y in zip(items, a)):
                return a
            return _rebuilt(a, items)
        return a

    def fast(self, ctx, op_type, name, args):
        recorder = self.runtime.recorder
        start = len(recorder.records) if recorder is not None else 0
        real = [self._arg(a) for a in args]
        try:
            return interception.ORIGINAL_FAST(ctx, op_type, name, *real)
        except _FallbackException:
            # the op wrapper takes its slow path, which reads the variables again: the reads
            # made here for the fast path were never seen by eager (C reads them unseen)
            if recorder is not None:
                recorder.forget(start)
            raise

    def custom_gradient(self, op_type, outputs, inputs, backward):
        """Count it for the trace; and if stand-ins are alive, record their values instead:
        a custom gradient that a fallback interrupted (``tf.custom_gradient`` took its
        arguments as stand-ins, then the iteration went on eagerly) would otherwise sit on
        the tape over tensors no recorded op produced, and the gradient would bypass it."""
        if self.runtime.recorder is not None:
            self.runtime.recorder.custom_gradients += 1
        if _tensors:
            return ([self._arg(t) if type(t) is _EagerTensor else t for t in outputs],
                    [self._arg(t) if type(t) is _EagerTensor else t for t in inputs])
        return None

    def slow(self, op_type, num_outputs, inputs, attrs, ctx, name=None):
        # The generated op wrapper records the gradient after this returns, with the very
        # list it passed here: swap in place, or the tape would record the stand-in as the
        # input and the gradient would stop there (after a fallback: no gradient at all for
        # the replayed part of the iteration).
        if not isinstance(inputs, list):
            inputs = list(inputs)
        for i, a in enumerate(inputs):
            real = self._arg(a)
            if real is not a:
                inputs[i] = real
        outputs = functions.forward_instead(op_type, num_outputs, inputs)
        if outputs is not None:  # a tf.function called in co-execution, run after a fallback
            return outputs
        return interception.ORIGINAL_SLOW(op_type, num_outputs, inputs, attrs, ctx, name)


def _rebuilt(seq, items):
    """``seq`` with ``items`` in place of its elements. A plain list or tuple keeps its type, a
    namedtuple is rebuilt field by field; any other subclass (tf_keras's ``ListWrapper``,
    whose constructor wraps rather than copies) becomes a plain list or tuple, which is what
    TF's conversion makes of it anyway."""
    kind = type(seq)
    if kind is list or kind is tuple:
        return kind(items)
    if isinstance(seq, tuple):
        return kind(*items) if hasattr(seq, "_fields") else tuple(items)
    return items


class CoexecDoor:
    """Handler during co-execution: the PythonRunner, with fallback on any mismatch."""

    def __init__(self, runtime):
        self.runtime = runtime

    def fast(self, ctx, op_type, name, args):
        rt = self.runtime
        try:
            return rt.runner.fast(ctx, op_type, name, args)
        except _FallbackException:  # the op wrapper takes its slow path, through the doors
            raise
        except Exception as why:  # noqa: BLE001 - a divergence, a graph error, Terra's own
            if rt.handle(why, at_op=True):
                return why.result
        fallback_lib.watch_read(rt.open_tapes, op_type, args[0] if args else None)
        return rt.tracing_door.fast(ctx, op_type, name, args)

    def slow(self, op_type, num_outputs, inputs, attrs, ctx, name=None):
        rt = self.runtime
        try:
            return rt.runner.slow(op_type, num_outputs, inputs, attrs, ctx, name)
        except Exception as why:  # noqa: BLE001 - a divergence, a graph error, Terra's own
            if rt.handle(why, at_op=True):
                return why.result
        fallback_lib.watch_read(rt.open_tapes, opdefs.op_name(op_type),
                                inputs[0] if inputs else None)
        return rt.tracing_door.slow(op_type, num_outputs, inputs, attrs, ctx, name)

    def custom_gradient(self, op_type, outputs, inputs, backward):
        """No tape records in co-execution (gradient regions are skipped), but a fallback's
        replay must put the custom gradient back on the tapes it re-enters: log it."""
        rt = self.runtime
        if rt.coexecuting():
            rt.runner.custom_gradient(op_type, outputs, inputs, backward)


class Runtime:
    def __init__(self):
        global _original_numpy
        self.stats = Stats()
        self.tracegraph = TraceGraph()
        self.sites = Sites()
        self.open_tapes = []
        self.recorder = None
        self.runner = None
        self.graph = None
        self.unsupported = None
        self.events = []  # fallbacks and other notes for explain()
        self._logged = set()  # (kind of event, site) already logged as a warning
        if config.verbosity > 0 and not log.handlers:
            log.addHandler(logging.StreamHandler())
            log.setLevel(logging.INFO)
        self.fallbacks_in_a_row = 0  # since the last co-executed iteration
        # gradient calls (by key) -> iterations, after the first graph was built, that none
        # of their regions was recorded for (a fallback at the call, or a trace that added a
        # region): past config.fold_after, one region serves every path (terra.regions)
        self.region_misses = {}
        self._missed = None  # the call this iteration fell back at, counted already
        self._detoured = {}  # user file:line -> iterations that ran eagerly from there
        self.ledger = budget.Ledger(budget=config.budget)
        self._began = None  # (phase, start time, site it fell back at or False): this iteration
        self._generation_time = 0.0  # of the iteration that is ending
        self._pending = None  # a background.Instantiation under way
        self.ctx = context.context()
        self.owner = threading.get_ident()
        self._graph_runner = None
        self._watchdog = None
        self.tracing_door = TracingDoor(self)
        self.coexec_door = CoexecDoor(self)
        if _original_numpy is None:
            _original_numpy = ops._EagerTensorBase._numpy
        materialize.install(_tensors, _resolve)
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
    def tape_enter(self, tape):
        if not self.open_tapes:
            self._end_iteration()
            self._book()
            self._begin_iteration()
        self.open_tapes.append(tape)
        attrs = tape.mark_attrs
        if self.phase == "coexecution" and self._coexec(
                lambda: self.runner.mark("enter", attrs, (), tape)):
            return
        tape.enter_real()
        if self.phase == "tracing":
            self.recorder.mark("enter", attrs)

    def tape_exit(self, tape, failed):
        if self.coexecuting() and failed:
            self.leave(Divergence("exception raised by user code", "user exception"))
        if failed and self.recorder is not None:
            self.recorder.aborted = True  # an iteration that raised is never merged
        if not (self.phase == "coexecution" and self._coexec(
                lambda: self.runner.mark("exit", tape.mark_attrs, (), tape))):
            tape.exit_real()
            if self.phase == "tracing":
                self.recorder.mark("exit", tape.mark_attrs)
        self.open_tapes.remove(tape)

    def tape_watch(self, tape, tensors):
        # A watched variable is its handle, as TF's tape watches it (not a read of its value,
        # which would leave the variable itself unwatched)
        handles = [_handle_or_self(t) for t in tensors]
        if self.phase == "coexecution" and self._coexec(
                lambda: self.runner.mark("watch", tape.mark_attrs, handles, tape)):
            return
        handles = [self.tracing_door._arg(t) if type(t) is _EagerTensor else t for t in handles]
        tape.real.watch(handles)
        if self.phase == "tracing":
            self.recorder.mark("watch", tape.mark_attrs, handles)

    def tape_gradient(self, tape, target, sources, output_gradients, unconnected):
        flat_sources = nest.flatten(sources)
        attrs = (tape.mark_attrs, len(nest.flatten(target)), len(flat_sources),
                 output_gradients is None, str(unconnected))
        if self.phase == "coexecution":
            tensors = grad_tensors(target, sources, output_gradients)
            extra = (tape, target, sources, output_gradients, unconnected)
            flat = self._coexec(lambda: self.runner.gradient(attrs, tensors, extra))
            if flat is not None:
                return nest.pack_sequence_as(sources, flat)
        if self.phase != "tracing":
            return tape.real.gradient(*map(self._swap_all, (target, sources, output_gradients)),
                                      unconnected_gradients=unconnected)
        return tape.traced_gradient(self._swap_all(target), self._swap_all(sources),
                                    self._swap_all(output_gradients), unconnected, attrs)

    def _swap_all(self, structure):
        return nest.map_structure(
            lambda x: self.tracing_door._arg(x) if type(x) is _EagerTensor else x, structure)

    def _book(self):
        """Enter the iteration that just ended in the cost ledger; stop if Terra is not
        earning back what it costs (``terra.budget``)."""
        now = time.perf_counter()
        if self._began is not None:
            phase, began, fell = self._began
            kind = ("fell back" if fell else "eager" if phase in _EAGER_PHASES else
                    "instantiating" if phase == "instantiating" else
                    "traced" if phase == "tracing" else "coexecuted")
            self.ledger.iteration(kind, now - began - self._generation_time,
                                  site=fell if fell else None)
        self._generation_time = 0.0
        verdict = self.ledger.verdict() if self.phase in ("tracing", "coexecution") else None
        if verdict is not None:
            self._give_up(verdict)
        self._began = None

    def _begin_iteration(self):
        began = time.perf_counter()
        self._missed = None
        self.sites.begin_iteration()
        s = self.stats
        s.iterations += 1
        if self.phase == "warmup" and s.iterations > config.warmup or \
                self.phase == "waiting" and self.ledger.affordable():
            self.phase = "tracing"
        if self.phase == "instantiating" and self._pending.done():
            self._take_instantiated()
        if self.phase == "tracing":
            self._start_recording()
        elif self.phase == "coexecution":
            # the previous iteration's job is done: the runner waits for it at its path's end
            job = Job(self.graph)
            it = Iteration(job)
            if not config.lazy:  # lazy: the PythonRunner submits when it first waits
                self.graph_runner.submit(job)
            self.runner.begin(it)
            interception.set_handler(self.coexec_door)
        elif self.phase in ("eager", "waiting", "instantiating"):
            # plain eager speed: the door only swaps stand-ins for values, and none is alive
            interception.set_handler(self.tracing_door if _tensors else None)
        self._began = (self.phase, began, False)

    def _end_iteration(self):
        try:
            if self.coexecuting():
                if not self.runner.at_end():
                    self.leave(Divergence("the iteration ended before the recorded one did",
                                        "early end"))
                else:
                    self._close_iteration()
        except (GraphFailed, errors.OpError):  # the user's error, reproduced eagerly
            raise
        except Exception as err:  # noqa: BLE001 - Terra's own failure
            self.fail_safe(err)
        if self.phase == "tracing" and self.recorder is not None:
            self._finish_trace()
        elif self.phase == "detour":  # the graph was kept: the next iteration co-executes
            self.phase = "coexecution"

    def _close_iteration(self):
        """The whole path was matched: sweep the iteration's stand-ins (falling back if one
        that Python still holds has no value the graph returns) and count it."""
        try:
            self.runner.end_path()
        except GraphFailed as why:  # the replay raises the error at the user's line
            self.leave(why)
            return
        uncovered = self.runner.finish()
        if uncovered:  # the replay gives every one of them its value
            self.leave(Divergence("a tensor outlived its iteration but the graph does not "
                                "return it", "new fetch point"))
        else:
            self.stats.coexecuted += 1
            self.fallbacks_in_a_row = 0
            self.runner.it = None

    def path_ended(self, why):
        """An op after the end of the matched path, with no tape open: the iteration is
        complete (typically the loop is over and Python reads results) and its graph work is
        done. Close it and run the op eagerly, untraced, like any op between iterations. With
        a tape open the op may need recording: fall back."""
        if self.open_tapes:
            self.leave(why)
            return
        self._close_iteration()
        if self.phase == "coexecution":
            interception.set_handler(self.tracing_door)

    def _start_recording(self):
        if config.freeze_gc:  # a trace allocates enough to set off a full collection
            gc.freeze()
        self.recorder = Recorder(_tensors, _original_numpy, self.sites)
        self.recorder.aborted = False
        self.ctx.add_op_callback(self.recorder.callback)
        interception.set_handler(self.tracing_door)

    def _finish_trace(self):
        rec = self.recorder
        self.recorder = None
        self.ctx.remove_op_callback(rec.callback)
        rec.finish()
        if rec.broken is not None:
            self._note("Terra error while tracing (trace dropped)", rec.broken)
            return
        if rec.creates_state or rec.aborted or not rec.records:
            return
        if not rec.skippable:
            why = "a gradient region contains ops that must run in Python"
            if rec.unskippable is not None:
                op, head = rec.unskippable
                why += (f": {op.op_type} (stateful, not a variable op) in the gradient called "
                        f"at {head.location.file}:{head.location.line}")
            else:
                why += ": a gradient that is not computed inside its region"
            self._give_up(why)
            return
        if len(rec.records) > config.max_trace_ops:
            return
        regions_before = self.tracegraph.regions() if self.stats.graph_generations else None
        try:
            covered, _ = self.tracegraph.merge(rec.records, any_path=self._folded())
        except Exception as err:  # noqa: BLE001 - the TraceGraph may be half-merged: stop
            if config.strict:
                raise
            self._give_up(f"Terra error while merging a trace: {type(err).__name__}: {err}")
            return
        self.stats.traces += 1
        if regions_before is not None:
            self._count_region_misses(regions_before)
        if config.check:
            self.tracegraph.lint()
        limit, s = config.max_fallbacks_in_a_row, self.stats
        if covered and self.fallbacks_in_a_row >= limit:
            self._give_up(f"{self.fallbacks_in_a_row} fallbacks in a row: every graph was "
                          "left before one iteration completed in it (see the fallbacks)")
        elif covered and s.fallbacks >= limit and s.fallbacks > s.coexecuted:
            self._give_up(f"{s.fallbacks} fallbacks and only {s.coexecuted} co-executed "
                          "iterations: new paths keep coming (see the fallbacks)")
        elif covered and s.graph_generations and not self.ledger.rebuild_allowed(
                s.graph_generations - 1, config.free_rebuilds):
            self.phase = "waiting"  # eager until the budget affords building the graph again
            self._note("waiting", "building the graph again would cost more than the budget "
                       "affords now: running eagerly until it does (see the cost ledger)")
        elif covered:
            self._generate()

    def _folded(self):
        """The gradient calls whose regions the graph makes one (``terra.regions``)."""
        return {key for key, n in self.region_misses.items() if n >= config.fold_after}

    def _count_region_misses(self, before):
        """Count the iteration as a miss of each gradient call (of a graph already built)
        its trace added a region to, unless it fell back at that call (counted then)."""
        missed, self._missed = self._missed, None
        for key, n in self.tracegraph.regions().items():
            if n > before.get(key, 0) and before.get(key) and key != missed:
                self._region_missed(key)

    def _region_missed(self, key):
        misses = self.region_misses[key] = self.region_misses.get(key, 0) + 1
        if misses == config.fold_after:
            self._note("one gradient region for every forward path", f"{misses} iterations "
                       "after the graph was built took forward paths or shapes no region of "
                       "this gradient call was recorded for: the next graph takes TF's "
                       "gradient through the switch-cases there (terra.regions)",
                       self.tracegraph.region_location(key))

    def _generate(self):
        t0 = time.perf_counter()
        try:
            with interception.paused():
                graph = generate(self.tracegraph, xla=config.xla, exact=config.exact,
                                 fold=self._folded())
        except Exception as e:  # noqa: BLE001 - an ungeneratable graph means: stay eager
            self._give_up(f"graph generation failed: {type(e).__name__}: {e}")
            return
        finally:
            took = time.perf_counter() - t0
            self._generation_time += took
            self.ledger.generation(took)
        if config.background:  # eager iterations until TF has instantiated it
            self._pending = background.Instantiation(graph, self.stats.iterations)
            self.phase = "instantiating"
        else:
            self._install(graph)

    def _take_instantiated(self):
        """The background instantiation is over: co-execute from this iteration on (if it
        failed, the first call fails the same way, which the GraphRunner handles)."""
        pending, self._pending = self._pending, None
        try:
            pending.result()
        except Exception as e:  # noqa: BLE001 - noted; the graph's first call will tell
            if config.strict:
                raise
            self._note("Terra error (instantiating the graph)", f"{type(e).__name__}: {e}")
        first, last = pending.iteration + 1, self.stats.iterations - 1
        self._note("graph instantiated", f"in the background in {pending.seconds:.2f}s, "
                   + (f"while iterations {first}-{last} ran eagerly" if last >= first else
                      "before the next iteration began"))
        self._install(pending.graph)

    def _install(self, graph):
        self.graph = graph
        self.stats.graph_generations += 1
        self.graph_runner  # noqa: B018 - starts the GraphRunner and watchdog threads
        if self.runner is not None:  # stall time of earlier graphs
            self.stats.python_stall += self.runner.stall_time
        self.runner = PythonRunner(self.graph, _tensors, _original_numpy, self._watchdog,
                                   config.timeout, self.handle, self.graph_runner.submit,
                                   self.sites)
        self.phase = "coexecution"
        if config.freeze_gc:  # what tracing and generation left behind is not walked again
            gc.collect(1)
            gc.freeze()

    def _note(self, what, reason, where=None):
        """An event for ``explain()``, and a log record (logger ``terra``): the first of its
        kind at a site is a warning (Terra stopped, a fallback, its own failure), the rest
        are for ``TERRA_VERBOSITY`` 1 and up; informational events are always below."""
        self.events.append((what, reason, where))
        at = f" at {where.file}:{where.line}" if where else ""
        key = (what.split(" [")[0], at)
        first = key not in self._logged
        self._logged.add(key)
        level = logging.WARNING if first and what.startswith(_WARN) else logging.INFO
        log.log(level, "Terra %s%s: %s", what, at, reason.splitlines()[0] if reason else "")

    def _give_up(self, reason):
        self.unsupported = reason
        self._note("eager", reason)
        self.phase = "eager"
        interception.set_handler(self.tracing_door)

    def step_aside(self, tape, what):
        """``tape.<what>`` runs on the real tape: leave co-execution if in it (the replay
        re-enters the real tapes), and do not merge this iteration's trace (the method's ops
        are not a gradient region Terra could skip)."""
        if self.phase == "coexecution" and self.runner.it is not None:
            self.leave(Divergence(f"tape.{what} runs on the real tape", "unsupported"))
        if self.recorder is not None:
            if not self.recorder.aborted:
                self._note("trace not merged", f"tape.{what} was called", user_location())
            self.recorder.aborted = True

    # -- leaving co-execution -------------------------------------------------------------
    def _coexec(self, fn):
        """Run a PythonRunner step (a tape mark, a gradient call); if it diverges, fall back
        and return None (the caller runs it for real), unless the replay already ran it."""
        try:
            result = fn()
            return True if result is None else result
        except Exception as why:  # noqa: BLE001 - a divergence, a graph error, Terra's own
            if self.handle(why):
                return True if why.result is None else why.result
            return None

    def handle(self, why, at_op=False) -> bool:
        """The one place co-execution is left. ``why`` is a :class:`Divergence`, a graph
        error (:class:`GraphFailed`) or any other exception, which is Terra's own failure
        (:meth:`fail_safe`). Returns whether the op being matched already ran (the replay
        ran it; its result is ``why.result``); if not, the caller runs it eagerly. ``at_op``:
        raised at an op issued through a door, where an op past the end of the matched path
        with no tape open closes the iteration instead (:meth:`path_ended`)."""
        if not isinstance(why, (Divergence, GraphFailed)):
            self.fail_safe(why)
            return False
        if self.coexecuting():  # else left already, by an op this one issued (a variable read)
            if at_op and isinstance(why, PathEnded):
                self.path_ended(why)
                return False
            self.leave(why)
        return why.ran

    def coexecuting(self) -> bool:
        """Whether an iteration is being co-executed now (not yet left, not yet closed)."""
        return self.phase == "coexecution" and self.runner.it is not None

    def fail_safe(self, err):
        """Terra's own machinery raised ``err`` (a bug, never the user's error): leave
        co-execution if in it, so the iteration goes on eagerly with eager's numbers, and
        note it with Terra's traceback for ``explain()``. ``TERRA_STRICT`` re-raises."""
        if config.strict:
            raise err
        why = Divergence(f"Terra error {type(err).__name__}: {err}\n"
                       + "".join(traceback.format_exception(err, limit=-4)).rstrip(),
                       "terra error")
        if self.coexecuting():
            self.leave(why)
        else:
            self._note("Terra error (ran eagerly)", why.reason, user_location())

    def leave(self, why):
        """Fallback (paper §3.2.1): cancel, restore, replay the matched prefix, trace on.

        After a graph-side error the replay runs the failing op eagerly if Python had issued
        it, so TF raises its own error there, with the state eager has at that point. If
        Python has not reached it yet, tracing goes on and eager raises it when it does."""
        runner = self.runner
        it = runner.it
        if it is None:  # the iteration was closed early (path_ended): nothing to replay
            if isinstance(why, GraphFailed):
                self._raise_graph_error(why.job)
            raise RuntimeError(f"Terra: {why} at {user_location()}, after the iteration it "
                               "belongs to had ended; its tape was never run for real")
        job = it.job
        where = user_location()
        if isinstance(why, Divergence):
            why.site = where
        if self._began is not None:  # the site the fallback's cost is booked to
            self._began = (*self._began[:2], f"{where.file}:{where.line}" if where else "?")
        self.graph_runner.cancel(job)
        try:
            fallback_lib.restore(job, config.timeout)
        except fallback_lib.GraphStuck as stuck:
            raise self._abandon(why, stuck) from None
        self.stats.fallbacks += 1
        self.fallbacks_in_a_row += 1
        if isinstance(why, Divergence):
            category, reason = why.category, why.reason
            loop = (runner.loop_trips_differ(issuing=category != "early end")
                    if category in ("new op", "new producer", "early end") else None)
            if loop is not None:
                category, reason = "new loop count", f"{loop} ({reason})"
        else:
            category, reason = "graph error", str(why)
        self._note(f"fallback [{category}]", reason, where)
        detour = self._detour(why, category)
        if isinstance(why, RegionMissed):
            self._missed = why.call
            self._region_missed(why.call)
        runner.it = None
        if detour:
            runner.rewind()
            self.phase = "detour"
            self.recorder = Recorder(_tensors, _original_numpy, self.sites)  # not installed
            self.recorder.aborted = True  # nothing of the replay is recorded or merged
            interception.set_handler(self.tracing_door)
            self._note_detour(where)
        else:
            self.graph = None
            self.phase = "tracing"
            self._start_recording()
        try:
            fallback_lib.replay(it.log, self.recorder, self.open_tapes, it.customs)
        finally:
            runner.sweep(it)
            it.release()
            if detour:  # its hook-table entries (the replayed outputs it noted) go with it
                self.recorder.finish()
                self.recorder = None
        if isinstance(why, GraphFailed) and why.at_end:
            # Python issued every op and eager ran them all without an error: the numbers
            # are eager's, but the graph should not have failed. Say so in explain().
            self._note("graph error not reproduced eagerly", str(why))

    def _detour(self, why, category) -> bool:
        """Whether this fallback keeps the graph: the iteration goes on eagerly from here,
        untraced, and the next one co-executes again. Taken where building the graph again
        for the new path would not pay (past the free rebuilds, over the budget) and the
        previous iteration co-executed, so the graph still serves the program: a site that
        keeps failing then costs the iterations that reach it, not the whole run. Two in a
        row mean the path has changed: that fallback traces, as any other."""
        s = self.stats
        return (isinstance(why, Divergence) and category != "terra error"
                and self.fallbacks_in_a_row == 1 and s.graph_generations > 0
                and not self.ledger.rebuild_allowed(s.graph_generations - 1,
                                                    config.free_rebuilds))

    def _note_detour(self, where):
        at = f"{where.file}:{where.line}" if where else "?"
        first = at not in self._detoured
        self._detoured[at] = self._detoured.get(at, 0) + 1
        if first:
            self._note("detour", "a new path where building the graph again would cost more "
                       "than the budget affords: this iteration runs eagerly from here, the "
                       "graph is kept for the next (see the cost ledger)", where)

    def _abandon(self, why, stuck):
        """The graph neither answered nor stopped when cancelled (a kernel that never returns):
        leave its thread behind, run eagerly from here, and return the error for the user,
        which names the wait that gave up and the user's line."""
        self.runner.it = None
        self.graph = None
        self._graph_runner.stop()  # its thread ends if the job ever returns (a daemon)
        self._watchdog.stop()
        self._graph_runner = self._watchdog = None
        where = user_location()
        at = f" at {where.file}:{where.line}" if where else ""
        message = (f"Terra: {why}; {stuck}{at}. Terra abandoned that graph and runs eagerly "
                   "from here; variables it was writing may be partly updated. Raise "
                   "TERRA_TIMEOUT if a step legitimately takes longer.")
        self._give_up(message)
        return fallback_lib.GraphStuck(message)

    def _graph_error(self, job):
        # Called in the GraphRunner thread: unblock a PythonRunner waiting on a fetch.
        if self.runner is not None:
            self.runner.wait_cm.start_cancel()

    def _raise_graph_error(self, job):
        err = job.error
        raise type(err)(getattr(err, "node_def", None), getattr(err, "op", None),
                        f"{err.message} (raised by the graph Terra ran for your loop)") \
            if hasattr(err, "message") else err

    def value(self, entry):
        try:
            return entry.runner.value_of(entry)
        except IterationAborted:
            raise
        except Exception as why:  # noqa: BLE001 - a divergence, a graph error, Terra's own
            self.handle(why)
            if entry.value is None:
                raise IterationAborted(f"Terra: a value of an abandoned iteration was used "
                                       f"at {user_location()}") from why
            return entry.value

    # -- stats / reset ------------------------------------------------------------------
    def snapshot_stats(self):
        s = dataclasses.replace(self.stats)
        if self.runner is not None:
            s.python_stall += self.runner.stall_time
        if self._graph_runner is not None:
            s.graph_exec = self._graph_runner.busy_time
            s.graph_idle = self._graph_runner.idle_time
        return s

    def shutdown(self):
        """Finish pending graph work so variables hold their final values."""
        if self._pending is not None:  # its graph is not used; its thread is not left running
            self._pending.wait(config.timeout)
        if self.phase == "coexecution" and self.runner.it is not None:
            if not self.runner.at_end():
                self.leave(Divergence("terra.reset() in the middle of an iteration", "early end"))
            else:
                self.graph_runner.submit(self.runner.it.job)
                self._close_iteration()
        if self.recorder is not None:
            self.ctx.remove_op_callback(self.recorder.callback)
        if self._graph_runner is not None:
            self._graph_runner.stop()
            self._watchdog.stop()
        gc.unfreeze()
        interception.set_handler(self.tracing_door if _tensors else None)


def _format_switch_case(sc, channel):
    def block(b):
        if not b:
            return "X"
        size = sum(1 + (n.body_len if n.kind is NodeKind.GRAD else 0) for n in b)
        return f"{{{b[0]!r}}}" if size == 1 else f"{{{b[0]!r}..{b[-1]!r} ({size} nodes)}}"

    cases = " | ".join(f"{block(c.block)} via " + ", ".join(f"{u!r}->{v!r}" for u, v in
                                                            c.control_edges) for c in sc.cases)
    kind = "tf.switch_case" if channel is not None else "inline"
    return f"[{kind}] {cases}" + (f"; may end via {len(sc.exits)} edge(s)" if sc.exits else "")


def grad_tensors(target, sources, output_gradients):
    """The tensors a gradient call depends on, as validated inputs: targets, sources (a
    variable as its handle) and output gradients."""
    flat = nest.flatten(target) + nest.flatten(sources)
    if output_gradients is not None:
        flat += nest.flatten(output_gradients)
    return [_handle_or_self(x) for x in flat]


def _handle_or_self(x):
    if isinstance(x, _Variable) or hasattr(x, "_should_act_as_resource_variable"):
        return x.handle
    return x


_runtime = None
_plain_notes: dict = {}  # why a tape acted as a plain GradientTape -> how many times


def owner_thread():
    """The thread whose training loop Terra runs (the one that built the runtime), if any."""
    return _runtime.owner if _runtime is not None else None


def note_plain(why):
    """A Terra tape acts as a plain GradientTape; ``explain()`` says why and how often."""
    _plain_notes[why] = _plain_notes.get(why, 0) + 1


def get() -> Runtime:
    global _runtime
    if _runtime is None:
        _runtime = Runtime()
    return _runtime


def stats() -> Stats:
    """Counters: iterations, traces, fallbacks, graph_generations, coexecuted, phase, and the
    time breakdown of the two runners (seconds)."""
    return _runtime.snapshot_stats() if _runtime is not None else Stats()


def reset():
    """Forget the TraceGraph, the graph and the counters; the next tape starts afresh."""
    global _runtime
    if _runtime is not None:
        _runtime.shutdown()
    _runtime = None
    _plain_notes.clear()


def configure(**switches):
    """Set switches (see :class:`terra.config.Config`), e.g. ``configure(lazy=True)``."""
    for name, value in switches.items():
        if not hasattr(config, name):
            raise TypeError(f"unknown Terra switch {name!r}")
        setattr(config, name, value)


def explain() -> str:
    """A human-readable report: the TraceGraph, the phase, and every fallback."""
    rt = _runtime
    plain = [f"{n} time(s) a tape ran as a plain tf.GradientTape: {why}"
             for why, n in _plain_notes.items()]
    if rt is None:
        return "\n".join(["Terra has not run yet.", *plain])
    s = rt.snapshot_stats()
    lines = [f"Terra: {s.iterations} iterations, {s.traces} traces, {s.fallbacks} fallbacks, "
             f"{s.graph_generations} graph generations, {s.coexecuted} co-executed; "
             f"phase {s.phase}"]
    if rt.unsupported:
        lines.append(f"running eagerly because {rt.unsupported}")
    lines.append(str(rt.ledger))
    lines.extend(plain)
    for what, reason, loc in rt.events:
        where = f" at {loc.file}:{loc.line}" if loc else ""
        lines.append(f"{what}{where}: {reason}")
    g = rt.tracegraph
    joins = [n for n in g.nodes if len(n.preds) > 1 and n is not g.end]
    loops = g.loops()
    lines.append(f"TraceGraph: {len(g.nodes) - 2} nodes, {len(g.branch_points)} branch points, "
                 f"{len(joins)} merge-back points, {len(loops)} lines in Python loops (a loop "
                 "is unrolled, one node per trip; the graph rolls the trips of one that took "
                 "several trip counts into a loop node)")
    lines.extend(f"  loop at {loc.file}:{loc.line} ({loc.func}): ran "
                 f"{'|'.join(map(str, counts))} times per iteration" for loc, counts in loops[:8])
    if len(loops) > 8:
        lines.append(f"  ... and {len(loops) - 8} more lines in loops")
    for node in rt.graph.loops if rt.graph is not None else ():
        lines.append(f"  loop node {node!r} at {node.location}: {node.body_len} ops a trip, "
                     f"{node.peeled} trips unrolled, then a tf.while_loop (traced "
                     f"{'|'.join(map(str, node.counts))} trips)")
    if rt.graph is not None:
        lines.append("switch-cases (Algorithm 1; {first..last node} via control edges):")
        lines.extend(f"  {i}: {_format_switch_case(sc, channel)}"
                     for i, (sc, channel) in enumerate(rt.graph.switch_cases, 1))
    lines.append(str(rt.tracegraph))
    if rt.graph is not None:
        lines.append(str(rt.graph))
    return "\n".join(lines)


