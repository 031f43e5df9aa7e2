"""Leaving co-execution: the runtime's one handler for divergences, graph errors and
Terra's own failures, and the fallback it runs (paper section 3.2.1).

A mixin of :class:`terra.runtime.Runtime`, whose state it changes: the phase, the recorder,
the runners and the ledger, all at once. Kept apart from the iterations' bookkeeping
because it is where correctness is decided: cancel the graph, put the variables back,
replay what Python matched so far, and trace on (or take a detour).
"""

import traceback

from terra import fallback as fallback_lib
from terra import hooks, interception, profiling
from terra.config import config
from terra.divergence import (
    Divergence,
    GraphFailed,
    IterationAborted,
    PathEnded,
    RaisedInPython,
    RegionMissed,
)
from terra.location import user_location
from terra.trace import Recorder


class Exits:
    """How an iteration leaves co-execution (mixed into the Runtime)."""

    def handle(self, why, at_op=None) -> bool:
        """The one place co-execution is left. ``why`` is a :class:`Divergence`, a graph
        error (:class:`GraphFailed`) or any other exception, which is Terra's own failure
        (:meth:`fail_safe`). Returns whether the op being matched already ran (the replay
        ran it; its result is ``why.result``); if not, the caller runs it eagerly. ``at_op``:
        raised at an op issued through a door, which found the runner at step ``at_op``:
        an op past the end of the matched path, or one that left the path before its step
        was matched where the rest of the path has no effects
        (``PythonRunner.may_end_before``), with no tape open, closes the iteration instead
        (:meth:`path_ended`). TF's error from an op run in Python is raised, after the
        iteration is closed or left (:meth:`_raised_in_python`)."""
        if not isinstance(why, (Divergence, GraphFailed)):
            self.fail_safe(why)
            return False
        if isinstance(why, RaisedInPython):
            self._raised_in_python(why, at_op)
        if self.coexecuting():  # else left already, by an op this one issued (a variable read)
            if at_op is not None and (isinstance(why, PathEnded) or isinstance(why, Divergence)
                                      and not why.ran and self.runner.cur is at_op
                                      and self.runner.may_end_before(why)):
                self.path_ended(why)
                return False
            self.leave(why)
        return why.ran

    def _raised_in_python(self, why, at_op):
        """An op Python ran for real raised TF's error (``why.error``), which eager raises
        at this op too: end the iteration before it where the rest of the path has no
        effects (Keras' iterator at the end of a dataset of unknown length), else fall back
        so the variables are eager's here; then raise the error. The op is not run again."""
        if self.coexecuting():
            if at_op is not None and self.runner.cur is at_op and \
                    self.runner.may_end_before(why):
                self.path_ended(why)
            else:
                self.leave(why)
        raise why.error

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
            self.events.note("Terra error (ran eagerly)", why.reason, user_location())

    def leave(self, why):
        """Fallback (paper §3.2.1): cancel, restore, replay the matched prefix, trace on.

        After a graph-side error the replay runs the failing op eagerly if Python had issued
        it, so TF raises its own error there, with the state eager has at that point. If
        Python has not reached it yet, tracing goes on and eager raises it when it does."""
        runner = self.runner
        it = runner.it
        if it is None:  # the iteration was closed early (path_ended): nothing to replay
            if isinstance(why, GraphFailed):
                raise why.user_error()
            raise RuntimeError(f"Terra: {why} at {user_location()}, after the iteration it "
                               "belongs to had ended; its tape was never run for real")
        self.span.begin("terra_fallback")  # the trace that follows ends it, or the iteration
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
        self.events.note(f"fallback [{category}]", reason, where)
        detour = (isinstance(why, Divergence) and category != "terra error"
                  and self.lifecycle.keeps_graph(self.fallbacks_in_a_row, where))
        if isinstance(why, RegionMissed):
            self.lifecycle.fell_back_at(why.call)
        runner.it = None
        if detour:
            runner.rewind()
            self.phase = "detour"
            self.recorder = Recorder(hooks.tensors, hooks.original_numpy, self.sites)  # unused
            self.recorder.aborted = True  # nothing of the replay is recorded or merged
            interception.set_handler(self.tracing_door)
            self.lifecycle.note_detour(where)
        else:
            self.graph = None
            self.phase = "tracing"
            self._start_recording()
        try:
            with profiling.trace("terra_replay"):
                fallback_lib.replay(it.log, self.recorder, self.open_tapes, it.customs)
        finally:
            it.release(runner.sweep(it))
            if detour:  # its hook-table entries (the replayed outputs it noted) go with it
                self.recorder.finish()
                self.recorder = None
        if isinstance(why, GraphFailed) and why.at_end:
            # Python issued every op and eager ran them all without an error: the numbers
            # are eager's, but the graph should not have failed. Say so in explain().
            self.events.note("graph error not reproduced eagerly", str(why))

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
        """The graph failed on its own (called in the GraphRunner's thread): end the wait
        for a value Python may be blocked in, which then raises the graph's error."""
        if self.runner is not None:
            self.runner.waiting.graph_failed()

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
