"""Regions the skeleton skips: a library's optimizer update (``terra.library_regions``) and a
built-in Keras layer's call (``terra.layer_regions``), matched at their ``call`` mark and
passed whole, as the PythonRunner passes a gradient call.

Passing a region is the PythonRunner's bookkeeping for each of its steps (the count of
matched steps, a Case Select taken, a fetch channel visited) without the Python that would
have issued them. A region's :class:`Skip` is worked out once per plan: where none of its
steps selects a case, fetches or ends the path, passing it is one sweep over its steps.
"""

import numpy as np
from tensorflow.python.framework import ops

from terra import path, region_lanes
from terra.divergence import Divergence, GraphFailed, OffPath
from terra.fallback import LoggedMark, LoggedSkip
from terra.lanes import MISS
from terra.nodes import FUNCTION_TOKEN, NodeKind, SlotKind

_EagerTensor = ops.EagerTensor
# input shapes (and a function's integer arguments) learned per region at most: a loop's
# ``labels[step]`` brings a new value every step, each learned in vain
MAX_LEARNED = 64


class Skip:
    """How Python passes one skippable region: its ``steps`` (to the ``return`` mark),
    whether one ``sweep`` does, its ops' joined inputs (whose producers a gradient call's
    cone asks for), which steps' outputs the call returned (a layer's: step ->
    [(output, position)]), and whether their shapes are ``fixed`` (the recorded ones, for
    the one input shape signature the traces had; else they are learned per signature)."""

    __slots__ = ("steps", "sweep", "joins", "returned", "n_returned", "by_position", "feeds",
                 "fixed", "fetched", "dynamic")

    def __init__(self, call, steps, step_of):
        self.steps = steps
        end = steps[-1]
        self.joins = [slot for s in steps for slot in s.slots
                      if slot.kind is SlotKind.NODE and len(slot.alts) > 1]
        self.returned = {}
        region = {s.node for s in steps}
        # the ops whose shapes follow data: what it returned of them is fetched (by
        # position), and they are no reason to learn
        tainted = path.data_tainted(call, steps[:-1])
        self.fetched = set()
        for position, slot in enumerate(end.slots):
            node, out = path.returned_by(slot, region)
            self.returned.setdefault(step_of[node], []).append((out, position))
            if node in tainted:
                self.fetched.add(position)
        self.n_returned = len(end.slots)
        self.by_position = [None] * self.n_returned  # position -> (step, output)
        for s, outs in self.returned.items():
            for out, position in outs:
                self.by_position[position] = (s, out)
        # the inputs of its ops Python feeds other than the call's arguments: values a
        # layer's Python computed, learned per input shapes
        args = path.argument_reads(call)
        self.feeds = [(j, k) for j, s in enumerate(steps[:-1]) for k, slot in enumerate(s.slots)
                      if slot.kind is SlotKind.FEED and (j, k) not in args]
        self.fixed = len(call.node.sigs) == 1 and not self.feeds and \
            not any(s.check_shapes and s.node not in tainted for s in steps)
        self.sweep = call.puts is None and end.next != [None] and \
            all(s.puts is None and not s.has_fetch for s in steps)
        # an op of it fetches its data-dependent shapes, which the op-by-op path puts in the
        # iteration's signature (``validation.backward_values``) and a skip passes unread
        self.dynamic = any(s.dynamic for s in steps)


