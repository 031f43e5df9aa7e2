"""PythonRunner: the skeleton side of co-execution (paper §3.2.1).

The user's Python runs unchanged; each TF op it issues arrives here instead of executing.
The op is validated against the next step of the plan (op type, attrs, and for every input
its producer node and output, its variable, or its constant value, or its dtype and shape if
it is fed), external values are fed, and the op returns *stand-ins*: real EagerTensors that
share a dummy buffer. Stand-ins know only which node output they are (a hook-table entry);
when Python materializes one, the value is fetched from the graph.

Any difference raises :class:`Divergence`; the runtime then falls back (``terra.fallback``).
Ops that must not run in the graph (stateful, non-variable: random ops, iterators, py
functions) run here for real and their outputs are fed.
"""

import functools
import sys
import time
import types
import weakref

import numpy as np
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import cancellation, context
from tensorflow.python.framework import constant_op, dtypes, errors, ops
from tensorflow.python.ops import gen_optional_ops
from tensorflow.python.util import nest

from terra import functions, interception, opdefs
from terra.divergence import (
    Divergence,
    GraphFailed,
    IterationAborted,
    PathEnded,
    RanThenDiverged,
    RegionMissed,
)
from terra.fallback import (
    GradientCall,
    LoggedCustomGradient,
    LoggedGradient,
    LoggedMark,
    LoggedOp,
    LoggedPythonOp,
)
from terra.fast_path import fast_inputs, flatten, pack_fast, pack_plan
from terra.interception import ORIGINAL_FAST, ORIGINAL_SLOW
from terra.nodes import SMALL_CONST, NodeKind
from terra.plan import Step
from terra.trace import signature_part

_EagerTensor = ops.EagerTensor
_tape_stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped
_OP = NodeKind.OP


class Iteration:
    __slots__ = ("job", "log", "entries", "fed", "fetch_visits", "seq0", "took", "signature",
                 "customs")

    def __init__(self, job):
        self.job = job
        self.seq0 = 0  # the runner's step count when the iteration began
        self.took = {}  # phi slot -> the producer it read this iteration
        # tracegraph.signature_part of every value fed, in order; None if no region needs it
        self.signature = None
        self.log = []  # per matched step, for replay: fallback.Logged{Op,PythonOp,Mark,Gradient}
        # custom gradients put on the tapes (fallback.LoggedCustomGradient), replayed after
        # the steps logged before them
        self.customs = []
        self.entries = []
        self.fed = {}  # (node, input index) -> id of the external tensor validated there
        self.fetch_visits = []  # (step, visit) of the steps with fetch channels it passed

    def release(self):
        """Nothing will be replayed any more: let go of the batches, tapes and snapshot (a
        stand-in Python keeps holds its entry, and the entry this iteration)."""
        self.log = self.fed = self.customs = self.job.snapshot = None


class Entry:
    """Hook-table entry of a tensor the PythonRunner handed to Python."""

    __slots__ = ("runner", "iteration", "step", "out", "value", "visit", "seq")

    def __init__(self, runner, iteration, step, out, value=None):
        self.runner, self.iteration, self.step, self.out = runner, iteration, step, out
        self.value = value  # the real EagerTensor once known
        self.visit = runner.visits.get(step, 0)  # its position in the step's fetch channels
        self.seq = runner.seq  # the step's pass that made it (the step's seq once it moved)

    @property
    def node(self):
        return self.step.node

    def numpy(self, tensor):
        runner = self.runner
        try:
            value = runner.value_of(self)
        except IterationAborted:
            raise
        except Exception as why:  # noqa: BLE001 - a mismatch, a graph error or Terra's own
            runner.fallback(why)  # replays the iteration so far; raises the op's error if any
            value = self.value
            if value is None:
                raise IterationAborted(f"the value of {self.step.op_type} at "
                                       f"{_where(self.step)} is unavailable") from why
        return runner.original_numpy(value)


_SCALARS = (int, float, bool)


def _converts_to(a, value):
    """Whether TF's conversion of the Python value ``a`` gives the constant ``value``: in the
    constant's dtype (0.99 becomes float32 0.99), and only where TF converts exactly (a
    float never becomes an integer constant)."""
    try:
        converted = np.asarray(a, dtype=value.dtype)
    except (TypeError, ValueError, OverflowError):
        return False
    if value.dtype.kind in "iub" and not np.array_equal(converted, np.asarray(a)):
        return False
    return converted.shape == value.shape and np.array_equal(converted, value)


