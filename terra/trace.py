"""Recording one iteration: the tracing phase (paper §3.2.1).

A :class:`Recorder` is installed as a TF op callback while an iteration runs eagerly. It turns
every executed op into an :class:`OpRecord` whose inputs are refs (``terra.nodes.Ref``), one
small record class per kind, told apart by type (``type(ref) is OpRef``):

- ``OpRef(index, out)``: output ``out`` of record ``index`` of this trace;
- ``VarRef(handle)``: a variable's resource handle (captured by identity in the graph);
- ``ExtRef(tensor)``: any other tensor that no recorded op produced (a batch, a converted
  Python scalar, a tensor from an earlier iteration); the TraceGraph decides whether it is a
  constant, a captured tensor or a feed;
- ``SameRef(index, k)``: the external tensor already read by input ``k`` of record
  ``index`` (the batch read by a forward op and again by its gradient is fed once).

Besides ops the trace holds *marks* (tape enter/exit/watch) and *gradient regions*: a
``NodeKind.GRAD`` record followed by the ops ``tape.gradient`` ran. The PythonRunner validates a
gradient call as one step and skips its ops, so the backward pass costs Python nothing.
Materializations (fetch points) and tensors still alive when the iteration ends (escapes) are
recorded on the producing record.

The functions after the Recorder read a finished trace for the merge (``terra.tracegraph``),
which keeps what they find on its nodes: a record's input shapes (:func:`in_shapes`), the loops
in a path (:func:`periodic_runs`), and what a gradient call's region depends on: the forward
pass it differentiates (:func:`cone_of`), whether its tape recorded that pass
(:func:`taped`), and the iteration's signature before it (:func:`observation_of`,
:func:`signature_part`, which the PythonRunner computes alike while co-executing).
"""

import traceback
import weakref
from time import thread_time as _clock  # the callback runs on the loop's thread

import numpy as np
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager.context import context as _context
from tensorflow.python.framework import dtypes

from terra import opdefs
from terra.config import config
from terra.location import Sites
from terra.nodes import (
    ONCE_CONST,
    SMALL_CONST,
    ExtRef,
    NodeKind,
    OpRef,
    SameRef,
    SlotKind,
    VarRef,
)

_RESOURCE = dtypes.resource.as_datatype_enum
SMALL_RESULT = 8  # elements: a gradient result no op computed, recorded as a value


class OpRecord:
    """One recorded step of an iteration: an op, a mark, or the head of a gradient region."""

    __slots__ = ("kind", "op_type", "attrs", "inputs", "out_specs", "location", "site",
                 "in_graph", "body_len", "results", "fetched", "escaped", "after_custom",
                 "watched", "untaped", "device")

    def __init__(self, kind, op_type, attrs, inputs, out_specs, location, in_graph=False,
                 site=None):
        self.kind = kind  # NodeKind.OP | MARK | GRAD
        self.op_type = op_type
        self.attrs = attrs
        self.inputs = inputs
        self.out_specs = out_specs  # ((shape tuple, dtype enum), ...)
        self.location = location  # the user's line (terra.location.Location)
        self.site = site  # the executed location matched on (terra.location.Site)
        self.in_graph = in_graph
        self.body_len = 0
        # grad: per source leaf None | ("t", ref) | ("is", v, i, s), each ref an OpRef (or
        # None: a part of an IndexedSlices that is None)
        self.results = None
        # grad: a custom gradient was put on the tapes earlier in the iteration
        self.after_custom = False
        # grad: the handles of the trainable variables its tape watched as it read them
        self.watched = ()
        # op: it ran with the tapes paused (``tf.stop_gradient`` pauses them): none recorded it
        self.untaped = False
        self.fetched = set()
        self.escaped = set()
        # op: the device scope it ran under ("" for none): a MirroredStrategy's replica runs
        # its step under its device's, and the graph places the op there too
        self.device = ""

    def __repr__(self):
        return f"<{self.kind} {self.op_type}>"


def spec_of(t):
    return (t._shape_tuple(), t._datatype_enum())