class RegionSkips:
    """The PythonRunner's part for regions (a mixin: it reads the runner's iteration, plan
    and checks, and moves it along its path)."""

    def library_call(self, attrs, tensors, stopped):
        """A library region begins (``terra.library_regions``): match its ``call`` mark and,
        if the plan runs the region straight through (``path.skippable``), move past its
        ``return`` mark; the method is then not run at all. Returns whether it was skipped.
        ``stopped``: gradient recording was paused (a replay runs the ops so)."""
        it = self.it
        step = self._expect(NodeKind.MARK, "call", lambda s: s.attrs == attrs)
        if step.attrs != attrs:
            raise Divergence("library call with different arguments or optimizer settings",
                             "attribute change")
        inputs = self.checks.inputs(it, step, list(tensors), feed=False)
        skip = self._skip_of(step, path.skippable)
        if skip is None:
            it.log.append(LoggedMark(step, inputs, None))
            self._logged_move(step, None)
            return False
        it.log.append(LoggedSkip(step, inputs, skip.steps, stopped))
        try:
            self._pass(step, skip, ())
        except GraphFailed as failed:
            failed.ran = True  # the replay ran the region
            raise
        return True

    def layer_call(self, attrs, tensors, stopped, ints=None):
        """A Keras layer's call begins (``terra.layer_regions``): match its ``call`` mark (on
        ``attrs``; what the traces found it returned and read is in the mark's last two)
        and, if the plan runs the region straight through (``path.skippable_layer``) for
        these input shapes, feed the arguments its ops read, move past its ``return`` mark
        and return (the call's output template, stand-ins for the tensors it returned); the
        layer's Python is then not run at all. Returns False if it is not skipped. A call
        skipped here before, alike, takes its lane instead (``terra.region_lanes``)."""
        cur = self.cur
        lane = self.region_lanes.get(cur, False)  # False: not built yet
        if lane:  # skipped here before: its lane, if the call is alike (else MISS)
            result = lane(attrs, tensors, stopped, ints)
            if result is not MISS:
                return result
        it = self.it
        n = len(attrs)
        step = self._expect(NodeKind.MARK, "call", lambda s: s.attrs[:n] == attrs)
        if step.attrs[:2] != attrs[:2]:  # another layer: like an op reading another variable
            raise OffPath(f"expected a call of {step.attrs[0]} #{step.attrs[1]}, got one of "
                          f"{attrs[0]} #{attrs[1]}", "new producer")
        if step.attrs[:n] != attrs:
            raise Divergence("layer call with different arguments or layer settings",
                             "attribute change")
        inputs = self.checks.inputs(it, step, list(tensors), feed=False)
        skip = self._skip_of(step, path.skippable_layer)
        if skip is not None and skip.dynamic and it.signature is not None:
            if self.signed:
                # a gradient region's recorded backward values hold for the row counts its
                # traces saw (a mask's): those shapes must reach its check, so the call runs
                # op by op
                skip = None
            else:  # the signature misses the row counts: gradient results are fetched
                it.signature = None
        learned = None
        if skip is not None:
            key = tuple([t._shape_tuple() for t in tensors])
            if ints is not None:  # a TF function's: learned per shapes and integer arguments
                key = (key, ints)
                learned = self._learned.get((step, key))
            elif skip.fixed:
                learned = (key in step.node.sigs or None) and _RECORDED
            else:
                learned = self._learned.get((step, key))
        if learned is None or not learned.confirmed:
            it.log.append(LoggedMark(step, inputs, None))
            self._logged_move(step, None)
            if skip is None or skip.fixed and ints is None or \
                    self._n_learned.get(step, 0) >= MAX_LEARNED:
                return False
            return Learn(it, step, key, skip)
        fed = {(j, k): self.checks.argument(it, skip.steps[j], k, tensors[a])
               for j, k, a in step.attrs[-1]}
        for (j, k), value in learned.feeds.items():
            fed[(j, k)] = self.checks.argument(it, skip.steps[j], k, value)
        flat = [None] * skip.n_returned
        result = step.attrs[-2], flat
        logged = LoggedSkip(step, inputs, skip.steps, stopped, fed)
        it.log.append(logged)
        try:
            self._pass(step, skip, flat, learned.specs)
        except GraphFailed as failed:
            if any(x is None for x in flat) and it.log[-1] is logged:
                # what it returned was not all made when the graph failed (a fetched value):
                # the replay stops before the call, which then runs for real
                it.log.pop()
            else:
                failed.ran, failed.result = True, result  # the replay ran the region
            raise
        finally:
            logged.outputs = [self.tensors[x._id] for x in flat if x is not None]
        if lane is False:
            lane = self.region_lanes[cur] = region_lanes.build(self, cur, step, attrs, skip)
        if lane:  # the next such call takes the lane (a lane's region is fed nothing)
            specs = learned.specs
            lane.learn(key, [(s, out, specs[position] if specs else s.node.out_specs[out])
                             for position, (s, out) in enumerate(skip.by_position)])
        return result

    def learn(self, learn, template, returned):
        """A layer call ``learn`` (``layer_call``'s) ran op by op with input shapes no skip
        had specs for, and its ``return`` mark matched. If it walked its region and returned
        what the traces' calls did (``template``), note the shapes of what it ``returned``
        and the values Python fed its ops (sizes Keras computed from static shapes). A
        built-in layer's Python issues the same ops on the same values for the same input
        shapes and attributes (the per-op path validated each op with these shapes,
        constants included); once a second such call has returned and fed the same, later
        calls with these input shapes are skipped: fed those values, given stand-ins of
        those shapes."""
        skip, it = learn.skip, self.it
        n = len(skip.steps)  # its ops and the return mark: the log's last entries
        if it is not learn.it or self.cur is not skip.steps[-1] or \
                template != learn.call.attrs[-2] or len(returned) != skip.n_returned or \
                len(it.log) < n or any(logged.step is not s for logged, s in
                                       zip(it.log[-n:], skip.steps, strict=True)):
            return
        seen = Learned(tuple(None if i in skip.fetched else (t._shape_tuple(), t._datatype_enum())
                             for i, t in enumerate(returned)),
                       {(j, k): it.log[j - n].inputs[k] for j, k in skip.feeds})
        known = self._learned.get((learn.call, learn.key))
        if known is None:
            self._n_learned[learn.call] = self._n_learned.get(learn.call, 0) + 1
        # a TF function's output shapes and fed values follow from its validated ops, its
        # input shapes and its arguments, all in the key: one call shows them
        seen.confirmed = learn.call.attrs[1] == FUNCTION_TOKEN or \
            known is not None and known.same(seen)
        self._learned[(learn.call, learn.key)] = seen

    def _skip_of(self, call, skippable):
        """The region's :class:`Skip` after ``call`` (None if Python may not skip it)."""
        skip = self._skips.get(call, False)
        if skip is False:
            steps = skippable(call)
            skip = self._skips[call] = None if steps is None else \
                Skip(call, steps, self.step_of)
        return skip

    def _pass(self, call, skip, flat, specs=None):
        """Move past the matched ``call`` mark and the region ``skip`` after it, filling
        ``flat`` with stand-ins for what it returned (of ``specs``, by position, where the
        shapes are learned ones)."""
        self._move(call)
        if skip.sweep:  # what _move does, for steps that fetch, select and end nothing
            for s, outs in skip.returned.items():
                for out, position in outs:
                    flat[position] = self._returned(s, out, position, specs, skip.fetched)
            seqs, seq = self.seqs, self.seq
            for s in skip.steps:
                seqs[s] = seq
                seq += 1
            self.seq, self.cur = seq, skip.steps[-1]
        else:
            for s in skip.steps:
                if self.cur.puts is not None:
                    self._take(self.cur, 0)
                for out, position in skip.returned.get(s, ()):
                    flat[position] = self._returned(s, out, position, specs, skip.fetched)
                self._move(s)
        took, last_of = self.it.took, self.checks.last_of
        for slot in skip.joins:  # the one that ran last, as the graph selects it
            took[slot] = last_of(slot.alts)

    def _returned(self, step, out, position, specs, fetched):
        """The stand-in for output ``out`` of ``step``, returned by a skipped call at
        ``position``: the fetched value where its shape depends on data (``fetched``
        positions), else of the learned spec, else as for a skipped backward op."""
        if position in fetched:
            _, entries = self.standins.make(self.it, step, (step.out_specs[out],),
                                            self.visits.get(step, 0), self.seq, out)
            return self._fetched(entries[0])
        if specs is None:
            return self._result(step.node, out)
        outs, _ = self.standins.make(self.it, step, (specs[position],),
                                     self.visits.get(step, 0), self.seq, out)
        return outs[0]


class Learn:
    """A layer call not skipped for want of specs for its input shapes (``key``): what
    ``RegionSkips.learn`` learns them from when its ``return`` mark has matched."""

    __slots__ = ("it", "call", "key", "skip")

    def __init__(self, it, call, key, skip):
        self.it, self.call, self.key, self.skip = it, call, key, skip


class Learned:
    """What calls of a layer with one set of input shapes returned (``specs``) and fed
    their ops (``feeds``: (op, input) -> value), and whether two calls agreed."""

    __slots__ = ("specs", "feeds", "confirmed")

    def __init__(self, specs, feeds):
        self.specs, self.feeds, self.confirmed = specs, feeds, False

    def same(self, other):
        return self.specs == other.specs and self.feeds.keys() == other.feeds.keys() and all(
            type(a) is type(b) is _EagerTensor and a.dtype == b.dtype and
            np.array_equal(a._numpy_internal(), b._numpy_internal())
            for a, b in ((a, other.feeds[k]) for k, a in self.feeds.items()))


_RECORDED = Learned(None, {})  # a fixed region's: the recorded shapes, nothing to feed
_RECORDED.confirmed = True