def _shape_ok(shape, want):
    if want is None:
        return True
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


class PythonRunner:
    def __init__(self, graph, tensors, original_numpy, watchdog, timeout, fallback, start,
                 sites):
        self.graph = graph
        self.step_of = graph.steps
        self.tensors = tensors
        self.original_numpy = original_numpy
        self.watchdog = watchdog
        self.timeout = timeout
        self.fallback = fallback  # Runtime.handle: leave co-execution because of an error
        self.start = start  # submits a job to the GraphRunner (a no-op once submitted)
        self.ctx = context.context()
        self.device = self.ctx.device_name or "/job:localhost/replica:0/task:0/device:CPU:0"
        self._dummies = {}
        self.sites = sites
        fanout = max([2] + [len(sc.cases) + 1 for sc, _ in graph.switch_cases])  # 2: Loop Cond
        self._case_index = [constant_op.constant(i, dtype=dtypes.int32) for i in range(fanout)]
        self.cur = graph.start  # the last matched step
        self.seq = 0  # steps matched so far: Step.seq says which producer of a phi ran last
        # whether a gradient region is fed backward values by the iteration's signature
        self.signed = any(s.backward_feeds for s in graph.steps.values())
        self.it = None
        self.wait_cm = cancellation.CancellationManager()
        self.stall_time = 0.0
        # What validation learned, the runner's own (the TraceGraph and the plan are only
        # read in co-execution): per const slot (by id) the tensor last validated as its
        # value and the Python scalars known to convert to it, and per step the output
        # specs inferred for input shapes no trace had.
        self._const_ids = {}
        self._scalars = {}
        self._inferred = {}
        # The runner's state per step of the plan: ``seqs``, when it last passed the step
        # (its running count ``seq``: which producer of a phi ran last); ``visits``, how many
        # iterations passed it (the position of the next value in its fetch channels); and
        # memos of the raw attr tuples validated (fast and slow path) and of how the fast
        # path packs its results.
        self.seqs = {}
        self.visits = {}
        self._fp_attrs = {}
        self._slow_attrs = {}
        self._packs = {}

    # -- iteration ----------------------------------------------------------------------
    def begin(self, it: Iteration):
        self.it = it
        it.seq0 = self.seq
        if self.signed:
            it.signature = []
        self.cur = self.graph.start

    def rewind(self):
        """The graph is kept after an abandoned iteration (a detour): empty its channels, and
        give the wait a manager that was not cancelled."""
        self.graph.rewind()
        self.visits.clear()
        self.wait_cm = cancellation.CancellationManager()
        self.cur = self.graph.start

    def at_end(self) -> bool:
        """Whether the iteration may end here: a recorded iteration ended at this step."""
        return None in self.cur.next

    def end_path(self):
        """The iteration ends here: tell the graph (if the path could also go on) and wait
        for it to finish, so a graph-side error belongs to this iteration."""
        cur = self.cur
        if len(cur.next) > 1:
            self._take(cur, cur.next.index(None))
            self.cur = _ENDED
        self._path_end()

    # -- the two doors ------------------------------------------------------------------
    def fast(self, ctx, op_type, name, args):
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
        step = self._expect(_OP, op_type, lambda s: self._fits(s, attrs, flat, True))
        if attrs != self._fp_attrs.get(step):
            self._check_attrs(step, op_type, attrs, cache=True)
        if step.python:
            real = [[self._real(x) for x in a] if type(a) in (list, tuple) else self._real(a)
                    for a in inputs]
            return self._run_python(step, flatten(info, real),
                                    ORIGINAL_FAST(ctx, op_type, name, *real, *attrs))
        plan = self._packs.get(step)
        if plan is None:
            plan = self._packs[step] = pack_plan(info, step)
        try:
            outs = self._run(step, flat)
        except GraphFailed as failed:
            if failed.ran:
                failed.result = pack_fast(plan, failed.result)
            raise
        if plan == "one":
            return outs[0]
        return pack_fast(plan, outs)

    def slow(self, op_type, num_outputs, inputs, attrs, ctx, name=None):
        op_type = opdefs.op_name(op_type)
        twin = functions.forward_of(op_type)  # a tf.function's call when no tape records
        step = self._expect(_OP, op_type, lambda s: self._fits(s, attrs, inputs, False), twin)
        if attrs != self._slow_attrs.get(step):
            self._check_attrs(step, op_type, attrs, cache=False)
        if step.python:
            real = [self._real(a) for a in inputs]
            return self._run_python(step, real,
                                    ORIGINAL_SLOW(op_type, num_outputs, real, attrs, ctx, name))
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

    # -- tape events --------------------------------------------------------------------
    def mark(self, what, attrs, tensors, extra):
        step = self._expect(NodeKind.MARK, what, lambda s: s.attrs == attrs)
        if step.attrs != attrs:
            raise Divergence(f"tape {what} with different settings", "attribute change")
        inputs = self._validate(step, list(tensors), feed=False)
        self.it.log.append(LoggedMark(step, inputs, extra))
        self._logged_move(step, None)

    def gradient(self, attrs, tensors, extra):
        """Validate a ``tape.gradient`` call and return stand-ins for its flat results."""
        step = self._expect(NodeKind.GRAD, "gradient",
                            lambda s: s.attrs == attrs and self._grad_fits(s, tensors))
        if step.attrs != attrs:
            raise Divergence("gradient call with different arguments", "attribute change")
        inputs = self._validate(step, list(tensors), feed=False)
        if not self._same_cone(step, inputs):
            raise RegionMissed("the forward pass this gradient differentiates took a path its "
                               "recorded gradients were not computed for", step.node.key,
                               "new producer")
        if step.any_path and self._unreached_source(step, inputs):
            raise Divergence("this iteration's forward pass does not reach a source the "
                           "gradient region gives a gradient for (eager gives None there)",
                           "new producer")
        values = self._backward_values(step)
        if values is False:
            raise RegionMissed("the backward pass needs values for inputs of shapes (or small "
                               "values) no trace had", step.node.key, "shape change")
        if values is not None:
            for channel, value in zip(step.backward_feeds[0], values):
                channel.put(value)
        flat = []
        for r in step.results:
            if r is None:
                flat.append(None)
            elif r[0] == "t":
                flat.append(self._result(*r[1]))
            else:
                parts = [None if p is None else self._result(*p) for p in r[1:]]
                flat.append(_indexed_slices(*parts))
        leaves = [self.tensors[x._id] for g in flat if g is not None
                  for x in ((g.values, g.indices, g.dense_shape) if hasattr(g, "indices")
                            else (g,)) if x is not None]
        tape, target, sources, output_gradients, unconnected = extra
        # the log names stand-ins by their entries: holding a stand-in would make it look
        # alive to finish() (an escape) although Python dropped it
        self.it.log.append(LoggedGradient(step, inputs, leaves, GradientCall(
            tape, self._entries_of(target), self._entries_of(sources),
            self._entries_of(output_gradients), unconnected)))
        for body_step in step.body:  # the graph fills their channels whether or not Python looks
            if body_step.has_fetch:
                self._visit(body_step)
        self._logged_move(step, flat)
        return flat

    def custom_gradient(self, op_type, outputs, inputs, backward):
        """``tf.custom_gradient`` recorded its backward function for outputs of ops already
        matched: keep it (stand-ins by their entries) for a replay."""
        it = self.it
        it.customs.append(LoggedCustomGradient(len(it.log), op_type,
                                               self._entries_of(list(outputs)),
                                               self._entries_of(list(inputs)), backward))

    def _grad_fits(self, step, tensors):
        """Whether a gradient call fits ``step``: its inputs, the forward pass its region was
        recorded for, and backward values known for this iteration's signature."""
        try:
            inputs = self._validate(step, list(tensors), feed=False)
        except Divergence:
            return False
        return self._same_cone(step, inputs) and self._backward_values(step) is not False

    def _unreached_source(self, step, inputs):
        """For a region that serves any forward path (``regions.fold``): whether a source it
        has a result for is not reached from the target through the ops this iteration ran,
        along inputs TF's gradient functions give a gradient (TF's gradient through the
        switch-cases would give zeros for it where the tape gives None)."""
        n_target, n_sources = step.attrs[1], step.attrs[2]
        tensors = self.tensors
        made_by = {}
        for entry in self.it.log:
            kind = type(entry)
            if kind is LoggedOp and entry.stopped:  # issued with recording paused
                continue
            if kind is not LoggedOp and kind is not LoggedPythonOp:  # marks, gradient calls
                continue
            logged, ins, outputs = entry.step, entry.inputs, entry.outputs
            flows = opdefs.gradient_flows(logged.op_type, logged.attrs, tuple(
                x.step.out_specs[x.out][1] if type(x) is Entry else
                x._datatype_enum() if type(x) is _EagerTensor else slot.dtype
                for x, slot in zip(ins, logged.slots, strict=True)))
            reads = [x for x, flows_to in zip(ins, flows, strict=True) if flows_to]
            for k, out in enumerate(outputs or ()):
                if dtypes.as_dtype(logged.out_specs[k][1]).is_floating:
                    out = tensors.get(out._id, out) if type(out) is _EagerTensor else out
                    made_by[id(out)] = reads
        reached, stack = set(), list(inputs[:n_target])
        while stack:
            x = stack.pop()
            if id(x) not in reached:
                reached.add(id(x))
                stack.extend(made_by.get(id(x), ()))
        return any(r is not None and id(source) not in reached for r, source in
                   zip(step.results, inputs[n_target:n_target + n_sources], strict=True))

    def _entries_of(self, structure):
        tensors = self.tensors
        return nest.map_structure(
            lambda x: tensors.get(x._id, x) if type(x) is _EagerTensor else x, structure)

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
            index = self._case_index
            for channel, k in puts[i]:
                channel.put(index[k])

    def _visit(self, step):
        """This iteration passed ``step``: its channels hold one more value, found by visit."""
        visit = self.visits.get(step, 0)
        self.it.fetch_visits.append((step, visit))
        self.visits[step] = visit + 1

    def _path_end(self):
        try:
            self._wait_job(self.it.job, self.cur)
        except GraphFailed as g:
            g.at_end = True
            raise

    # -- validation ---------------------------------------------------------------------
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
                raise Divergence(f"expected {step.op_type}, got {op_type}")
            if cur.puts is not None:
                self._take(cur, 0)
            return step
        found = [(i, s) for i, s in enumerate(nxt)
                 if s is not None and s.kind is kind and (
                     s.op_type == op_type or s.op_type == twin and not s.python)]
        if len(found) > 1:
            found = [(i, s) for i, s in found if fits(s)] or found[:1]
        if len(found) > 1:
            found = self._by_site(found)
        if not found:
            if None in nxt:
                raise PathEnded(f"{op_type} after the end of a recorded iteration")
            raise Divergence(f"new branch: {op_type} where the recorded iterations had "
                           + ", ".join(sorted({s.op_type for s in nxt if s is not None})))
        i, step = found[0]
        self._take(cur, i)
        return step

    def loop_trips_differ(self, issuing=True):
        """Why the iteration leaves the path, if a loop is the cause: the op being issued
        repeats its call stack more often than any trace did (more trips), or the recorded
        path goes on with another trip where this iteration issued something else or ended
        (``issuing=False``; fewer trips). None otherwise. Only on the way to a fallback. A
        loop rolled into a While runs any number of trips from its peeled ones on."""
        sid = self.sites.stack() if issuing else None
        n = self._issued_from(sid)
        here = [s for s in self.step_of.values()
                if s.node.site is not None and s.node.site[0] == sid]
        seen = {s.node.site[1] for s in here}
        if n and seen and n not in seen and not any(s.looped for s in here):
            return f"a loop ran {n + 1} trips, more than any trace"
        if (n in seen or not issuing) and any(
                s is not None and not s.looped and s.node.site[1] > 0 and s.node.site[0] != sid
                for s in self.cur.next):
            return "a loop ran fewer trips than the traces that went on here"
        return None

    def _by_site(self, found):
        """Successors that fit alike (one helper called from two lines): the one recorded
        at the executed location of the op being issued, if any."""
        sid = self.sites.stack()
        n = self._issued_from(sid)
        return [f for f in found if f[1].node.site == (sid, n) or
                f[1].looped and f[1].node.site[0] == sid] or found[:1]

    def _issued_from(self, sid):
        """How many steps this iteration matched at call stack ``sid``: the occurrence of
        the next one there (``terra.location.Sites``)."""
        return sum(1 for logged in self.it.log if logged.step.node.site[0] == sid)

    def _fits(self, step, attrs, flat, fast):
        """Whether an op with these attrs (None: not checked) and inputs matches ``step``;
        without side effects that matter (nothing is fed)."""
        try:
            if attrs is not None and attrs != (self._fp_attrs if fast else
                                               self._slow_attrs).get(step):
                self._check_attrs(step, step.op_type, attrs, cache=fast)
            self._validate(step, list(flat), feed=False)
        except Divergence:
            return False
        return True

    def _check_attrs(self, step, op_type, raw, cache):
        normalized = opdefs.normalize_attrs(op_type, raw)
        given = opdefs.key_attrs(normalized)
        recorded = dict(step.attrs)
        for name, value in given:
            if name in recorded and recorded[name] != value:
                raise Divergence(f"attribute {name} of {op_type} changed", "attribute change")
        if len(given) == len(normalized):  # per-call seeds are never cached
            if cache:
                self._fp_attrs[step] = raw
            else:
                self._slow_attrs[step] = raw

    def _validate(self, step, flat, feed=True):
        slots = step.slots
        if len(flat) != len(slots):
            raise Divergence(f"{step.op_type} has {len(flat)} inputs, recorded {len(slots)}",
                           "attribute change")
        it = self.it
        tensors = self.tensors
        log = []
        for i, a in enumerate(flat):
            slot = slots[i]
            kind = slot.kind
            if type(a) is _EagerTensor:
                e = tensors.get(a._id)
                if kind == "node":
                    if e is None or e.iteration is not it:
                        raise _bad(step, i, "has a new producer")
                    if e.step.looped and e.seq != self.seqs.get(e.step):
                        raise _bad(step, i, "is a value of an earlier trip of its loop")
                    alts = slot.alts
                    if len(alts) == 1:
                        if e.step.node is not alts[0][0] or e.out != alts[0][1]:
                            raise _bad(step, i, "has a new producer")
                    else:
                        if (e.step.node, e.out) not in alts or \
                                not self._ran_last(e.step, alts):
                            raise _bad(step, i, "has a new producer")
                        if feed:
                            it.took[slot] = (e.step.node, e.out)
                    log.append(e)
                    continue
                if e is not None:
                    if e.iteration is it:
                        raise _bad(step, i, "has a new producer")
                    a = self.value_of(e)
                if kind == "same":
                    last = self._last_of(slot.alts)
                    if it.fed.get(last) != a._id:
                        raise _bad(step, i, "is a different tensor")
                    if feed and len(slot.alts) > 1:
                        it.took[slot] = last
                    log.append(a)
                    continue
                if kind == "var":
                    if a._id != slot.tensor._id:
                        raise _bad(step, i, "is a different tensor")
                    log.append(a)
                    continue
                it.fed[(step.node, i)] = a._id  # for "same" slots reading it again
                if kind == "capture":
                    if a._id != slot.tensor._id:
                        raise _bad(step, i, "is a different tensor")
                elif kind == "const" and a._id == self._const_ids.get(id(slot)):
                    pass  # the very tensor validated last time (TF caches converted scalars)
                elif a._datatype_enum() != slot.dtype:
                    raise _bad(step, i, "changed dtype", "shape change")
                elif kind == "const":
                    v = a._numpy_internal()  # bytes: -0.0 or another NaN counts as a change
                    if v.shape != slot.value.shape or v.tobytes() != slot.value_bytes:
                        raise _bad(step, i, "constant value changed", "value change")
                    self._const_ids[id(slot)] = a._id
                elif kind == "feed":
                    if not _shape_ok(a._shape_tuple(), slot.shape):
                        raise _bad(step, i, "changed shape", "shape change")
                    if feed and step.feed[i] is not None:
                        step.feed[i].put(a)
                        if it.signature is not None:
                            it.signature.append(signature_part(a, step.op_type, i))
                else:
                    raise _bad(step, i, "has a new producer")
                log.append(a)
            elif kind == "const":
                scalar = type(a) in _SCALARS
                accepted = self._scalars.get(id(slot), ())
                if not (scalar and (type(a), a) in accepted):  # 1, 1.0, True differ
                    if not _converts_to(a, slot.value):
                        raise _bad(step, i, "constant value changed", "value change")
                    if scalar:
                        self._scalars.setdefault(id(slot), set()).add((type(a), a))
                log.append(a)
            elif kind == "feed":
                t = constant_op.constant(a, dtype=dtypes.as_dtype(slot.dtype))
                if not _shape_ok(t._shape_tuple(), slot.shape):
                    raise _bad(step, i, "changed shape", "shape change")
                if feed and step.feed[i] is not None:
                    step.feed[i].put(t)
                    if it.signature is not None:
                        it.signature.append(signature_part(t, step.op_type, i))
                log.append(t)
            else:
                raise _bad(step, i, f"is a Python value, recorded a {kind}")
        return log

    def _ran_last(self, producer, alts):
        """Whether ``producer`` ran after every other of ``alts`` that ran this iteration
        (a gradient's ops count as run when the gradient call was)."""
        seqs = self.seqs
        mine = seqs.get(producer.owner, -1)
        floor = self.it.seq0
        step_of = self.step_of
        for n, _ in alts:
            other = step_of[n]
            if other is not producer and floor <= seqs.get(other.owner, -1) >= mine:
                return False
        return True

    def _same_cone(self, step, inputs):
        """Whether the joined inputs of a gradient call's cone took the producers its
        region was recorded with (``inputs``: the call's validated inputs)."""
        took = self.it.took
        for slot, k, want in step.cone_phis:
            if k is None:
                got = took.get(slot)
            elif slot.kind == "node":
                got = (inputs[k].step.node, inputs[k].out)
            else:
                got = self._last_of(slot.alts)
            if got != want:
                return False
        return True

    def _backward_values(self, step):
        """The values to feed the backward ops of ``step`` this iteration: None if it needs
        none, False if no trace had this iteration's signature."""
        if step.backward_feeds is None:
            return None
        return step.backward_feeds[1].get(tuple(self.it.signature), False)

    def _last_of(self, alts):
        """The alternative whose node ran last this iteration."""
        step_of = self.step_of
        seqs = self.seqs
        return max(alts, key=lambda p: seqs.get(step_of[p[0]].owner, -1))

    # -- outputs ------------------------------------------------------------------------
    def _dummy(self, spec):
        shape, dtype = spec
        dt = dtypes.as_dtype(dtype)
        if dt == dtypes.variant and shape == ():
            # a variant is opaque to Python: only ops read it (tf.experimental.Optional's
            # has_value/get_value, which Keras 3's fit calls every step), and those are matched
            with interception.paused():
                dummy = self._dummies[spec] = gen_optional_ops.optional_none()
            return dummy
        if dt in (dtypes.resource, dtypes.variant):
            raise Divergence(f"cannot stand in for a {dt.name} tensor", "unsupported")
        fill = b"" if dt == dtypes.string else 0
        dummy = self._dummies[spec] = constant_op.constant(
            np.full(shape, fill, dtype=dt.as_numpy_dtype))
        return dummy

    def _new_outputs(self, step, specs, start=0):
        """Stand-ins for ``step``'s outputs ``start, start + 1, ...`` with their hook-table
        entries. Returns the stand-ins and the entries."""
        it, tensors, dummies, device = self.it, self.tensors, self._dummies, self.device
        escaping = it.entries
        outs, entries = [], []
        for k, spec in enumerate(specs, start):
            dummy = dummies.get(spec)
            if dummy is None:
                dummy = self._dummy(spec)
            s = dummy._copy_to_device(device)
            e = Entry(self, it, step, k, step.static[k])
            tensors[s._id] = e
            escaping.append((e, s))
            outs.append(s)
            entries.append(e)
        return outs, entries

    def _inferred_specs(self, step, flat, key):
        """Output specs for input shapes no trace had, from the op's shape function (TF's
        graph-mode shape inference), and whether they hold for every call with these input
        shapes. The op is built in a scratch graph on placeholders of those shapes, with the
        values of small inputs Python computed (a ``Reshape``'s target shape): where such a
        value is fed, it can differ next time, so the specs are not kept. Where the shape
        function leaves a dimension unknown, a Divergence: only a trace can tell."""
        flat = [a if type(a) is _EagerTensor else ops.convert_to_tensor(
            a, None if slot.dtype is None else dtypes.as_dtype(slot.dtype))
            for a, slot in zip(flat, step.slots, strict=True)]
        known = [self.tensors.get(a._id) is None and a._num_elements() <= SMALL_CONST and
                 a.dtype != dtypes.resource for a in flat]
        try:
            outputs = opdefs.scratch_output_shapes(step.op_type, step.attrs, [
                ("value", a._numpy_internal(), a.dtype, None) if k else
                ("handle", a, None, None) if a.dtype == dtypes.resource else
                ("shape", None, a.dtype, shape)
                for a, k, shape in zip(flat, known, key, strict=True)])
        except (ValueError, TypeError, errors.OpError) as e:  # the shape function rejects them
            raise Divergence(f"{step.op_type} called with new input shapes {key}: {e}",
                           "shape change") from None
        if not all(shape.is_fully_defined() for shape in outputs):
            raise Divergence(f"{step.op_type} called with new input shapes {key}, for which "
                           "its shape function gives no output shape", "shape change")
        specs = tuple((tuple(shape.as_list()), dtype)
                      for shape, (_, dtype) in zip(outputs, step.out_specs, strict=True))
        return specs, all(slot.kind == "const" for slot, k in zip(step.slots, known) if k)

    def _result(self, node, out):
        step = self.step_of[node]
        outs, entries = self._new_outputs(step, (node.out_specs[out],), out)
        if len(node.sigs) > 1 or step.dynamic:
            return self._fetched(entries[0])
        return outs[0]

    def _run(self, step, flat):
        inputs = self._validate(step, flat)
        specs = step.out_specs
        if step.check_shapes:
            key = tuple(a._shape_tuple() if type(a) is _EagerTensor else np.shape(a)
                        for a in flat)
            specs = None if step.value_shaped else step.node.sigs.get(key)
            if specs is None and not step.value_shaped:
                specs = self._inferred.get((step, key))
            if specs is None and step.dynamic:  # fetched: the stand-ins are never used
                specs = step.out_specs
            elif specs is None:
                specs, always = self._inferred_specs(step, flat, key)
                if always:
                    self._inferred[(step, key)] = specs
        outs, entries = self._new_outputs(step, specs)
        if step.dynamic:  # data-dependent shapes: the real outputs, whatever their shapes (the
            # ops that read them look their shapes up by input shapes: _downstream)
            outs = [self._fetched(e) for e in entries]
            if self.it.signature is not None:
                self.it.signature.append(tuple(o._shape_tuple() for o in outs))
        self.it.log.append(LoggedOp(step, inputs, entries, _tape_stopped()))
        self._logged_move(step, outs)
        return outs

    def _fetched(self, e):
        """Fetch an output whose shape Python must see, and hand out the real tensor in
        place of the stand-in: registered, so later ops still know its producer."""
        value = self.value_of(e)
        self.tensors[value._id] = e
        self.it.entries.append((e, value))
        return value

    def _run_python(self, step, inputs, result):
        outs = result if isinstance(result, (list, tuple)) else \
            ([] if result is None else [result])
        flat_outs = []
        for o in outs:
            flat_outs.extend(o if isinstance(o, (list, tuple)) else [o])
        self.it.log.append(LoggedPythonOp(step, inputs, flat_outs))
        self._logged_move(step, result)
        relaxed = step.node.out_relaxed
        if len(flat_outs) != len(relaxed):
            raise RanThenDiverged(f"{step.op_type} {step.node!r} returned {len(flat_outs)} "
                                  f"outputs, recorded {len(relaxed)}", result, "new op")
        for k, t in enumerate(flat_outs):
            if t._datatype_enum() != step.out_specs[k][1] or \
                    not _shape_ok(t._shape_tuple(), relaxed[k]):
                raise RanThenDiverged(f"output {k} of {step.op_type} {step.node!r} has a new "
                                      f"shape or dtype", result)
        for k, t in enumerate(flat_outs):
            e = Entry(self, self.it, step, k, value=t)
            e.seq = self.seqs[step]
            self.tensors[t._id] = e
            self.it.entries.append((e, t))
            channel = step.out_feed[k]
            if channel is not None:
                channel.put(t)
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
                f"the value of {step.op_type} at {_where(step)} is unavailable: its "
                "iteration's graph execution was cancelled or failed")
        channel = step.fetch[e.out]
        if channel is None:
            raise Divergence(f"new fetch point: value of {step.op_type} {step.node!r} "
                           f"({_where(step)})", "new fetch point")
        e.value = self._wait(lambda: channel.get_nth(e.visit, self.wait_cm), step)
        return e.value

    def _wait(self, fetch, step):
        self.start(self.it.job)  # lazy mode: the graph runs only once Python needs it
        t0 = time.perf_counter()
        self.watchdog.arm(self.wait_cm, self.timeout)
        try:
            return fetch()
        except Exception as err:  # noqa: BLE001 - cancelled dequeue: find out why
            self.watchdog.disarm()
            self.wait_cm = cancellation.CancellationManager()
            job = self.it.job
            if job is not None and job.error is not None:
                raise GraphFailed(job) from None
            if self.watchdog.fired:
                raise TimeoutError(
                    f"Terra: waited {self.timeout:.0f}s for the value of {step.op_type} "
                    f"({_where(step)}); the graph did not produce it") from err
            raise
        finally:
            self.watchdog.disarm()
            if self.watchdog.fired:  # fired after the value came: the manager is spent
                self.wait_cm = cancellation.CancellationManager()
            self.stall_time += time.perf_counter() - t0

    def _wait_job(self, job, step):
        self.start(job)
        t0 = time.perf_counter()
        finished = job.done.wait(self.timeout)
        self.stall_time += time.perf_counter() - t0
        if not finished:
            raise TimeoutError(f"Terra: waited {self.timeout:.0f}s for the graph iteration "
                               f"that computes {step.op_type} ({_where(step)})")
        if job.error is not None and not job.cancelled:
            raise GraphFailed(job)

    # -- end of iteration ---------------------------------------------------------------
    def finish(self):
        """Sweep this iteration's tensors: keep entries Python still holds (escapes) and give
        them their values. Drain the fetched values nobody read, so the unbounded channels
        do not grow. Returns the kept entries the graph gave no value."""
        it = self.it
        got = {}
        for step, visit in it.fetch_visits:
            for k, channel in enumerate(step.fetch):
                if channel is not None and channel.taken <= visit:
                    got[(step, visit, k)] = self._wait(
                        lambda c=channel, v=visit: c.get_nth(v, self.wait_cm), step)
        uncovered = []
        for e in self.sweep(it):  # Python still holds it: give it its value now
            if e.value is None:
                e.value = got.get((e.step, e.visit, e.out))
                if e.value is None:
                    uncovered.append(e)
        if not uncovered:
            it.release()
        return uncovered

    def sweep(self, it):
        """Forget the entries of ``it`` whose stand-ins Python has dropped (an entry holds
        its real value, which would otherwise live on and look like an escape to the next
        trace). Return the others; each is forgotten when Python drops its stand-in."""
        tensors = self.tensors
        held, it.entries = it.entries, []
        # the custom gradients kept for a replay hold stand-ins in their closures: those
        # references are Terra's, not Python's
        ours = _closure_refs(it.customs) if it.customs else {}
        while True:
            # A dropped stand-in can hold others (Keras 3 sets ``_keras_mask`` on tensors):
            # once it is gone they may be dropped too, so sweep until nothing more goes.
            pending, held = held, [pair for pair in held if _held(pair, tensors, ours)]
            if len(held) == len(pending):
                break
            del pending
        for _, t in held:
            weakref.finalize(t, tensors.pop, t._id, None)
        return [e for e, _ in held]


