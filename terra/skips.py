"""Regions the skeleton skips: a library's optimizer update (``terra.library_regions``) and a
built-in Keras layer's call (``terra.layer_regions``), matched at their ``call`` mark and
passed whole, as the PythonRunner passes a gradient call.

Passing a region is the PythonRunner's bookkeeping for each of its steps (the count of
matched steps, a Case Select taken, a fetch channel visited) without the Python that would
have issued them. A region's :class:`Skip` is worked out once per plan: where none of its
steps selects a case, fetches or ends the path, passing it is one sweep over its steps.
"""

from terra import path
from terra.divergence import Divergence, GraphFailed, OffPath
from terra.fallback import LoggedMark, LoggedSkip
from terra.nodes import NodeKind, SlotKind


class Skip:
    """How Python passes one skippable region: its ``steps`` (to the ``return`` mark),
    whether one ``sweep`` does, its ops' joined inputs (whose producers a gradient call's
    cone asks for), and which steps' outputs the call returned (a layer's: step ->
    [(output, position)])."""

    __slots__ = ("steps", "sweep", "joins", "returned", "n_returned")

    def __init__(self, call, steps, step_of):
        self.steps = steps
        end = steps[-1]
        self.joins = [slot for s in steps for slot in s.slots
                      if slot.kind is SlotKind.NODE and len(slot.alts) > 1]
        self.returned = {}
        region = {s.node for s in steps}
        for position, slot in enumerate(end.slots):
            node, out = path.returned_by(slot, region)
            self.returned.setdefault(step_of[node], []).append((out, position))
        self.n_returned = len(end.slots)
        self.sweep = call.puts is None and end.next != [None] and \
            all(s.puts is None and not s.has_fetch for s in steps)


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

    def layer_call(self, attrs, tensors, stopped):
        """A Keras layer's call begins (``terra.layer_regions``): match its ``call`` mark (on
        ``attrs``; what the traces found it returned and read is in the mark's last two)
        and, if the plan runs the region straight through (``path.skippable_layer``) for
        these input shapes, feed the arguments its ops read, move past its ``return`` mark
        and return (the call's output template, stand-ins for the tensors it returned); the
        layer's Python is then not run at all. Returns False if it is not skipped."""
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
        if skip is None or tuple(t._shape_tuple() for t in tensors) not in step.node.sigs:
            it.log.append(LoggedMark(step, inputs, None))
            self._logged_move(step, None)
            return False
        fed = {(j, k): self.checks.argument(it, skip.steps[j], k, tensors[a])
               for j, k, a in step.attrs[-1]}
        flat = [None] * skip.n_returned
        result = step.attrs[-2], flat
        logged = LoggedSkip(step, inputs, skip.steps, stopped, fed)
        it.log.append(logged)
        try:
            self._pass(step, skip, flat)
        except GraphFailed as failed:
            failed.ran, failed.result = True, result  # the replay ran the region
            raise
        finally:
            logged.outputs = [self.tensors[x._id] for x in flat if x is not None]
        return result

    def _skip_of(self, call, skippable):
        """The region's :class:`Skip` after ``call`` (None if Python may not skip it)."""
        skip = self._skips.get(call, False)
        if skip is False:
            steps = skippable(call)
            skip = self._skips[call] = None if steps is None else Skip(call, steps, self.step_of)
        return skip

    def _pass(self, call, skip, flat):
        """Move past the matched ``call`` mark and the region ``skip`` after it, filling
        ``flat`` with stand-ins for what it returned."""
        self._move(call)
        if skip.sweep:  # what _move does, for steps that fetch, select and end nothing
            for s, outs in skip.returned.items():
                for out, position in outs:
                    flat[position] = self._result(s.node, out)
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
                    flat[position] = self._result(s.node, out)
                self._move(s)
        took, last_of = self.it.took, self.checks.last_of
        for slot in skip.joins:  # the one that ran last, as the graph selects it
            took[slot] = last_of(slot.alts)
