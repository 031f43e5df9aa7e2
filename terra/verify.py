"""Verify mode (``TERRA_VERIFY=k``, ``terra.configure(verify=k)``): every k-th co-executed
iteration is run again eagerly and what the graph computed is compared with eager's numbers.

Terra's promise is eager's numbers, and its tests check it on their programs; a user's long
run is another program. Verify mode lets that run check the promise as it goes, at a cost
the user chooses (one eager iteration more every k), and stop, or warn, the first time the
graph and eager disagree, naming the op and the user's line.

How, with the fallback's machinery: the GraphRunner snapshots the variables the graph writes
before every job (what a fallback restores), so an iteration costs nothing more until it
ends. When a co-executed iteration to verify has matched its whole path and its job is done
(:meth:`Verifier.keep`, before its stand-ins are swept), the graph's results are kept: the
variables it wrote, and then (:meth:`Verifier.check`, once the sweep has given the values
Python kept their values) the value of every output Python read or kept. The snapshot is
assigned back and the iteration's whole log is replayed eagerly by the fallback's replay
(``fallback.replay``): the same ops, in Python's order, on the same inputs (Python's batches
and constants, the outputs of the ops Python ran itself, which are not run again: a random
op's draw, a batch taken from an iterator), with the real tapes and ``tape.gradient``. Each
kept value is compared with its replayed one and each written variable with its value after
the replay. The variables stay at eager's values, and every stand-in Python still holds
resolves to eager's value (the replay gives each its own).

What is compared, and why:

- the outputs Python read during the iteration (``.numpy()``, ``float()``, ``if t:``) or
  kept past it (a loss appended to a list), which the graph returns: the numbers the program
  sees. An output Python neither read nor kept is not returned by the graph, so it is not
  compared itself; what it feeds is (a loss, a variable);
- every variable the graph writes, after the step: what the next iteration starts from;
- floats with ``numpy.isclose`` (``Config.verify_rtol`` 1e-5, ``verify_atol`` 1e-6, eager's
  value the reference), NaN equal to NaN; integers, booleans and strings exactly. Exact
  equality is not asked by default: with ``exact`` on (the default) the graph rounds as
  eager does and is bit-identical on the known cases, but a gradient emitted as TF's
  symbolic gradient, a loop's gradient through a While, XLA or ``exact`` off sum or round
  otherwise (1e-7 relative and more).

The first difference is the one earliest in the iteration: a value at the op that made it,
a variable at the first op of the path that writes it (an optimizer's update, at the user's
``apply_gradients`` line), which is where the graph's state first parts from eager's as
far as Terra can see. Its op and the user's line are in the :class:`DivergenceError` (or
:class:`DivergenceWarning`), and Terra then runs eagerly for the rest of the run: a graph
that computed other numbers once cannot be trusted for the iterations between checks.

An error TF raises in the replay where the graph ran without one is a difference too; the
variables are then left at the graph's values, since eager has none past its error.

What cannot be checked: values Python read during the iteration were the graph's (the
check comes at its end), and Python's decisions made on them (``if loss > t``) are taken
as they were; a replay follows the path Python took. With k > 1 the iterations between two
checks are not redone: the snapshot a check starts from may carry up to k - 1 iterations of
the graph's numbers.
"""

import dataclasses
import time
import warnings

import numpy as np
from tensorflow.python.framework import errors

from terra import fallback, hooks, interception, opdefs, profiling, standins
from terra.config import config
from terra.location import user_location
from terra.nodes import NodeKind, SlotKind
from terra.trace import Recorder

_NO_VALUE = frozenset({20, 21})  # DT_RESOURCE, DT_VARIANT: no numbers to compare


class DivergenceError(RuntimeError):
    """A verified iteration gave other numbers under Terra than eagerly (verify mode).
    ``difference``: the first one (:class:`Difference`: the op, the user's line, the
    numbers)."""

    def __init__(self, difference):
        super().__init__(str(difference))
        self.difference = difference


class DivergenceWarning(UserWarning):
    """What a difference gives with ``verify_action="warn"`` instead of raising."""


@dataclasses.dataclass
class Difference:
    """Where a verified iteration first parted from eager. ``what``: which value of the op
    (``output 0 of``, ``gradient result 1 of``, ``a variable of shape [20, 16] written
    by``); ``detail``: the numbers; ``more``: how many other values and variables differed."""

    iteration: int
    op: str
    location: object  # terra.location.Location of the user's line, or None
    what: str
    detail: str
    more: int = 0

    def __str__(self):
        loc = self.location
        at = f" issued at {loc.file}:{loc.line}" if loc else ""
        also = f"; {self.more} more value(s) or variable(s) differ" if self.more else ""
        return (f"Terra's graph and eager differ in iteration {self.iteration}: {self.what} "
                f"{self.op}{at}: {self.detail}{also}")