def _held(pair, tensors, ours):
    """Whether Python still holds the stand-in of an (entry, stand-in) pair (``ours``: the
    references Terra holds elsewhere, by id); if not, forget its entry."""
    e, t = pair
    if sys.getrefcount(t) <= _BASE_REFS + (e.value is t) + ours.get(id(t), 0):
        tensors.pop(t._id, None)
        return False
    return True


def _closure_refs(customs):
    """How often each tensor is referenced from the closures of the custom gradients'
    backward functions (id -> count), through functions, cells, methods, partials and plain
    containers; other objects (a Keras layer a method is bound to) are not entered."""
    counts, seen = {}, set()
    stack = [custom.backward for custom in customs]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, types.FunctionType):
            children = [*(obj.__closure__ or ()), *(obj.__defaults__ or ())]
        elif isinstance(obj, types.CellType):
            children = [obj.cell_contents] if _has_contents(obj) else []
        elif isinstance(obj, types.MethodType):
            children = [obj.__func__]
        elif isinstance(obj, functools.partial):
            children = [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, (list, tuple)):
            children = obj
        elif isinstance(obj, dict):
            children = obj.values()
        else:
            continue
        for child in children:
            if type(child) is _EagerTensor:
                counts[id(child)] = counts.get(id(child), 0) + 1
            else:
                stack.append(child)
    return counts


def _has_contents(cell):
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _bad(step, i, what, category="new producer"):
    return Divergence(f"input {i} of {step.op_type} {step.node!r} {what}", category)


def _where(step):
    loc = step.node.location
    return f"{loc.file}:{loc.line}" if loc else "unknown location"


def _indexed_slices(values, indices, dense_shape):
    from tensorflow.python.framework import indexed_slices

    return indexed_slices.IndexedSlices(values, indices, dense_shape)


# Where the runner is once an iteration has ended at a branch point: any further op is past
# the end.
_ENDED = Step(None)
_ENDED.next = [None]

# A tensor referenced only by the iteration's entry list: the pair, ``_held``'s local and
# getrefcount's argument.
_BASE_REFS = 3
