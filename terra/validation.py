"""The checks of an op against the Step it must match (section 3.8).

Each event Python issues in co-execution is checked against its step before anything is fed
or handed out: the attrs the recording has, and each input against its slot (the producer
node and output of this iteration, the variable or capture, the constant value, or the
dtype and shape of a fed value); a gradient call also against the forward pass its region was
recorded for. A failed check raises :class:`Divergence` with the category ``terra.explain()``
groups it by. Checking the inputs also feeds the fed ones and notes which producer each
joined input took, unless it only tells a branch point's candidates apart (``feed=False``).
"""

import numpy as np
from tensorflow.python.framework import constant_op, dtypes, ops

from terra import opdefs
from terra.divergence import Divergence, RegionMissed
from terra.fallback import OP_RECORDS, LoggedPythonOp, LoggedSkip
from terra.interception import value_key
from terra.nodes import SlotKind
from terra.standins import Entry
from terra.trace_queries import signature_part

_EagerTensor = ops.EagerTensor
_SCALARS = (int, float, bool)


class Validation:
    """The checks of one runner, and what they learn: per const slot (by id) the tensor last
    validated as its value and the Python values (by :func:`value_key`) known to convert to
    it, and per step the raw attr tuples validated (fast and slow path). These are the
    runner's own tables: the TraceGraph and the plan are only read in co-execution."""

    def __init__(self, step_of, tensors, seqs, value_of):
        self.step_of = step_of  # the plan's steps by TraceNode
        self.tensors = tensors  # the hook table: EagerTensor._id -> Entry
        # the runner's: per step, its count of matched steps when it last passed the step
        # (which producer of a phi ran last)
        self.seqs = seqs
        self.value_of = value_of  # the real value behind an entry of an earlier iteration
        self.const_ids = {}
        self.known = {}  # per const slot (by id): the value_key of Python values accepted
        self.fast_attrs = {}
        self.slow_attrs = {}

    def fits(self, it, step, attrs, flat, fast):
        """Whether an op with these attrs (None: not checked) and inputs matches ``step`` in
        the iteration ``it``; without side effects that matter (nothing is fed)."""
        try:
            if attrs is not None and attrs != (self.fast_attrs if fast else
                                               self.slow_attrs).get(step):
                self.check_attrs(step, step.op_type, attrs, fast)
            self.inputs(it, step, list(flat), feed=False)
        except Divergence:
            return False
        return True

    def check_attrs(self, step, op_type, raw, fast):
        """Raise if an attr the recording has changed. ``raw``: the attrs as the door got
        them (the fast path's flat tuple if ``fast``), remembered once validated unless a
        per-call seed is among them."""
        normalized = opdefs.normalize_attrs(op_type, raw)
        given = opdefs.key_attrs(normalized)
        recorded = dict(step.attrs)
        for name, value in given:
            if name in recorded and recorded[name] != value:
                raise Divergence(f"attribute {name} of {op_type} changed", "attribute change")
        if len(given) == len(normalized):  # per-call seeds are never cached
            if fast:
                self.fast_attrs[step] = raw
            else:
                self.slow_attrs[step] = raw

    def inputs(self, it, step, flat, feed=True):
        """Check the inputs ``flat`` of an op against ``step``'s slots in the iteration
        ``it``; return them as the replay takes them (a stand-in by its entry, an earlier
        iteration's by its value). ``feed``: feed the fed ones to the graph and note which
        producer each joined input took."""
        slots = step.slots
        if len(flat) != len(slots):
            raise Divergence(f"{step.op_type} has {len(flat)} inputs, recorded {len(slots)}",
                             "attribute change")
        tensors = self.tensors
        log = []
        for i, a in enumerate(flat):
            slot = slots[i]
            if type(a) is not _EagerTensor:
                log.append(self._python_value(it, step, i, slot, a, feed))
                continue
            e = tensors.get(a._id)
            if slot.kind is not SlotKind.NODE:
                log.append(self._external(it, step, i, slot, a, e, feed))
                continue
            # the common case, kept inline: a stand-in of this iteration
            if e is None or e.iteration is not it:
                raise _bad(step, i, "has a new producer")
            if e.step.looped and e.seq != self.seqs.get(e.step):
                raise _bad(step, i, "is a value of an earlier trip of its loop")
            alts = slot.alts
            if len(alts) == 1:
                if e.step.node is not alts[0][0] or e.out != alts[0][1]:
                    raise _bad(step, i, "has a new producer")
            else:
                if (e.step.node, e.out) not in alts or not self.ran_last(it, e.step, alts):
                    raise _bad(step, i, "has a new producer")
                if feed:
                    it.took[slot] = (e.step.node, e.out)
            log.append(e)
        return log

    def argument(self, it, step, i, a):
        """Check and feed ``a``, a skipped layer call's argument that input ``i`` of its op
        ``step`` reads (``terra.layer_regions``): what Python would have fed running the op."""
        if type(a) is not _EagerTensor:
            raise _bad(step, i, "is no longer a tensor")
        return self._external(it, step, i, step.slots[i], a, self.tensors.get(a._id), True)

    def _external(self, it, step, i, slot, a, e, feed):
        """Check a tensor input of a slot other than ``node`` (``e``: its entry if it is a
        stand-in); return it, an earlier iteration's stand-in by its value."""
        kind = slot.kind
        if e is not None:
            if e.iteration is it:
                raise _bad(step, i, "has a new producer")
            a = self.value_of(e)
        if kind is SlotKind.SAME:
            last = self.last_of(slot.alts)
            if it.fed.get(last) != a._id:
                raise _bad(step, i, "is a different tensor")
            if feed and len(slot.alts) > 1:
                it.took[slot] = last
            return a
        if kind is SlotKind.VAR:
            if a._id != slot.tensor._id:
                raise _bad(step, i, "is a different tensor")
            return a
        it.fed[(step.node, i)] = a._id  # for "same" slots reading it again
        if kind is SlotKind.CAPTURE:
            if a._id != slot.tensor._id:
                raise _bad(step, i, "is a different tensor")
        elif kind is SlotKind.CONST and a._id == self.const_ids.get(id(slot)):
            pass  # the very tensor validated last time (TF caches converted scalars)
        elif a._datatype_enum() != slot.dtype:
            raise _bad(step, i, "changed dtype", "shape change")
        elif kind is SlotKind.CONST:
            v = a._numpy_internal()  # bytes: -0.0 or another NaN counts as a change
            if v.shape != slot.value.shape or v.tobytes() != slot.value_bytes:
                raise _bad(step, i, "constant value changed", "value change")
            self.const_ids[id(slot)] = a._id
        elif kind is SlotKind.FEED:
            _feed(it, step, i, slot, a, feed)
        else:
            raise _bad(step, i, "has a new producer")
        return a

    def _python_value(self, it, step, i, slot, a, feed):
        """Check a Python value (not a tensor) given for a ``const`` or ``feed`` slot; return
        it, or for a fed one the tensor fed."""
        kind = slot.kind
        if kind is SlotKind.CONST:
            key = value_key(a)
            if key is None or key not in self.known.get(id(slot), ()):
                if not _converts_to(a, slot.value):
                    raise _bad(step, i, "constant value changed", "value change")
                if key is not None:
                    self.known.setdefault(id(slot), set()).add(key)
            return a
        if kind is SlotKind.FEED:
            t = constant_op.constant(a, dtype=dtypes.as_dtype(slot.dtype))
            _feed(it, step, i, slot, t, feed)
            return t
        raise _bad(step, i, f"is a Python value, recorded a {kind}")

    def ran_last(self, it, producer, alts):
        """Whether ``producer`` ran after every other of ``alts`` that ran in the iteration
        ``it`` (a gradient's ops count as run when the gradient call was)."""
        seqs = self.seqs
        mine = seqs.get(producer.owner, -1)
        floor = it.seq0
        step_of = self.step_of
        for n, _ in alts:
            other = step_of[n]
            if other is not producer and floor <= seqs.get(other.owner, -1) >= mine:
                return False
        return True

    def last_of(self, alts):
        """The alternative whose node ran last."""
        if len(alts) == 1:
            return alts[0]
        step_of = self.step_of
        seqs = self.seqs
        return max(alts, key=lambda p: seqs.get(step_of[p[0]].owner, -1))

    def gradient_fits(self, it, step, tensors):
        """Whether a gradient call fits ``step``: its inputs, the forward pass its region was
        recorded for, and backward values known for the iteration's signature."""
        try:
            inputs = self.inputs(it, step, list(tensors), feed=False)
        except Divergence:
            return False
        return self._same_cone(it, step, inputs) and backward_values(it, step) is not False

    def gradient_call(self, it, step, inputs):
        """Check that the region of the gradient step ``step`` serves this iteration's forward
        pass (``inputs``: the call's validated inputs); return the values to feed its
        backward ops (None if none)."""
        if not self._same_cone(it, step, inputs):
            raise RegionMissed("the forward pass this gradient differentiates took a path its "
                               "recorded gradients were not computed for", step.node.key,
                               "new producer")
        if step.any_path and _unreached_source(it, step, inputs, self.tensors):
            raise Divergence("this iteration's forward pass does not reach a source the "
                             "gradient region gives a gradient for (eager gives None there)",
                             "new producer")
        values = backward_values(it, step)
        if values is False:
            raise RegionMissed("the backward pass needs values for inputs of shapes (or small "
                               "values) no trace had", step.node.key, "shape change")
        return values

    def _same_cone(self, it, step, inputs):
        """Whether the joined inputs of a gradient call's cone took the producers its
        region was recorded with (``inputs``: the call's validated inputs)."""
        took = it.took
        for slot, k, want in step.cone_phis:
            if k is None:
                got = took.get(slot)
            elif slot.kind is SlotKind.NODE:
                got = (inputs[k].step.node, inputs[k].out)
            else:
                got = self.last_of(slot.alts)
            if got != want:
                return False
        return True