@dataclasses.dataclass
class _Kept:
    """What the check of one iteration needs once its stand-ins are swept (which drops the
    iteration's log and snapshot): its log and custom gradients, for the replay; the
    variables the graph writes, their snapshot before the job and their values after."""

    iteration: int
    log: list
    customs: list
    written: list
    read: object  # the graph's snapshot function: reads them all
    before: list | None  # None: the graph writes no variable
    after: list


class Verifier:
    """Verify mode for one runtime: which co-executed iterations are checked, the check,
    and its counts and cost, in the runtime's ``stats`` (``verified``, ``verify_differences``,
    ``verify_time``)."""

    def __init__(self, stats):
        self.stats = stats
        self.ended = 0  # co-executed iterations that matched their whole path
        self.values = self.variables = 0  # compared so far

    def will_keep(self):
        """Whether the next co-executed iteration to match its whole path is a k-th: its
        graph must snapshot before writing (``terra.commit``)."""
        return bool(config.verify) and (self.ended + 1) % config.verify == 0

    def keep(self, it):
        """A co-executed iteration ``it`` matched its whole path and its job is done: if it
        is a k-th, keep what its check needs (:class:`_Kept`), else None."""
        if not config.verify:
            return None
        self.ended += 1
        if self.ended % config.verify:
            return None
        began = time.perf_counter()
        job = it.job
        graph = job.graph
        after = []
        if graph.snapshot_fn is not None:
            with interception.paused():  # Terra's read, not the user's op
                after = graph.snapshot_fn()
        before = job.snapshot if job.early is None or job.snapshot is None else \
            [*job.early, *job.snapshot]  # graph.written: those before the gate first
        # an op's record that is its output's entry loses its inputs when the iteration
        # is released: kept as a LoggedOp
        log = [fallback.LoggedOp(r.step, r.inputs, r.outputs, r.stopped)
               if type(r) is standins.Entry else r for r in it.log]
        kept = _Kept(self.stats.iterations, log, it.customs, graph.written,
                     graph.snapshot_fn, before, after)
        self.stats.verify_time += time.perf_counter() - began
        return kept

    def check(self, kept, rt):
        """Replay the kept iteration eagerly from its snapshot (on the runtime ``rt``'s
        tapes and sites) and compare; return the first :class:`Difference`, or None. The
        variables are left at eager's values, or at the graph's if the replay raised."""
        began = time.perf_counter()
        try:
            return self._check(kept, rt)
        finally:
            self.stats.verified += 1
            self.stats.verify_time += time.perf_counter() - began

    def _check(self, kept, rt):
        outputs = _graph_values(kept.log)  # before the replay gives the entries eager's
        if kept.before is not None:
            fallback.assign(kept.written, kept.before)
        # a recorder no op callback feeds, as for a detour: the replay's records are dropped
        rt.recorder = Recorder(hooks.tensors, hooks.original_numpy, rt.sites)
        rt.recorder.aborted = True
        interception.set_handler(rt.tracing_door)  # tape.gradient's ops run for real
        try:
            with profiling.trace("terra_verify"):
                fallback.replay(kept.log, rt.recorder, rt.open_tapes, kept.customs)
        except errors.OpError as error:  # eager fails where the graph did not
            fallback.assign(kept.written, kept.after)  # eager has no state past its error
            self.stats.verify_differences += 1
            # the replay names the user's line of a failing op in the message
            return Difference(kept.iteration, "the iteration", None, "the eager run of",
                              f"raised {type(error).__name__}: {error.message}")
        except BaseException:
            fallback.assign(kept.written, kept.after)
            raise
        finally:
            rt.recorder.finish()
            rt.recorder = None
        found = self._compare(kept, outputs)
        self.stats.verify_differences += len(found)
        if not found:
            return None
        first = min(found, key=_order)[1]
        first.more = len(found) - 1
        return first

    def _compare(self, kept, outputs):
        """``[(order, Difference)]``: the outputs the graph gave that the replay computed
        otherwise, and the variables it left otherwise, each ordered by its place in the
        log."""
        found = []
        for order, what, step, graph_value, entry in outputs:
            detail = _differs(graph_value, entry.value)
            if detail is not None:
                op = "tape.gradient" if step.kind is NodeKind.GRAD else step.op_type
                found.append((order, Difference(kept.iteration, op, step.node.location,
                                                what, detail)))
        self.values += len(outputs)
        if kept.written:
            with interception.paused():
                eager = kept.read()
            for (handle, _), graph_value, value in zip(kept.written, kept.after, eager):
                detail = _differs(graph_value, value)
                if detail is not None:
                    order, step = _writer(kept.log, handle)
                    found.append((order, Difference(
                        kept.iteration, step.op_type if step else "an op",
                        step.node.location if step else None,
                        f"a variable of shape {list(value.shape)} written by",
                        detail)))
            self.variables += len(kept.written)
        return found

    def summary(self):
        """``explain()``'s line on verify mode, or None if it never ran."""
        s = self.stats
        if not config.verify and not s.verified:
            return None
        each = f", {1e3 * s.verify_time / s.verified:.1f} ms per check" if s.verified else ""
        return (f"verify mode (every {config.verify} co-executed iteration(s), rtol "
                f"{config.verify_rtol:g}, atol {config.verify_atol:g}): {s.verified} "
                f"iteration(s) checked against eager, {self.values} values and "
                f"{self.variables} variables compared, {s.verify_differences} "
                f"difference(s); {s.verify_time:.3f}s{each}")


