"""Region lanes: the PythonRunner's precompiled way past a region call it skipped before.

A skipped region call (``skips.RegionSkips.layer_call``: a built-in layer's, or one of TF's
functions such as a tensor's slicing) goes through the general path: the call mark matched
among the successors, its inputs validated, the shape key built, the learned specs looked
up, the log record, then the sweep over the region's steps with a stand-in for each tensor
it returned. That is ~10 us a call; ``y[1:]`` cost as much as four ops on their lanes.

Where a call was skipped with nothing but that sweep to do (the step before it has one
successor and feeds no case; the region fetches nothing, feeds no argument, joins no
input; the path goes on after it), a :class:`RegionLane` answers later calls there, as
``terra.lanes`` answers ops: the same attributes, each tensor this iteration's stand-in
from the same producer's output, input shapes (and integer arguments) the general path has
skipped the call for; then the stand-ins, the record and the move, as the general path
makes them. Anything else is :data:`MISS`, before anything was done, and the general path
decides, with its checks and messages. So a region lane changes how fast a call is
skipped, never whether it is.
"""

from tensorflow.python.framework import ops

from terra.config import config
from terra.fallback import LoggedSkip
from terra.lanes import MISS
from terra.nodes import SlotKind
from terra.standins import Entry

_EagerTensor = ops.EagerTensor


class RegionLane:
    """The call mark ``call`` after the step the lane is kept for, skipped whole:
    ``lane(attrs, tensors, stopped, ints)`` is ``layer_call``'s result, or :data:`MISS`.
    ``known``: per shape key (as ``layer_call`` makes it), per tensor the call returned, its
    step, output, (dummy, spares) and shape."""

    __slots__ = ("runner", "call", "attrs", "producers", "steps", "known", "noted",
                 "template")

    def __init__(self, runner, call, attrs, skip):
        self.runner = runner
        self.call = call
        self.attrs = attrs
        # per input: the producer's step and output its stand-in must come from
        self.producers = tuple((runner.step_of[s.alts[0][0]], s.alts[0][1]) for s in call.slots)
        self.known = {}
        # the call's and its region's steps whose pass is ever asked for, by offset from it
        self.noted = tuple((k, s) for k, s in enumerate((call, *skip.steps))
                           if s in runner.seq_read)
        self.steps = skip.steps
        self.template = call.attrs[-2]

    def learn(self, key, returned):
        """Skip calls of input shape ``key`` from now on, returning ``returned``: per
        position, the (step, output, spec) of the stand-in the general path made."""
        sources = self.runner.standins.sources
        made = [(s, out, sources.get(spec), spec[0]) for s, out, spec in returned]
        if all(source is not None for _, _, source, _ in made):
            self.known[key] = tuple(made)

    def __call__(self, attrs, tensors, stopped, ints):
        runner = self.runner
        it = runner.it
        if attrs != self.attrs or len(tensors) != len(self.producers):
            return MISS
        table = runner.tensors
        inputs = []
        for t, (producer, out) in zip(tensors, self.producers):
            e = table.get(t._id) if type(t) is _EagerTensor else None
            if e is None or e.iteration is not it or e.step is not producer or e.out != out:
                return MISS
            inputs.append(e)
        key = tuple([e.shape for e in inputs])
        if config.check and key != tuple(t._shape_tuple() for t in tensors):
            raise AssertionError("an entry has another shape than its tensor")
        returned = self.known.get(key if ints is None else (key, ints))
        if returned is None:
            return MISS
        # matched: what layer_call and _pass do once the checks passed
        seq = runner.seq
        flat, entries, handed = [], [], it.entries
        for s, out, (dummy, spare), shape in returned:  # as StandIns.make, after the move
            standin = spare.pop() if spare else dummy._copy_to_device(runner.standins.device)
            e = Entry(runner, it, s, out, s.static[out], 0, seq + 1, shape)
            table[standin._id] = e
            handed += (e, standin, spare)
            flat.append(standin)
            entries.append(e)
        seqs = runner.seqs
        for k, s in self.noted:
            seqs[s] = seq + k
        runner.seq = seq + 1 + len(self.steps)
        runner.cur = self.steps[-1]
        it.log.append(LoggedSkip(self.call, inputs, self.steps, stopped, {}, entries))
        return self.template, flat


def build(runner, cur, call, attrs, skip):
    """The lane into ``call`` (a call mark just skipped by the general path with ``attrs``)
    from ``cur``, or None where the general path has more to do than the sweep."""
    if cur.next != [call] or cur.puts is not None or call.has_fetch or not skip.sweep or \
            skip.joins or skip.fetched or skip.dynamic or call.attrs[-1] or skip.feeds:
        return None
    for slot in call.slots:
        if slot.kind is not SlotKind.NODE or len(slot.alts) != 1 or \
                runner.step_of[slot.alts[0][0]].looped:
            return None
    return RegionLane(runner, call, attrs, skip)
