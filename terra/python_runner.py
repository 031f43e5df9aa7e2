"""PythonRunner: the skeleton side of co-execution (paper §3.2.1).

The user's Python runs unchanged; each TF op it issues arrives here instead of executing.
The op is validated against the next step of the plan (``terra.validation``), external
values are fed, and the op returns *stand-ins* (``terra.standins``): real EagerTensors that
share a dummy buffer. Stand-ins know only which node output they are (a hook-table entry);
when Python materializes one, the value is fetched from the graph (``terra.waiting``).

Any difference raises :class:`Divergence`; the runtime then falls back (``terra.fallback``).
Ops that must not run in the graph (stateful, non-variable: random ops, iterators, py
functions) run here for real and their outputs are fed.

The runner coordinates those parts and follows the plan's path from step to step (the
choices at branch points are ``terra.path``'s); at the iteration's end it keeps the
stand-ins Python still holds (``terra.escapes``).
"""

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager.core import _NotOkStatusException
from tensorflow.python.framework import constant_op, dtypes, errors, ops

from terra import commit, escapes, functions, lanes, opdefs, path
from terra.config import config
from terra.divergence import (
    Divergence,
    GraphFailed,
    IterationAborted,
    OffPath,
    PathEnded,
    RaisedInPython,
    RanThenDiverged,
)
from terra.fallback import (
    LoggedCustomGradient,
    LoggedOp,
    LoggedPythonOp,
)
from terra.fast_path import fast_inputs, flatten, pack_fast, pack_plan
from terra.interception import ORIGINAL_FAST, ORIGINAL_SLOW
from terra.nodes import NodeKind, SlotKind
from terra.plan import Step, where
from terra.skips import RegionSkips
from terra.standins import Entry, StandIns
from terra.tape_events import TapeEvents, result_shape_tables
from terra.validation import Validation, shape_ok
from terra.waiting import Waiting

_EagerTensor = ops.EagerTensor
_tape_stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped
_OP = NodeKind.OP


class Iteration:
    """What one co-executed iteration matched and handed out: what a fallback replays, and
    what the sweep at its end looks at."""

    __slots__ = ("job", "log", "entries", "fed", "fetch_visits", "seq0", "took", "signature",
                 "customs", "held")

    def __init__(self, job):
        self.job = job
        self.seq0 = 0  # the runner's step count when the iteration began
        self.took = {}  # phi slot -> the producer it read this iteration
        # trace_queries.signature_part of every value fed, in order; None if no region needs it
        self.signature = None
        self.log = []  # per matched step, for replay: fallback.Logged{Op,PythonOp,Mark,Gradient}
        # custom gradients put on the tapes (fallback.LoggedCustomGradient), replayed after
        # the steps logged before them
        self.customs = []
        # entry, stand-in and its spec's spares (None: not a copy), flat, of every tensor
        # handed to Python: three items and no tuple per tensor
        self.entries = []
        self.fed = {}  # (node, input index) -> id of the external tensor validated there
        self.fetch_visits = []  # (step, visit) of the steps with fetch channels it passed
        self.held = None  # the entries Python held when it ended, if swept before its end

    def release(self, held):
        """Nothing will be replayed any more: let go of the batches, tapes and snapshot. The
        entries Python still holds (``held``, the sweep's: a stand-in Python keeps holds its
        entry, and the entry this iteration) let go of their ops' inputs, which they hold
        where they were their ops' log records; the others go with the log."""
        for e in held:
            e.inputs = None
        self.log = self.fed = self.customs = self.held = None
        self.job.snapshot = self.job.early = None


