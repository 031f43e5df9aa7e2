"""Lanes: the PythonRunner's precompiled way through an op it has matched before.

Once an op has been matched at a step by the general path (``PythonRunner.fast``: ``_expect``,
``Validation.check_attrs`` and ``inputs``, ``StandIns.specs`` and ``make``, ``_move``), later
iterations mostly issue the very same op there again. A :class:`Lane`, built from the plan
for the edge into that step, answers it with what the general path does in its common case,
and nothing else: the op type and the raw attr tuple already validated, each input checked
by a test precomputed from its slot (a stand-in of this iteration from the one producer, a
constant's memo, identity or bytes, a variable's or capture's identity), stand-ins taken
from the spares or copied from the step's dummies, the step logged and passed. Anything
else, from a Python value never validated before to a step at the path's end, is a
:data:`MISS`: nothing was done yet, and the general path handles the op, with its checks and
its messages. So a lane changes how fast an op is matched, never whether it matches.

Lanes are the runner's own table, like its other memos: the plan is only read.
"""

import numpy as np
from tensorflow.python import pywrap_tfe
from tensorflow.python.framework import ops

from terra.fallback import LoggedOp
from terra.fast_path import flatten, pack_fast
from terra.nodes import NodeKind, SlotKind
from terra.standins import Entry
from terra.validation import value_key

_EagerTensor = ops.EagerTensor
_tape_stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped

MISS = object()  # "take the general path": the lane did nothing
_NOTHING = object()  # no Python value matched yet
_IMMUTABLE = (int, float, bool, tuple)  # those value_key knows (a tuple: of scalars)

# How one input is checked (the first element of a Lane's check tuples).
_NODE = 0  # (_NODE, producer node, output): a stand-in of this iteration from that output
# (_CONST, slot, fed key or None, [the last immutable Python value matched], the value's
# shape if numeric, its bytes): the slot's constant value; a Python literal is the same
# object at every call, so its identity is enough once its value was found among the slot's
# (a list or an array may have changed)
_CONST = 1
_SAME_TENSOR = 2  # (_SAME_TENSOR, tensor id, fed key or None): that very tensor


class Lane:
    """The edge into ``step`` from a step with no other successor: what matching an op
    there needs, precomputed (``checks`` per input, ``plan`` to pack the results)."""

    __slots__ = ("step", "op_type", "n", "info", "attrs", "checks", "plan", "sources")

    def __init__(self, step, info, attrs, checks, plan, sources):
        self.step = step
        self.op_type = step.op_type
        self.info = info
        self.n = info.n_inputs
        self.attrs = attrs  # the raw fast-path attr tuple validated at this step
        self.checks = checks
        self.plan = plan
        # per output, the dummy the stand-ins copy and its spares (StandIns.sources); None where
        # the output shapes follow the input shapes (looked up per call)
        self.sources = sources


def build(runner, cur, step, info, attrs, plan):
    """The lane from ``cur`` into ``step``, whose op was just matched by the general path
    with the raw ``attrs`` (validated and remembered); False where the general path is the
    only one: a branch point or a Case Select to feed on the edge, a step Python runs or
    computes (a local one) or whose outputs are fetched, the path's end (the graph is waited
    for), inputs a lane cannot check (fed, read again, joined, from a loop's body)."""
    if cur.next != [step] or cur.puts is not None or step.kind is not NodeKind.OP or \
            step.python or step.local is not None or step.dynamic or step.value_shaped or \
            step.next == [None] or \
            runner.checks.fast_attrs.get(step) != attrs:
        return False
    checks = []
    for i, slot in enumerate(step.slots):
        kind = slot.kind
        fed = (step.node, i) if (step.node, i) in runner.reread else None
        if kind is SlotKind.NODE and len(slot.alts) == 1 and \
                not runner.step_of[slot.alts[0][0]].looped:
            checks.append((_NODE, *slot.alts[0]))
        elif kind is SlotKind.CONST:
            # a numeric constant's bytes are compared through a memoryview, without a copy
            numeric = slot.value is not None and slot.value.dtype.kind in "biufc"
            checks.append((_CONST, slot, fed, [_NOTHING],
                           slot.value.shape if numeric else None, slot.value_bytes))
        elif kind is SlotKind.VAR or kind is SlotKind.CAPTURE:
            checks.append((_SAME_TENSOR, slot.tensor._id, fed if kind is SlotKind.CAPTURE
                           else None))
        else:
            return False
    sources = None
    if not step.check_shapes:
        sources = _sources(runner.standins, step.out_specs)  # made by the general path
        if sources is None:
            return False
    return Lane(step, info, attrs, tuple(checks), plan, sources)


