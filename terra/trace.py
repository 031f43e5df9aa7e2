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

What the merge reads from a finished trace is in ``terra.trace_queries``.
"""

import traceback
import weakref
from time import thread_time as _clock  # the callback runs on the loop's thread

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager.context import context as _context
from tensorflow.python.framework import dtypes

from terra import opdefs
from terra.config import config
from terra.location import Sites
from terra.nodes import (
    ExtRef,
    NodeKind,
    OpRef,
    SameRef,
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