class PythonRunner(TapeEvents, RegionSkips):
    """The handler of co-execution for one SymbolicGraph ``graph``. ``tensors``: the hook
    table; ``original_numpy``: TF's own ``_numpy``, for a stand-in's value; ``watchdog``,
    ``timeout`` and ``start`` (submits a job to the GraphRunner): for the waits;
    ``fallback``: the runtime's handler of a divergence met while materializing a stand-in;
    ``sites``: the executed locations, which tell alike successors apart."""

    def __init__(self, graph, tensors, original_numpy, watchdog, timeout, fallback, start,
                 sites):
        self.graph = graph
        self.step_of = graph.steps
        self.tensors = tensors
        self.original_numpy = original_numpy
        self.fallback = fallback  # Runtime.handle: leave co-execution because of an error
        self.sites = sites
        fanout = max([2] + [len(sc.cases) + 1 for sc, _ in graph.switch_cases])  # 2: Loop Cond
        self._case_index = [constant_op.constant(i, dtype=dtypes.int32) for i in range(fanout)]
        self.cur = graph.start  # the last matched step
        self.seq = 0  # steps matched so far: Step.seq says which producer of a phi ran last
        # whether a gradient region is fed backward values by the iteration's signature
        self.signed = any(s.backward_feeds for s in graph.steps.values())
        # per gradient step whose results' shapes are learned: signature -> shapes (tape_events)
        self.result_shapes = result_shape_tables(graph, self.signed)
        self.it = None
        # The runner's state per step of the plan (the plan is only read in co-execution):
        # ``seqs``, when it last passed the step (its running count ``seq``: which producer
        # of a phi ran last); ``visits``, how many iterations passed it (the position of the
        # next value in its fetch channels); how the fast path packs its results.
        # The steps whose pass is ever asked for: looped ones (which trip a value is of) and
        # the producers of joined inputs (which of them ran last). A lane passing any other
        # step leaves ``seqs`` alone; under TERRA_CHECK, asking for another is an error.
        self.seq_read = {s for s in graph.steps.values() if s.looped} | {
            self.step_of[n].owner for s in graph.steps.values() for slot in s.slots
            if len(slot.alts) > 1 for n, _ in slot.alts}
        self.seqs = _AskedSeqs(self.seq_read) if config.check else {}
        self.visits = {}
        self._packs = {}
        self._skips = {}  # a region's call mark -> its skips.Skip, or None (not skippable)
        # (a layer call's mark, its input shapes) -> the specs of what it returned, learned
        # where the call ran op by op with those shapes (skips.RegionSkips.learn)
        self._learned = {}
        self._n_learned = {}  # per call mark: the keys in _learned
        # (step, function name) -> whether a call mark of it follows the step (the plan's
        # answer, asked at every call of the function: function_regions.marked_here)
        self.marked = {}
        # a step -> the lanes.Lane into its one successor, or False (the general path only)
        self.lanes = {}
        # a step -> the region_lanes.RegionLane into the region call after it, or None (the
        # general path only); a step not in it has had no region call skipped after it yet
        self.region_lanes = {}
        # the inputs external values are read again from (a "same" slot's alternatives)
        self.reread = {alt for step in graph.steps.values() for slot in step.slots
                       if slot.kind is SlotKind.SAME for alt in slot.alts}
        self._took = None  # (step, seq) of the last Case Selects fed: the edge out of step
        self.checks = Validation(self.step_of, tensors, self.seqs, self.value_of)
        self.standins = StandIns(self, tensors)
        self.waiting = Waiting(start, watchdog, timeout)
        self.verifying = lambda: True  # the runtime's: verify mode replays this iteration
        self.end_here = lambda: False  # the runtime's: close the iteration, if it may end
        self.snapshots = 0  # taken at commit points

    @property
    def stall_time(self):
        """Seconds Python waited for the graph (the runtime's stats)."""
        return self.waiting.stall_time

    # -- iteration ----------------------------------------------------------------------
    def begin(self, it: Iteration):
        self.it = it
        it.seq0 = self.seq
        if self.signed or self.result_shapes:
            it.signature = []
        self.cur = self.graph.start

    def rewind(self):
        """The graph is kept after an abandoned iteration (a detour): empty its channels,
        and open again those closed to stop the job or end a wait."""
        self.graph.rewind()
        self.visits.clear()
        self.cur = self.graph.start

    def at_end(self) -> bool:
        """Whether the iteration may end here: a recorded iteration ended at this step."""
        return None in self.cur.next

    def rest_without_effects(self):
        """``path.rest_without_effects`` from the last matched step: the edges to the path's
        end if the iteration may end here, else None."""
        return path.rest_without_effects(self.cur)

    def may_end_before(self, why) -> bool:
        """Whether the op being issued, which left the path (``why``) before its step was
        matched, may end the iteration here instead of falling back: the rest of the path
        has no effects (:meth:`rest_without_effects`), and at a branch point the op matched
        none of the successors (a Case Select fed for one, or a fed input of one, would be
        read by the graph's next iteration)."""
        if len(self.cur.next) > 1 and not isinstance(why, OffPath):
            return False
        return self.rest_without_effects() is not None

    def end_path(self):
        """The iteration ends here: tell the graph (if the path could also go on, or its
        rest has no effects: :meth:`rest_without_effects`) and wait for it to finish, so a
        graph-side error belongs to this iteration."""
        cur = self.cur
        if len(cur.next) > 1 or cur.next[0] is not None:  # (else _move told the graph)
            for n, (step, i) in enumerate(self.rest_without_effects()):
                if n and step.has_fetch:  # its values, computed ahead, are taken unread
                    self._visit(step)
                # the Case Selects Python would have fed on the way (the first edge's are
                # fed already if an op matched its step, then failed a check)
                if step.puts is not None and (n or self._took != (cur, self.seq)):
                    self._take(step, i)
            self.cur = _ENDED
        self._path_end(closing=True)

    # -- the two doors ------------------------------------------------------------------
    def fast(self, ctx, op_type, name, args):
        """The general path of a fast-path op (``CoexecDoor`` tries the lane first)."""
        info = opdefs.info(op_type)
        n = info.n_inputs
        if n is None:
            raise Divergence(f"unknown op {op_type}")
        inputs = args[:n]
        for a in inputs:  # the common case: every input is already an EagerTensor
            if type(a) is not _EagerTensor:
                inputs = fast_inputs(info, inputs)  # may read variables (ops of their own)
                break
        attrs = args[n:]
        flat = flatten(info, inputs) if info.has_list else inputs
        checks = self.checks
        cur = self.cur  # the step before this op's (variable reads above are ops of their own)
        step = self._expect(_OP, op_type, lambda s: checks.fits(self.it, s, attrs, flat, True))
        if attrs != checks.fast_attrs.get(step):
            checks.check_attrs(step, op_type, attrs, True)
        if step.python:
            real = [[self._real(x) for x in a] if type(a) in (list, tuple) else self._real(a)
                    for a in inputs]
            try:
                result = ORIGINAL_FAST(ctx, op_type, name, *real, *attrs)
            except _NotOkStatusException as error:  # TF's error, eager's too
                raise RaisedInPython(error) from None
            return self._run_python(step, flatten(info, real), result)
        plan = self._packs.get(step)
        if plan is None:
            plan = self._packs[step] = pack_plan(info, step)
        try:
            outs = self._run(step, flat)
        except GraphFailed as failed:
            if failed.ran:
                failed.result = pack_fast(plan, failed.result)
            raise
        if cur not in self.lanes:  # the next time an op comes this way, it may take a lane
            self.lanes[cur] = lanes.build(self, cur, step, info, attrs, plan)
        if plan == "one":
            return outs[0]
        return pack_fast(plan, outs)

    def slow(self, op_type, num_outputs, inputs, attrs, ctx, name=None):
        op_type = opdefs.op_name(op_type)
        twin = functions.forward_of(op_type)  # a tf.function's call when no tape records
        checks = self.checks
        step = self._expect(_OP, op_type,
                            lambda s: checks.fits(self.it, s, attrs, inputs, False), twin)
        if attrs != checks.slow_attrs.get(step):
            checks.check_attrs(step, op_type, attrs, False)
        if step.python:
            real = [self._real(a) for a in inputs]
            try:
                result = ORIGINAL_SLOW(op_type, num_outputs, real, attrs, ctx, name)
            except errors.OpError as error:  # TF's error, eager's too
                raise RaisedInPython(error) from None
            return self._run_python(step, real, result)
        if step.op_type == op_type:
            return self._run(step, inputs)
        # the traced forward call, reached by its inference twin: Python gets the outputs,
        # the graph keeps the intermediates for the backward call; a replay must put the
        # backward function on the tapes as the forward call under a tape did
        tape_record = functions.tape_record(step.op_type)
        if tape_record is None:
            raise Divergence(f"{op_type}: the functions of its forward call are gone")
        outs = self._run(step, inputs)
        it = self.it
        it.customs.append(LoggedCustomGradient(len(it.log), step.op_type,
                                               self._entries_of(list(outs)),
                                               self._entries_of(list(inputs)), tape_record))
        return outs[:num_outputs]

    # -- matched ops --------------------------------------------------------------------
    def _run(self, step, flat):
        it, standins = self.it, self.standins
        inputs = self.checks.inputs(it, step, flat)
        if step.local is not None:  # Python's own: its values, no stand-ins, no fetch
            outs, entries = standins.local(it, step, flat, self.visits.get(step, 0), self.seq)
            if step.dynamic and it.signature is not None:
                it.signature.append(tuple(o._shape_tuple() for o in outs))
            it.log.append(LoggedOp(step, inputs, entries, _tape_stopped()))
            self._logged_move(step, outs)
            return outs
        specs = standins.specs(step, flat) if step.check_shapes else step.out_specs
        outs, entries = standins.make(it, step, specs, self.visits.get(step, 0), self.seq)
        if step.dynamic:  # data-dependent shapes: the real outputs, whatever their shapes (the
            # ops that read them look their shapes up by input shapes: _downstream)
            outs = [self._fetched(e) for e in entries]
            if it.signature is not None:
                it.signature.append(tuple(o._shape_tuple() for o in outs))
        it.log.append(LoggedOp(step, inputs, entries, _tape_stopped()))
        self._logged_move(step, outs)
        return outs

    def _fetched(self, e):
        """Fetch an output whose shape Python must see, and hand out the real tensor in
        place of the stand-in: registered, so later ops still know its producer."""
        value = self.value_of(e)
        e.shape = value._shape_tuple()  # a dynamic step's: not its stand-in's
        self.tensors[value._id] = e
        self.it.entries += (e, value, None)
        return value

    def _run_python(self, step, inputs, result):
        """``result``: what the op run for real returned. Log it, move on, check its outputs
        against the recorded ones and feed those the graph reads."""
        outs = result if isinstance(result, (list, tuple)) else \
            ([] if result is None else [result])
        flat_outs = []
        for o in outs:
            flat_outs.extend(o if isinstance(o, (list, tuple)) else [o])
        it = self.it
        it.log.append(LoggedPythonOp(step, inputs, flat_outs))
        self._logged_move(step, result)
        relaxed = step.node.out_relaxed
        if len(flat_outs) != len(relaxed):
            raise RanThenDiverged(f"{step.op_type} {step.node!r} returned {len(flat_outs)} "
                                  f"outputs, recorded {len(relaxed)}", result, "new op")
        for k, t in enumerate(flat_outs):
            if t._datatype_enum() != step.out_specs[k][1] or \
                    not shape_ok(t._shape_tuple(), relaxed[k]):
                raise RanThenDiverged(f"output {k} of {step.op_type} {step.node!r} has a new "
                                      f"shape or dtype", result)
        visit, seq = self.visits.get(step, 0), self.seqs[step]
        for k, t in enumerate(flat_outs):
            e = Entry(self, it, step, k, t, visit, seq, t._shape_tuple())
            self.tensors[t._id] = e
            it.entries += (e, t, None)
            channel = step.out_feed[k]
            if channel is not None:
                channel.put(t)
                if it.signature is not None and not self.signed:  # a key of result shapes
                    it.signature.append(("python", t._shape_tuple()))
        return result

    # -- values -------------------------------------------------------------------------
    def _real(self, a):
        """A stand-in's value; any other argument as it is."""
        if type(a) is not _EagerTensor:
            return a
        e = self.tensors.get(a._id)
        return a if e is None else self.value_of(e)

    def value_of(self, e: Entry):
        """The real tensor behind an entry: known, or fetched from its channel. Raises
        Divergence if the graph does not provide it (the caller falls back)."""
        if e.value is not None:
            return e.value
        step, it = e.step, e.iteration
        if it is not self.it:  # finish() gave every value of a closed iteration Python kept
            raise IterationAborted(
                f"the value of {step.op_type} at {where(step)} is unavailable: its "
                "iteration's graph execution was cancelled or failed")
        channel = step.fetch[e.out]
        if channel is None:
            raise Divergence(f"new fetch point: value of {step.op_type} {step.node!r} "
                             f"({where(step)})", "new fetch point")
        if id(channel) in self.graph.late:  # filled after the commit gate: let it write
            if self.cur.next == [None] and not self.verifying() and \
                    not escapes.holds_unfetchable(it) and self.end_here():
                # the whole path matched and no fallback can come (as at the path's end):
                # the iteration was closed, its writes let through without a snapshot, and
                # finish() gave the entries Python holds their values
                if e.value is None:
                    raise IterationAborted(f"the value of {step.op_type} at {where(step)} "
                                           "is unavailable: its iteration was left")
                return e.value
            self._commit(True)
        e.value = self.waiting.value(channel, e.visit, it.job, step)
        return e.value

    # -- following the path -------------------------------------------------------------
    def _expect(self, kind, op_type, fits, twin=None):
        """The step the next event must match. At a branch point, the successor it fits
        (``fits(step)`` tells candidates of the same type apart); the choice is sent to the
        graph as the Case Select of the switch-case that follows. ``twin``: another op type
        the step may have if the graph runs it (a ``tf.function``'s forward call, for its
        inference call: run in Python, the inference call would not be the forward one)."""
        cur = self.cur
        nxt = cur.next
        if len(nxt) == 1:
            step = nxt[0]
            if step is None:
                raise PathEnded(f"{op_type} after the end of the recorded iteration")
            if step.kind is not kind or step.op_type != op_type and (
                    step.op_type != twin or step.python):
                raise OffPath(f"expected {step.op_type}, got {op_type}")
            if cur.puts is not None:
                self._take(cur, 0)
            return step
        i, step = path.branch(nxt, kind, op_type, fits, twin, self.sites, self.it.log)
        self._take(cur, i)
        return step

    def loop_trips_differ(self, issuing=True):
        """Why the iteration leaves the path, if a loop is the cause (``path``): more trips
        than any trace where an op is being issued, or fewer (``issuing=False``: the
        iteration ended). None otherwise. Only on the way to a fallback."""
        sid = self.sites.stack() if issuing else None
        return path.loop_trips_differ(self.step_of.values(), self.cur, self.it.log, sid)

    def _move(self, step):
        """``step`` is matched. At the last step of a path wait for the graph to finish the
        iteration, so a graph-side error is raised inside the iteration that caused it."""
        self.cur = step
        self.seqs[step] = self.seq
        self.seq += 1
        if step.has_fetch:
            self._visit(step)
        if step.next[0] is None and len(step.next) == 1:
            self._take(step, 0)
            self._path_end()

    def _logged_move(self, step, result):
        """:meth:`_move` for a step already in the iteration's log. If the graph fails at this
        path's end, the replay runs the step: the caller must hand Python ``result`` (the
        stand-ins now hold the replayed values), not run the op a second time."""
        try:
            self._move(step)
        except GraphFailed as failed:
            failed.ran, failed.result = True, result
            raise

    def _take(self, step, i):
        """Python goes from ``step`` to its successor ``i``: feed the Case Selects of the
        switch-cases that edge selects in."""
        puts = step.puts
        if puts is not None:
            self._took = (step, self.seq)
            index = self._case_index
            for channel, k in puts[i]:
                channel.put(index[k])

    def _visit(self, step):
        """This iteration passed ``step``: its channels hold one more value, found by visit."""
        visit = self.visits.get(step, 0)
        self.it.fetch_visits.append((step, visit))
        self.visits[step] = visit + 1

    def _commit(self, snapshot):
        """Let a gated graph write (``terra.commit``), with a snapshot first if asked."""
        if self.graph.commit is not None and commit.send(self.graph, self.it.job, snapshot):
            self.snapshots += 1

    def _path_end(self, closing=False):
        """The path is matched (``closing``: and the iteration ends): wait for the graph (a
        gated one, ``terra.commit``, only up to its gate until the iteration ends)."""
        it = self.it
        job = it.job
        try:
            if self.graph.commit is not None and not job.committed:
                if not commit.ready(self.graph, job, self.waiting, self.cur, closing):
                    return  # an op, a read or Terra itself may still fall back
                it.held = self.sweep(it)  # finish() gives them values
                self._commit(self.verifying() or escapes.unfetchable(it.held))
            self.waiting.job(job, self.cur)
        except GraphFailed as g:
            g.at_end = True
            raise

    # -- end of iteration ---------------------------------------------------------------
    def finish(self):
        """Sweep this iteration's tensors: keep entries Python still holds (escapes) and give
        them their values, taking the fetched values nobody read so the unbounded channels do
        not grow. Returns the kept entries the graph gave no value."""
        it = self.it
        return escapes.finish(it, self.tensors, self.waiting.unread(it), it.held, pool=True)

    def sweep(self, it):
        """Forget the entries of ``it`` whose stand-ins Python has dropped; return the others
        (``escapes.sweep``), keeping the dropped stand-ins as spares."""
        return escapes.sweep(it, self.tensors, pool=True)


# Where the runner is once an iteration has ended at a branch point or before its path's end:
# any further op is past the end.
_ENDED = Step(None)
_ENDED.next = [None]


class _AskedSeqs(dict):
    """``PythonRunner.seqs`` under ``TERRA_CHECK``: asking for the pass of a step outside
    ``read`` (which lanes do not note) is a bug, not a stale answer."""

    def __init__(self, read):
        super().__init__()
        self.read = read

    def get(self, step, default=None):
        if step not in self.read:
            raise AssertionError(f"the pass of {step!r} was asked for; lanes do not note it")
        return super().get(step, default)