def backward_values(it, step):
    """The values to feed the backward ops of ``step`` in the iteration ``it``: None if it
    needs none, False if no trace had the iteration's signature."""
    if step.backward_feeds is None:
        return None
    return step.backward_feeds[1].get(tuple(it.signature), False)


def _unreached_source(it, step, inputs, tensors):
    """For a region that serves any forward path (``regions.fold``): whether a source it
    has a result for is not reached from the target through the ops the iteration ran,
    along inputs TF's gradient functions give a gradient (TF's gradient through the
    switch-cases would give zeros for it where the tape gives None)."""
    n_target, n_sources = step.attrs[1], step.attrs[2]
    made_by, produced, kept = {}, {}, []
    for entry in it.log:
        kind = type(entry)
        if kind is LoggedSkip:
            _skipped_flows(entry, made_by, produced, kept)
            continue
        if kind in OP_RECORDS:
            if entry.stopped:  # issued with recording paused
                continue
        elif kind is not LoggedPythonOp:  # marks, gradient calls
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
                produced[(logged.node, k)] = out
    reached, stack = set(), list(inputs[:n_target])
    while stack:
        x = stack.pop()
        if id(x) not in reached:
            reached.add(id(x))
            stack.extend(made_by.get(id(x), ()))
    return any(r is not None and id(source) not in reached for r, source in
               zip(step.results, inputs[n_target:n_target + n_sources], strict=True))


