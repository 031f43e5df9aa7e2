"""What a Terra tape's calls do in each phase: the tape marks (enter, exit, watch), the
gradient call, and the methods that only the real tape serves.

``TerraGradientTape`` forwards every call here, as the interception layer forwards every op
to a door (``terra.doors``). The outermost tape enter starts an iteration
(``Runtime.next_iteration``). In co-execution a call is matched by the PythonRunner, and
a divergence goes to ``Runtime.handle`` like an op's; while tracing the real tape runs it
and the recorder notes it; in the other phases the real tape runs it, on values rather than
stand-ins.
"""

import sys
import threading

from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.util import nest

from terra import replicas
from terra.divergence import Divergence
from terra.hooks import tensors as _tensors
from terra.location import entry_point, user_location

_EagerTensor = ops.EagerTensor
_Variable = resource_variable_ops.BaseResourceVariable


class TapeMarks:
    """The handler of a tape's calls, acting on the runtime it is given: its phase, open
    tapes, recorder and PythonRunner."""

    def __init__(self, runtime):
        self.runtime = runtime

    def enter(self, tape):
        """A tape entered again before a gradient consumed it records on, as TF's does: its
        ``reenter`` continues the iteration it was first entered in."""
        rt = self.runtime
        what = "reenter" if tape.live else "enter"
        run = replicas.replica_of(threading.current_thread())
        # a replica's tape whose strategy.run began this iteration continues it: the
        # replicas of one run are one iteration, as one thread (``terra.replicas``)
        if not rt.open_tapes and what == "enter" and (run is None or run is not rt.run):
            rt.run = run
            rt.next_iteration()
            rt.entry = entry_point(sys._getframe(1))  # the ``with`` of the iteration's tape
        rt.open_tapes.append(tape)
        attrs = tape.mark_attrs
        if rt.phase == "coexecution" and self.coexec(
                lambda: rt.runner.mark(what, attrs, (), tape)):
            return
        tape.enter_real()
        if rt.phase == "tracing":
            rt.recorder.mark(what, attrs)

    def exit(self, tape, failed):
        rt = self.runtime
        if rt.coexecuting() and failed:
            rt.leave(Divergence("exception raised by user code", "user exception"))
        if failed and rt.recorder is not None:
            rt.recorder.aborted = True  # an iteration that raised is never merged
        if not (rt.phase == "coexecution" and self.coexec(
                lambda: rt.runner.mark("exit", tape.mark_attrs, (), tape))):
            tape.exit_real()
            if rt.phase == "tracing":
                rt.recorder.mark("exit", tape.mark_attrs)
        rt.open_tapes.remove(tape)

    def watch(self, tape, tensors):
        """The graph sees a watched variable as its handle (not a read of its value, which
        would leave the variable itself unwatched); the real tape watches the variable, as
        TF's does, so that ``watched_variables`` lists it."""
        rt = self.runtime
        handles = [handle_or_self(t) for t in tensors]
        if rt.phase == "coexecution" and self.coexec(
                lambda: rt.runner.mark("watch", tape.mark_attrs, handles, tape,
                                       [t if t is not h else None
                                        for t, h in zip(tensors, handles)])):
            return
        real = rt.tracing_door.real
        tensors = [real(t) if type(t) is _EagerTensor else t for t in tensors]
        tape.real.watch(tensors)
        if rt.phase == "tracing":
            rt.recorder.mark("watch", tape.mark_attrs,
                             [real(t) if type(t) is _EagerTensor else t for t in handles])

    def watched_variables(self, tape):
        """``tape.watched_variables()``, a query that changes nothing: the real tape answers
        it, and a trace records its answer as a ``watched`` mark, which co-execution matches
        and answers from (a library asks it in every call: tf_keras' ``Lambda``)."""
        rt = self.runtime
        if rt.phase == "coexecution":
            answer = self.coexec(lambda: rt.runner.watched(tape.mark_attrs, tape))
            if answer is not None:
                return answer
        answer = tape.real.watched_variables() if tape.real is not None else ()
        if rt.phase == "tracing":
            rt.recorder.mark("watched", (tape.mark_attrs, tuple(v.ref() for v in answer)))
        return answer

    def gradient(self, tape, target, sources, output_gradients, unconnected):
        rt = self.runtime
        if rt.phase == "coexecution":
            tensors = grad_tensors(target, sources, output_gradients)
            extra = (tape, target, sources, output_gradients, unconnected)
            attrs = grad_attrs(tape, target, sources, output_gradients, unconnected)
            flat = self.coexec(lambda: rt.runner.gradient(attrs, tensors, extra))
            if flat is not None:
                return nest.pack_sequence_as(sources, flat)
        if rt.phase != "tracing":
            return tape.real.gradient(*map(self._swap_all, (target, sources, output_gradients)),
                                      unconnected_gradients=unconnected)
        return tape.traced_gradient(
            self._swap_all(target), self._swap_all(sources), self._swap_all(output_gradients),
            unconnected, grad_attrs(tape, target, sources, output_gradients, unconnected))

    def step_aside(self, tape, what):
        """``tape.<what>`` runs on the real tape: leave co-execution if in it (the replay
        re-enters the real tapes), and do not merge this iteration's trace (the method's ops
        are not a gradient region Terra could skip)."""
        rt = self.runtime
        if rt.phase == "coexecution" and rt.runner.it is not None:
            rt.leave(Divergence(f"tape.{what} runs on the real tape", "unsupported"))
        if rt.recorder is not None:
            if not rt.recorder.aborted:
                rt.events.note("trace not merged", f"tape.{what} was called", user_location())
            rt.recorder.aborted = True

    def _swap_all(self, structure):
        if not _tensors:  # no stand-in or traced value alive: nothing to swap
            return structure
        real = self.runtime.tracing_door.real
        return nest.map_structure(
            lambda x: real(x) if type(x) is _EagerTensor else x, structure)

    def coexec(self, fn):
        """Run a PythonRunner step (a tape mark, a gradient call, a library call: also
        ``terra.library_regions``'s); if it diverges, fall back and return None (the caller
        runs it for real), unless the replay already ran it."""
        try:
            result = fn()
            return True if result is None else result
        except Exception as why:  # noqa: BLE001 - a divergence, a graph error, Terra's own
            if self.runtime.handle(why):
                return True if why.result is None else why.result
            return None


def grad_attrs(tape, target, sources, output_gradients, unconnected) -> tuple:
    """What a gradient call is matched on, besides its tensors."""
    return (tape.mark_attrs, len(nest.flatten(target)), len(nest.flatten(sources)),
            output_gradients is None, str(unconnected))


def grad_tensors(target, sources, output_gradients):
    """The tensors a gradient call depends on, as validated inputs: targets, sources (a
    variable as its handle) and output gradients."""
    flat = nest.flatten(target) + nest.flatten(sources)
    if output_gradients is not None:
        flat += nest.flatten(output_gradients)
    return [handle_or_self(x) for x in flat]


def handle_or_self(x):
    if isinstance(x, _Variable) or hasattr(x, "_should_act_as_resource_variable"):
        return x.handle
    return x