def follow(runner, lane, args):
    """Match the fast-path call ``args`` along ``lane``: the op's results, or :data:`MISS`
    (nothing done) where the general path must decide."""
    n = lane.n
    if args[n:] != lane.attrs:
        return MISS
    inputs = args[:n]
    flat = flatten(lane.info, inputs) if lane.info.has_list else inputs
    checks = lane.checks
    if len(flat) != len(checks):
        return MISS
    it, tensors, memo = runner.it, runner.tensors, runner.checks
    logged = []
    consts = None  # (slot, tensor id) of constants validated by value: memoized if matched
    fed = None  # (node, input) -> tensor id, for the slots reading them again
    for a, check in zip(flat, checks):
        code = check[0]
        if type(a) is not _EagerTensor:
            if code != _CONST:
                return MISS
            if a is not check[3][0]:
                if value_key(a) not in memo.known.get(id(check[1]), ()):
                    return MISS
                if type(a) in _IMMUTABLE:
                    check[3][0] = a
        elif code == _NODE:
            e = tensors.get(a._id)
            if e is None or e.iteration is not it or e.step.node is not check[1] or \
                    e.out != check[2]:
                return MISS
            a = e
        elif tensors.get(a._id) is not None:  # a stand-in where an external value is read
            return MISS
        elif code == _CONST:
            slot = check[1]
            if a._id != memo.const_ids.get(id(slot)):
                if a._datatype_enum() != slot.dtype:
                    return MISS
                v = a._numpy_internal()  # bytes: -0.0 or another NaN counts as a change
                shape = check[4]
                if shape is None:
                    if v.shape != slot.value.shape or v.tobytes() != slot.value_bytes:
                        return MISS
                elif v.shape != shape or not v.flags.c_contiguous or \
                        v.data.cast("B") != check[5]:
                    return MISS
                consts = consts or []
                consts.append((slot, a._id))
            if check[2] is not None:
                fed = fed or {}
                fed[check[2]] = a._id
        elif a._id != check[1]:
            return MISS
        elif check[2] is not None:
            fed = fed or {}
            fed[check[2]] = a._id
        logged.append(a)
    step = lane.step
    sources = lane.sources
    if sources is None:
        sources = _shaped_sources(runner, step, flat)
        if sources is None:
            return MISS
    # matched: from here on, what the general path does once its checks passed
    if consts is not None:
        for slot, tid in consts:
            memo.const_ids[id(slot)] = tid
    if fed is not None:
        it.fed.update(fed)
    # the stand-ins, as StandIns.make makes them
    device, escaping, static = runner.standins.device, it.entries, step.static
    seq = runner.seq
    visit = runner.visits.get(step, 0)
    outs, entries = [], []
    for k, (dummy, spare) in enumerate(sources):
        s = spare.pop() if spare else dummy._copy_to_device(device)
        e = Entry(runner, it, step, k, static[k], visit, seq)
        tensors[s._id] = e
        escaping.append((e, s))
        outs.append(s)
        entries.append(e)
    it.log.append(LoggedOp(step, logged, entries, _tape_stopped()))
    runner.cur = step  # and passed, as PythonRunner._move passes it
    runner.seqs[step] = seq
    runner.seq = seq + 1
    if step.has_fetch:
        runner._visit(step)
    plan = lane.plan
    return outs[0] if plan == "one" else pack_fast(plan, outs)


def _sources(standins, specs):
    """Per spec, its dummy and spares (``StandIns.sources``); None if one is missing."""
    found = [standins.sources.get(spec) for spec in specs]
    return None if None in found else found


def _shaped_sources(runner, step, flat):
    """The dummies and spares of ``step``'s outputs for the input shapes of ``flat`` (a step
    whose output shapes follow them): where a trace had these shapes or the shape function
    was asked about them before (``StandIns.specs``) and the dummies exist; else None."""
    key = tuple(a._shape_tuple() if type(a) is _EagerTensor else np.shape(a) for a in flat)
    specs = step.node.sigs.get(key)
    if specs is None:
        specs = runner.standins.inferred.get((step, key))
    return None if specs is None else _sources(runner.standins, specs)