def _feed(it, step, i, slot, t, feed):
    """A fed input ``i`` of ``step``: check its shape, then (if ``feed``) put it in its
    channel, noting it in the iteration's signature if a region needs it."""
    if not shape_ok(t._shape_tuple(), slot.shape):
        raise _bad(step, i, "changed shape", "shape change")
    if feed and step.feed[i] is not None:
        step.feed[i].put(t)
        if it.signature is not None:
            it.signature.append(signature_part(t, step.op_type, i))


def _converts_to(a, value):
    """Whether TF's conversion of the Python value ``a`` gives the constant ``value``: in the
    constant's dtype (0.99 becomes float32 0.99), and only where TF converts without asking
    which dtype the op wants: never a Python float into an integer constant, Python bools
    into anything but a bool constant or numbers into a bool one, or a list mixing bools
    with numbers (TF infers a dtype from its elements where the op leaves it open,
    ``tf.reshape(x, (True, 16))``, and raises); a numpy value TF casts, where the cast is
    exact. Anything else is another constant: the op falls back and runs as eager runs it."""
    try:
        source = np.asarray(a)
        converted = np.asarray(a, dtype=value.dtype)
    except (TypeError, ValueError, OverflowError):
        return False
    kind = value.dtype.kind
    # numpy's values TF casts, Python's not; an empty list or tuple (float64, numpy says)
    # has no elements of any type
    if source.size and not isinstance(a, (np.ndarray, np.generic)):
        bools = source.dtype.kind == "b"  # all bools, or bools among numbers
        if source.dtype.kind in "fc" and kind in "iu" or (kind == "b") != bools or \
                not bools and (type(a) is bool or _has_bool(a)):
            return False
    if kind in "iub" and not np.array_equal(converted, source):
        return False
    if type(a) in _SCALARS:  # as TF's cache of converted scalars has them: 0.0 is -0.0
        return converted.shape == value.shape and np.array_equal(converted, value)
    # by bytes: -0.0 is another constant than 0.0 (1 / x tells them apart)
    return converted.shape == value.shape and converted.tobytes() == value.tobytes()