def report(difference):
    """Raise :class:`DivergenceError` for ``difference``, or warn (``verify_action``): a
    warning attributed to the user's line that issued the op (else to where Python is)."""
    if config.verify_action == "raise":
        raise DivergenceError(difference)
    loc = difference.location or user_location()
    if loc is None:
        warnings.warn(str(difference), DivergenceWarning, stacklevel=2)
    else:
        warnings.warn_explicit(str(difference), DivergenceWarning, loc.file, loc.line)


def _graph_values(log):
    """The outputs of the logged steps whose values Python has from the graph (read or
    kept): ``(order, what, step, value, entry)``, the entry getting eager's in the replay."""
    found = []
    for order, logged in enumerate(log):
        kind = type(logged)
        if kind in fallback.OP_RECORDS:
            what = "output {} of"
        elif kind is fallback.LoggedGradient:
            what = "gradient result {} of"
        else:
            continue
        for k, e in enumerate(logged.outputs):
            if e is not None and e.value is not None and \
                    e.value._datatype_enum() not in _NO_VALUE:
                found.append((order, what.format(k), logged.step, e.value, e))
    return found


def _differs(graph_value, eager_value):
    """None if the graph's value is eager's (within the tolerance, for floats), else what
    differs."""
    a, b = hooks.original_numpy(graph_value), hooks.original_numpy(eager_value)
    if np.shape(a) != np.shape(b):
        return f"shape {list(np.shape(a))} under Terra, {list(np.shape(b))} eagerly"
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype.kind in "fc":
        close = np.isclose(a, b, rtol=config.verify_rtol, atol=config.verify_atol,
                           equal_nan=True)
    else:
        close = a == b
    if np.all(close):
        return None
    i = np.unravel_index(int(np.argmin(close)), close.shape) if close.shape else ()
    where = f" at {list(map(int, i))}" if i else ""
    bound = (f" (rtol {config.verify_rtol:g}, atol {config.verify_atol:g})"
             if a.dtype.kind in "fc" else "")
    return (f"{int(np.size(close) - np.count_nonzero(close))} of {np.size(close)} element(s) "
            f"differ{bound}; first{where}: {_number(a[i])} under Terra, {_number(b[i])} "
            "eagerly")


def _number(x):
    return f"{x:.9g}" if np.asarray(x).dtype.kind in "fc" else repr(np.asarray(x).item())


def _writer(log, handle):
    """``(order, step)`` of the first logged op writing the variable behind ``handle``
    (the ops of a library call Python skipped in their order, after its place), or
    ``(len(log), None)``."""
    for index, logged in enumerate(log):
        steps = [logged.step]
        if type(logged) is fallback.LoggedSkip:
            steps += logged.steps
        for j, step in enumerate(steps):
            order = index + j / len(steps)
            if step.kind is NodeKind.OP and step.node.in_graph and \
                    step.op_type not in opdefs.READ_ONLY_VARIABLE_OPS and \
                    any(slot.kind is SlotKind.VAR and slot.tensor is handle
                        for slot in step.slots):
                return order, step
    return len(log), None


def _order(pair):
    return pair[0]
