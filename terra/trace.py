"""Recording one iteration: the tracing phase (paper §3.2.1).

A :class:`Recorder` is installed as a TF op callback while an iteration runs eagerly. It turns
every executed op into an :class:`OpRecord` whose inputs are :data:`Ref` tuples:

- ``("op", index, out)``: output ``out`` of record ``index`` of this trace;
- ``("var", handle)``: a variable's resource handle (captured by identity in the graph);
- ``("ext", tensor)``: any other tensor that no recorded op produced (a batch, a converted
  Python scalar, a tensor from an earlier iteration); the TraceGraph decides whether it is a
  constant, a captured tensor or a feed;
- ``("same", index, k)``: the external tensor already read by input ``k`` of record
  ``index`` (the batch read by a forward op and again by its gradient is fed once).

Besides ops the trace holds *marks* (tape enter/exit/watch) and *gradient regions*: a
``"grad"`` record followed by the ops ``tape.gradient`` ran. The PythonRunner validates a
gradient call as one step and skips its ops, so the backward pass costs Python nothing.
Materializations (fetch points) and tensors still alive when the iteration ends (escapes) are
recorded on the producing record.
"""

import traceback
import weakref

from tensorflow.python.framework import dtypes

from terra import opdefs
from terra.config import config
from terra.location import Sites, user_location

_RESOURCE = dtypes.resource.as_datatype_enum
SMALL_RESULT = 8  # elements: a gradient result no op computed, recorded as a value


class OpRecord:
    """One recorded step of an iteration: an op, a mark, or the head of a gradient region."""

    __slots__ = ("kind", "op_type", "attrs", "inputs", "out_specs", "location", "site",
                 "in_graph", "body_len", "results", "fetched", "escaped", "after_custom")

    def __init__(self, kind, op_type, attrs, inputs, out_specs, location, in_graph=False,
                 site=None):
        self.kind = kind  # "op" | "mark" | "grad"
        self.op_type = op_type
        self.attrs = attrs
        self.inputs = inputs
        self.out_specs = out_specs  # ((shape tuple, dtype enum), ...)
        self.location = location  # the user's line (terra.location.Location)
        self.site = site  # the executed location matched on (terra.location.Site)
        self.in_graph = in_graph
        self.body_len = 0
        self.results = None  # grad: per source leaf None | ("t", ref) | ("is", v, i, s)
        # grad: a custom gradient was put on the tapes earlier in the iteration
        self.after_custom = False
        self.fetched = set()
        self.escaped = set()

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
        self.producer: dict[int, tuple] = {}  # EagerTensor._id -> ("op", index, out)
        self.ext_first: dict[int, tuple] = {}  # external tensor -> its first graph-op slot
        self.tensors = tensors  # the shared materialization-hook table
        self.original_numpy = original_numpy
        self.creates_state = False
        self.aborted = False  # the iteration raised: its trace is not merged
        self.skippable = True  # False when a gradient region cannot be skipped
        self.unskippable = None  # (the op that must run in Python, its region's head)
        self.sites = sites
        self.override = None  # replay: (location, site) of the original op
        self.region_site = None  # inside a gradient region: the site of its head
        self.custom_gradients = 0  # tf.custom_gradient functions run (interception._record)
        self.broken = None  # Terra's own traceback if recording failed: the trace is dropped

    # -- refs ---------------------------------------------------------------------------
    def ref(self, t):
        r = self.producer.get(t._id)
        if r is not None:
            return r
        if t._datatype_enum() == _RESOURCE:
            return ("var", t)
        return ("ext", t)

    def _outputs(self, index, record, outputs):
        for k, t in enumerate(outputs):
            self.producer[t._id] = ("op", index, k)
            self.tensors[t._id] = TracedValue(record, k, t, self.original_numpy)

    # -- op callback --------------------------------------------------------------------
    def _where(self):
        """(location, site) of the op, mark or gradient call being recorded now."""
        if self.override is not None:
            self.sites.note(self.override[1])
            return self.override
        if self.region_site is not None:
            # TF orders a backward pass by a hash of op ids: only the region as a whole
            # has a location (the region is matched as a whole, whatever its order)
            return user_location(), self.region_site
        return user_location(), self.sites.here()

    def record_op(self, op_type, inputs, attrs, outputs):
        op_type = opdefs.op_name(op_type)
        if op_type in opdefs.CREATION_OPS:
            self.creates_state = True
        index = len(self.records)
        in_graph = opdefs.info(op_type).in_graph
        refs = []
        firsts = {}
        for k, t in enumerate(inputs):
            r = self.ref(t)
            if r[0] == "ext":
                first = self.ext_first.get(t._id)
                if first is not None:
                    r = ("same", *first)  # one feed per value, however many ops read it
                elif in_graph:
                    firsts.setdefault(t._id, (index, k))
            refs.append(r)
        # known to later ops only: an op reading one value twice (a fused BatchNorm's empty
        # mean and variance) reads it as two external inputs, never as itself
        self.ext_first.update(firsts)
        location, site = self._where()
        rec = OpRecord("op", op_type, opdefs.normalize_attrs(op_type, attrs), refs,
                       tuple(spec_of(t) for t in outputs), location, in_graph, site)
        self.records.append(rec)
        self._outputs(index, rec, outputs)
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
            if producer[last][1] < start:
                break
            del producer[last]

    def callback(self, op_type, inputs, attrs, outputs, op_name=None, graph=None):
        if graph is not None or self.broken is not None:
            return  # ops added to a graph (a user tf.function being traced) are not ours
        try:
            self.record_op(op_type, inputs, attrs, outputs)
        except Exception as err:  # noqa: BLE001 - Terra's failure must not fail the user's op
            if config.strict:
                raise
            self.broken = "".join(traceback.format_exception(err, limit=-4)).rstrip()
            self.aborted = True

    def swap(self, x):
        """A stand-in whose value is known -> that value (used when replaying)."""
        entry = self.tensors.get(getattr(x, "_id", None))
        value = getattr(entry, "value", None)
        return x if value is None else value

    # -- tape events --------------------------------------------------------------------
    def mark(self, what, attrs=(), tensors=()):
        location, site = self._where()
        rec = OpRecord("mark", what, attrs, [self.ref(t) for t in tensors], (), location,
                       site=site)
        self.records.append(rec)
        return rec

    def begin_grad(self, attrs, tensors):
        location, site = self._where()
        rec = OpRecord("grad", "gradient", attrs, [self.ref(t) for t in tensors], (), location,
                       site=site)
        rec.after_custom = self.custom_gradients > 0
        self.records.append(rec)
        self.region_site = site
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
            if any(p is not None and (r is None or r[1] <= index) for p, r in zip(parts, refs)):
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
        for entry in self.tensors.values():
            if isinstance(entry, TracedValue) and entry.ref() is not None:
                entry.record.escaped.add(entry.out)
        for t_id in [k for k, e in self.tensors.items() if isinstance(e, TracedValue)]:
            del self.tensors[t_id]