def _has_bool(a):
    """Whether the list or tuple ``a`` (nested too) holds a Python or numpy bool."""
    if type(a) is not list and type(a) is not tuple:
        return False
    return any(type(x) is bool or type(x) is np.bool_ or _has_bool(x) for x in a)


def shape_ok(shape, want):
    """Whether ``shape`` fits the relaxed shape ``want`` (None: any; a None dimension: any)."""
    if want is None:
        return True
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def _bad(step, i, what, category="new producer"):
    return Divergence(f"input {i} of {step.op_type} {step.node!r} {what}", category)


def _skipped_flows(logged, made_by, produced, kept):
    """Add what the ops of a skipped layer call (``logged``, a ``LoggedSkip``) read to
    ``made_by``, as :func:`_unreached_source` does for ops Python ran: their values are
    stood for by placeholders (kept alive in ``kept``: ``made_by`` is keyed by ``id``), the
    stand-ins the call returned by theirs. An input whose value is not known here flows to
    nothing: a source then looks unreached, which only costs a fallback."""
    if logged.stopped:
        return
    local = {}
    for j, s in enumerate(logged.steps[:-1]):
        ins = []
        for k, slot in enumerate(s.slots):
            if (j, k) in logged.fed:
                ins.append(logged.fed[(j, k)])
            elif slot.kind is SlotKind.NODE:  # of a joined input's producers, the one that ran
                ins.append(next((local.get(a, produced.get(a)) for a in slot.alts
                                 if a in local or a in produced), None))
            elif slot.kind is SlotKind.VAR:
                ins.append(slot.tensor)
            else:
                ins.append(None)
        flows = opdefs.gradient_flows(s.op_type, s.attrs, tuple(
            _node_dtype(*slot.alts[0]) if slot.kind is SlotKind.NODE else
            slot.tensor._datatype_enum() if slot.kind is SlotKind.VAR else slot.dtype
            for slot in s.slots))
        reads = [x for x, flows_to in zip(ins, flows, strict=True) if flows_to and x is not None]
        for k, (_, dtype) in enumerate(s.out_specs):
            if dtypes.as_dtype(dtype).is_floating:
                value = local[(s.node, k)] = _Value()
                kept.append(value)
                made_by[id(value)] = reads
    for e in logged.outputs:
        value = local.get((e.step.node, e.out))
        if value is not None:
            made_by[id(e)] = [value]
            produced[(e.step.node, e.out)] = e


def _node_dtype(node, out):
    return node.out_specs[out][1]


class _Value:
    """A placeholder for a value a skipped op computed (:func:`_skipped_flows`)."""

    __slots__ = ()