class TracedValue:
    """Hook-table entry for a real tensor produced during tracing: notes materializations."""

    __slots__ = ("record", "out", "ref", "original")

    def __init__(self, record, out, tensor, original):
        self.record, self.out, self.ref, self.original = record, out, weakref.ref(tensor), original

    def numpy(self, tensor):
        self.record.fetched.add(self.out)
        return self.original(tensor)


class Recorder:
    """Builds the trace of one iteration from op callbacks and tape events."""

    def __init__(self, tensors: dict, original_numpy, sites: Sites):
        self.records: list[OpRecord] = []
        self.producer: dict[int, OpRef] = {}  # EagerTensor._id -> OpRef(index, out)
        # external tensor -> its first graph-op input, as the SameRef that reads it again
        self.ext_first: dict[int, SameRef] = {}
        self.tensors = tensors  # the shared materialization-hook table
        self.original_numpy = original_numpy
        self.creates_state = False
        self.aborted = False  # the iteration raised: its trace is not merged
        self.skippable = True  # False when a gradient region cannot be skipped
        self.unskippable = None  # (the op that must run in Python, its region's head)
        self.sites = sites
        self.override = None  # replay: (location, site) of the original op
        self.region_site = None  # inside a gradient region: the site of its head
        # why the trace cannot be co-executed though recorded whole (terra.replicas: a
        # gradient call in a replica's step let another thread run), or None
        self.unservable = None
        self.region_location = None  # ... and its user's line
        self.custom_gradients = 0  # tf.custom_gradient functions run (interception._record)
        self.broken = None  # Terra's own traceback if recording failed: the trace is dropped
        # CPU seconds in the op callback (the loop's thread), and in TF's execution of the ops
        # recorded (the process's: kernels may run in TF's pools; the doors add it up; the
        # callback's time is part of it): the cost ledger's profile, in CPU time as the
        # ledger is (terra.budget)
        self.seconds = 0.0
        self.executing = 0.0

    # -- refs ---------------------------------------------------------------------------
    def ref(self, t):
        """The ref of ``t``, an input of a mark or gradient call (``record_op`` inlines it)."""
        r = self.producer.get(t._id)
        if r is not None:
            return r
        if t._datatype_enum() == _RESOURCE:
            return VarRef(t)
        return ExtRef(t)

    # -- op callback --------------------------------------------------------------------
    def _where(self):
        """(location, site) of the op, mark or gradient call being recorded now."""
        if self.override is not None:
            self.sites.note(self.override[1])
            return self.override
        if self.region_site is not None:
            # TF orders a backward pass by a hash of op ids: only the region as a whole
            # has a location (the region is matched as a whole, whatever its order)
            return self.region_location, self.region_site
        return self.sites.here()

    def record_op(self, op_type, inputs, attrs, outputs):
        op_type = opdefs.op_name(op_type)
        if op_type in opdefs.CREATION_OPS:
            self.creates_state = True
        index = len(self.records)
        in_graph = opdefs.info(op_type).in_graph
        refs = []
        firsts = {}
        producer, ext_first = self.producer, self.ext_first
        for k, t in enumerate(inputs):  # self.ref(t), inlined: the recording's hot loop
            t_id = t._id
            r = producer.get(t_id)
            if r is None:
                # an external value read before: one feed, however many ops read it
                r = ext_first.get(t_id)
                if r is None:
                    if t._datatype_enum() == _RESOURCE:
                        r = VarRef(t)
                    else:
                        r = ExtRef(t)
                        if in_graph and t_id not in firsts:
                            firsts[t_id] = SameRef(index, k)
            refs.append(r)
        # known to later ops only: an op reading one value twice (a fused BatchNorm's empty
        # mean and variance) reads it as two external inputs, never as itself
        ext_first.update(firsts)
        location, site = self._where()
        rec = OpRecord(NodeKind.OP, op_type, opdefs.normalize_attrs(op_type, attrs), refs,
                       tuple([spec_of(t) for t in outputs]), location, in_graph, site)
        rec.untaped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
        rec.device = _context().device_name or ""
        self.records.append(rec)
        tensors, original_numpy = self.tensors, self.original_numpy
        for k, t in enumerate(outputs):
            t_id = t._id
            producer[t_id] = OpRef(index, k)
            tensors[t_id] = TracedValue(rec, k, t, original_numpy)
        return rec

    def forget(self, start):
        """Drop the records from ``start`` on: variable reads made for an op call that did not
        happen (its arguments are prepared again another way)."""
        if any(rec.op_type != "ReadVariableOp" for rec in self.records[start:]):
            self.broken = f"ops other than variable reads to forget: {self.records[start:]}"
            self.aborted = True
            return
        del self.records[start:]
        producer = self.producer  # the dropped outputs are the latest entries
        while producer:
            last = next(reversed(producer))
            if producer[last].index < start:
                break
            del producer[last]

    def callback(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None or self.broken is not None:
            return  # ops added to a graph (a user tf.function being traced) are not ours
        began = _clock()
        try:
            self.record_op(op_type, inputs, attrs, outputs)
        except Exception as err:  # noqa: BLE001 - Terra's failure must not fail the user's op
            if config.strict:
                raise
            self.broken = "".join(traceback.format_exception(err, limit=-4)).rstrip()
            self.aborted = True
        self.seconds += _clock() - began

    def profile(self):
        """(seconds TF spent executing the recorded ops, ops the skeleton would issue: those
        outside gradient and library regions): the ledger's prediction of what co-executing
        this iteration would save."""
        skipped = sum(r.body_len for r in self.records if r.kind is NodeKind.GRAD)
        call = None  # the index of an open library region's ``call`` mark
        for i, r in enumerate(self.records):
            if r.kind is NodeKind.MARK and r.op_type in ("call", "return"):
                if r.op_type == "call":
                    call = i
                elif call is not None:
                    skipped += i - call - 1
                    call = None
        return self.executing - self.seconds, len(self.records) - skipped

    def swap(self, x):
        """A stand-in whose value is known -> that value (used when replaying)."""
        entry = self.tensors.get(getattr(x, "_id", None))
        value = getattr(entry, "value", None)
        return x if value is None else value

    # -- tape events --------------------------------------------------------------------
    def mark(self, what, attrs=(), tensors=()):
        location, site = self._where()
        rec = OpRecord(NodeKind.MARK, what, attrs, [self.ref(t) for t in tensors], (), location,
                       site=site)
        self.records.append(rec)
        return rec

    def begin_grad(self, attrs, tensors, watched=()):
        location, site = self._where()
        rec = OpRecord(NodeKind.GRAD, "gradient", attrs, [self.ref(t) for t in tensors], (),
                       location, site=site)
        rec.after_custom = self.custom_gradients > 0
        rec.watched = watched
        self.records.append(rec)
        self.region_site, self.region_location = site, location
        return len(self.records) - 1

    def end_grad(self, index, flat_results):
        """Close the region opened by :meth:`begin_grad`; returns False if not skippable."""
        rec = self.records[index]
        results = []
        skippable = True
        for g in flat_results:
            if g is None:
                results.append(None)
                continue
            parts = (g.values, g.indices, g.dense_shape) if hasattr(g, "indices") else (g,)
            for p in parts:
                if p is not None and p._id not in self.producer and \
                        p._num_elements() <= SMALL_RESULT:
                    self._constant_result(p)
            refs = [None if p is None else self.producer.get(p._id) for p in parts]
            if any(p is not None and (r is None or r.index <= index)
                   for p, r in zip(parts, refs)):
                skippable = False  # a result not computed inside the region
            results.append(("is", *refs) if len(parts) == 3 else ("t", refs[0]))
        rec.body_len = len(self.records) - index - 1
        self.region_site = None
        python = [r for r in self.records[index + 1:] if not r.in_graph]
        if python:  # the backward pass ran an op that must run in Python
            skippable = False
            self.unskippable = (python[0], rec)
        rec.results = results
        self.skippable &= skippable
        return skippable

    def _constant_result(self, t):
        """A gradient result that no op computed: a gradient function made it from Python
        (an embedding's ``IndexedSlices.dense_shape`` is the variable's static shape, converted
        without an op). Record it as an ``Identity`` of that external value inside the region,
        so the graph computes it like any result (a constant if every trace saw the same)."""
        self.record_op("Identity", [t], ("T", t._datatype_enum()), [t])

    # -- iteration end ------------------------------------------------------------------
    def finish(self):
        """Note which recorded outputs are still referenced (they outlive the iteration)."""
        self.sites.release()  # the frames of the last op's stack hold tensors
        for entry in self.tensors.values():
            if isinstance(entry, TracedValue) and entry.ref() is not None:
                entry.record.escaped.add(entry.out)
        for t_id in [k for k, e in self.tensors.items() if isinstance(e, TracedValue)]:
            del self.tensors[t_id]


# -- reading a finished trace (the merge) -------------------------------------------------
def in_shapes(rec, records):
    """The input shapes of ``rec``, a record of ``records``: a node's input shape signature."""
    shapes = []
    for ref in rec.inputs:
        kind = type(ref)
        if kind is SameRef:
            ref = records[ref.index].inputs[ref.k]
            kind = type(ref)
        if kind is OpRef:
            shapes.append(records[ref.index].out_specs[ref.out][0])
        else:
            shapes.append((ref.tensor if kind is ExtRef else ref.handle)._shape_tuple())
    return tuple(shapes)


def periodic_runs(keys):
    """The loops in a sequence of keys: ``[(start, period, count)]`` for each maximal run
    ``keys[start:start + count * period]`` made of ``count >= 2`` repeats of its first
    ``period`` keys, where ``period`` is the distance to the next occurrence of
    ``keys[start]``. A key is an op's type, attributes and call stack: the same key again
    means the same code issued again, which only a loop does. Runs do not overlap; an outer
    loop whose inner loop ran the same trips each time is found whole, otherwise its inner
    loops are."""
    following = [None] * len(keys)
    last = {}
    for i in range(len(keys) - 1, -1, -1):
        following[i] = last.get(keys[i])
        last[keys[i]] = i
    runs = []
    i = 0
    while i < len(keys):
        j = following[i]
        if j is None:
            i += 1
            continue
        period, count = j - i, 1
        pattern = keys[i:j]
        while keys[i + count * period:i + (count + 1) * period] == pattern:
            count += 1
        if count >= 2:
            runs.append((i, period, count))
            i += count * period
        else:
            i += 1
    return runs


# (op type, input index) of inputs that are data to every gradient function of the op's
# type: none computes a value from them in Python (a ``Shape`` reads only the shape). A tiny
# batch's labels (eight int32s) are such a value; were its values part of the signature,
# every batch would be a new one.
DATA_INPUTS = frozenset({
    ("Shape", 0), ("Size", 0), ("Rank", 0),
    ("SparseSoftmaxCrossEntropyWithLogits", 1), ("Cast", 0), ("OneHot", 0),
    ("GatherV2", 1), ("ResourceGather", 1), ("Equal", 0), ("Equal", 1), ("NotEqual", 0),
    ("NotEqual", 1), ("Less", 0), ("Less", 1), ("Greater", 0), ("Greater", 1),
})


def signature_part(t, op_type=None, index=None):
    """What an external input (input ``index`` of an ``op_type``) contributes to an
    iteration's signature: its shape, and its value if it is a tiny integer (a size, an
    index) that a gradient function may compute from, as bytes. Shapes are integers: a float
    fed every step (a noise scale, a loss read back) does not make every signature new."""
    if t._num_elements() <= ONCE_CONST and (t.dtype.is_integer or t.dtype == dtypes.bool) \
            and (op_type, index) not in DATA_INPUTS:
        return t._shape_tuple(), t._numpy_internal().tobytes()
    return t._shape_tuple(), None


def observation_of(records, i, nodes):
    """See ``TraceNode.observations``: what the gradient call at record ``i`` saw."""
    before = []
    for j in range(i):
        before += [(nodes[j], k, signature_part(ref.tensor, records[j].op_type, k))
                   for k, ref in enumerate(records[j].inputs) if type(ref) is ExtRef]
        before.append((nodes[j], None, tuple(spec[0] for spec in records[j].out_specs)))
    body = {}
    for j in range(i + 1, i + 1 + records[i].body_len):
        for k, ref in enumerate(records[j].inputs):
            if type(ref) is ExtRef and ref.tensor._num_elements() <= SMALL_CONST:
                body[(nodes[j], k)] = np.array(ref.tensor._numpy_internal())
    return before, body


def cone_of(records, i, nodes):
    """The forward pass a gradient region differentiates: for the gradient call (record
    ``i``) and every op its target was computed from, where each input came from, as
    ``{(node or None for the call, input index): (slot kind, producer node, out)}``: the
    kind ``SlotKind.NODE`` for an ``OpRef`` (``out`` an output of the producer),
    ``SlotKind.SAME`` for a ``SameRef`` (``out`` an input of it).

    The PythonRunner skips a region's ops, so it cannot see that they read what this
    iteration computed. Two iterations whose forward passes join before the gradient call
    (an if/else) reach one call node with the same inputs, but need different regions: a
    region matches only where its cone is the same, and the PythonRunner checks the cone's
    joined (phi) inputs took the recorded producer."""
    cone = {}
    seen = set()
    stack = [(None, records[i])]
    while stack:
        node, rec = stack.pop()
        for k, ref in enumerate(rec.inputs):
            kind = type(ref)
            if kind is OpRef:
                cone[(node, k)] = (SlotKind.NODE, nodes[ref.index], ref.out)
                if ref.index not in seen:
                    seen.add(ref.index)
                    stack.append((nodes[ref.index], records[ref.index]))
            elif kind is SameRef:
                cone[(node, k)] = (SlotKind.SAME, nodes[ref.index], ref.k)
    return cone


def taped(records, i):
    """Whether every forward op that links a source of the gradient call at record ``i`` to
    its target ran while the call's tape was recording: not before it was entered, not in
    another gradient region (a gradient of gradients), not after the tape exited; and no
    custom gradient (``tf.custom_gradient``) was put on the tapes before the call."""
    rec = records[i]
    if rec.after_custom:  # the tape holds a backward function the graph's ops do not have
        return False
    n_target, n_sources = rec.attrs[1], rec.attrs[2]
    sources = rec.inputs[n_target:n_target + n_sources]
    handles = {id(r.handle) for r in sources if type(r) is VarRef}
    source_ops = {r.index for r in sources if type(r) is OpRef}
    enter = max((j for j in range(i) if records[j].kind is NodeKind.MARK and
                 records[j].op_type in ("enter", "reenter") and
                 records[j].attrs == rec.attrs[0]), default=None)
    if enter is None or records[enter].op_type == "reenter":  # recorded in several blocks
        return False
    window_end = next((j for j in range(enter, i) if records[j].kind is NodeKind.MARK and
                       records[j].op_type == "exit" and records[j].attrs == rec.attrs[0]), i)
    in_body = set()
    for j in range(i):
        if records[j].kind is NodeKind.GRAD:
            in_body.update(range(j + 1, j + 1 + records[j].body_len))
    reached = []  # per record before the call: whether a source reaches it
    for j in range(i):
        reached.append(j in source_ops or any(
            type(r) is VarRef and id(r.handle) in handles or type(r) is OpRef and reached[r.index]
            for r in records[j].inputs))
    stack, seen = [r.index for r in rec.inputs[:n_target] if type(r) is OpRef], set()
    while stack:
        j = stack.pop()
        if j in seen or j in source_ops:
            continue
        seen.add(j)
        if reached[j] and (j < enter or j > window_end or j in in_body):
            return False
        stack.extend(r.index for r in records[j].inputs if type(r) is OpRef)
    return True


def resolve_result(r, rec_nodes):
    """A gradient call's result ``r`` (``OpRecord.results``: a tag, ``"t"`` or ``"is"``, and
    its parts' ``OpRef`` or None) with its refs as ``(node, out)`` (``rec_nodes``: record
    index -> node): ``TraceNode.results``."""
    if r is None:
        return None
    return (r[0],) + tuple(None if ref is None else (rec_nodes[ref.index], ref.out)
                           for ref in r[1:])
