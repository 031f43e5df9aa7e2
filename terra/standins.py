"""Stand-ins: what the PythonRunner hands Python in place of the outputs of an op it matched.

A stand-in is a real EagerTensor of the output's shape and dtype, so ``.shape``, ``.dtype``
and Keras' bookkeeping keep working while the graph computes the value: a copy (its own
``_id``) of one dummy per ``(shape, dtype)``. Its :class:`Entry` in the hook table says which
node output it stands for; Python materializing it fetches the value (section 3.7). A copy
Python has dropped is a *spare*: the sweep at an iteration's end (``terra.escapes``) gives
it back, and the next op of its spec hands it out again with a new entry instead of
copying. Where an op's output shapes vary with its input shapes, :meth:`StandIns.specs`
finds them: by the input shapes the traces had, else from the op's shape function.
"""

import mmap

import numpy as np
from tensorflow.python.dlpack.dlpack import from_dlpack
from tensorflow.python.eager import context, execute
from tensorflow.python.framework import constant_op, dtypes, errors, ops
from tensorflow.python.ops import gen_optional_ops

from terra import interception, opdefs
from terra.divergence import Divergence, IterationAborted, RaisedInPython
from terra.folding import SHAPE_OF
from terra.nodes import SMALL_CONST, SlotKind
from terra.plan import where

_EagerTensor = ops.EagerTensor


_UNTOUCHED_BYTES = 1 << 16


def _untouched(shape, dt):
    """A large dummy whose memory the process never touches: zero pages of an anonymous map,
    which TF aliases through DLPack (a constant would copy them), so it costs address space,
    not resident memory (ResNet50's 52 dummies held 40 MB). None for a small or unusual
    one (a string, a dtype numpy or DLPack lacks)."""
    if dt == dtypes.string or not dt.is_numpy_compatible:
        return None
    np_dtype = np.dtype(dt.as_numpy_dtype)
    size = int(np.prod(shape, dtype=np.int64)) * np_dtype.itemsize
    if size < _UNTOUCHED_BYTES:
        return None
    try:
        array = np.frombuffer(mmap.mmap(-1, size), dtype=np_dtype).reshape(shape)
        return from_dlpack(array.__dlpack__())
    except (BufferError, TypeError, ValueError, errors.OpError):
        return None


class Entry:
    """Hook-table entry of a tensor the PythonRunner handed to Python. ``visit``: its
    position in the step's fetch channels; ``seq``: the runner's count of matched steps when
    the step that made it was matched (a loop's body step is matched once per trip);
    ``shape``: the shape of the tensor it is the entry of, which a lane reads where asking
    the tensor (TF's handle, out of the caches by then) took 40% of a shaped lane.

    The entry a lane makes for an op of one output is also that op's record in the
    iteration's log, in place of a ``fallback.LoggedOp``: it then has the record's
    ``stopped`` and ``inputs``, and is its one output. One object per op where two were;
    the lane sets the fields inline (``terra.lanes``), a call less."""

    __slots__ = ("runner", "iteration", "step", "out", "value", "visit", "seq", "shape",
                 "stopped", "inputs")

    def __init__(self, runner, iteration, step, out, value, visit, seq, shape):
        # one statement each: a lane makes one an op, and a packed assignment costs 15% more
        self.runner = runner
        self.iteration = iteration
        self.step = step
        self.out = out
        self.value = value  # the real EagerTensor once known
        self.visit = visit
        self.seq = seq
        self.shape = shape

    @property
    def node(self):
        return self.step.node

    @property
    def outputs(self):
        """As the op's log record: its outputs, this entry."""
        return (self,)

    def numpy(self, tensor):
        """The value Python materializes: fetched from the graph, or, if co-execution must be
        left to get it, from the replay of the iteration so far."""
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
                                       f"{where(self.step)} is unavailable") from why
        return runner.original_numpy(value)


class StandIns:
    """The stand-ins of one runner's outputs: the dummies they copy and the spares (by spec),
    and the output specs inferred for input shapes no trace had (the runner's own:
    co-execution only reads the plan)."""

    def __init__(self, runner, tensors):
        self.runner = runner  # whose entries resolve the stand-ins' values
        self.tensors = tensors  # the hook table: EagerTensor._id -> Entry
        self.device = context.context().device_name or \
            "/job:localhost/replica:0/task:0/device:CPU:0"
        # (shape, dtype) -> (the tensor stand-ins of that spec copy, the copies no one holds,
        # handed out again: a list never rebound, which a lane keeps)
        self.sources = {}
        self.inferred = {}  # (step, input shapes) -> output specs from the shape function

    def make(self, it, step, specs, visit, seq, start=0):
        """Stand-ins for ``step``'s outputs ``start, start + 1, ...`` of ``specs``, with their
        hook-table entries, noted among the iteration's ``it`` (for the sweep at its end).
        Returns the stand-ins and the entries."""
        runner, tensors, sources, device = self.runner, self.tensors, self.sources, self.device
        escaping = it.entries
        outs, entries = [], []
        for k, spec in enumerate(specs, start):
            dummy, spare = sources.get(spec) or self._source(spec)
            s = spare.pop() if spare else dummy._copy_to_device(device)
            e = Entry(runner, it, step, k, step.static[k], visit, seq, spec[0])
            tensors[s._id] = e
            escaping += (e, s, spare)
            outs.append(s)
            entries.append(e)
        return outs, entries

    def local(self, it, step, flat, visit, seq):
        """The outputs of a local step (``Step.local``, ``terra.folding``) and their entries:
        its op run by Python on the values of its inputs, registered as the step's outputs.
        A shape read runs on a stand-in as it is (its shape is the graph's)."""
        tensors, shape_of = self.tensors, step.op_type in SHAPE_OF
        args = []
        for a, slot in zip(flat, step.slots, strict=True):
            if type(a) is _EagerTensor:
                e = tensors.get(a._id)
                if e is not None and not shape_of:
                    a = self.runner.value_of(e)  # a local step's, known
            else:
                a = ops.convert_to_tensor(a, None if slot.dtype is None else
                                          dtypes.as_dtype(slot.dtype))
            args.append(a)
        try:
            values = execute.quick_execute(step.op_type, len(step.out_specs), args,
                                           step.local, context.context())
        except errors.OpError as error:  # TF's error, eager's too: raised once
            raise RaisedInPython(error) from None
        escaping, entries = it.entries, []
        for k, v in enumerate(values):
            e = Entry(self.runner, it, step, k, v, visit, seq, v._shape_tuple())
            tensors[v._id] = e
            escaping += (e, v, None)
            entries.append(e)
        return values, entries

    def _source(self, spec):
        """A new spec's dummy, and its spares (none yet)."""
        shape, dtype = spec
        dt = dtypes.as_dtype(dtype)
        if dt == dtypes.variant and shape == ():
            # a variant is opaque to Python: only ops read it (tf.experimental.Optional's
            # has_value/get_value, which Keras 3's fit calls every step), and those are matched
            with interception.paused():
                dummy = gen_optional_ops.optional_none()
        elif dt in (dtypes.resource, dtypes.variant):
            raise Divergence(f"cannot stand in for a {dt.name} tensor", "unsupported")
        else:
            dummy = _untouched(shape, dt)
            if dummy is None:
                fill = b"" if dt == dtypes.string else 0
                dummy = constant_op.constant(np.full(shape, fill, dtype=dt.as_numpy_dtype))
        source = self.sources[spec] = (dummy, [])
        return source

    def specs(self, step, flat):
        """The output specs of ``step`` (one whose output shapes vary, ``check_shapes``) for
        the inputs ``flat``: those a trace had with these input shapes, else the ones its
        shape function gives. A step whose outputs are fetched (``dynamic``) keeps its
        recorded ones: Python gets the real outputs, never the stand-ins."""
        key = tuple(a._shape_tuple() if type(a) is _EagerTensor else np.shape(a) for a in flat)
        specs = None if step.value_shaped else step.node.sigs.get(key)
        if specs is None:  # inferred for these shapes (whatever the values, if constant)
            specs = self.inferred.get((step, key))
        if specs is None and step.dynamic:
            specs = step.out_specs
        elif specs is None:
            specs, values = inferred_specs(step, flat, key, self.tensors, self.inferred)
            self.inferred[(step, key) if values is None else (step, key, values)] = specs
        return specs


def inferred_specs(step, flat, key, tensors, memo):
    """Output specs for input shapes no trace had, from the op's shape function (TF's
    graph-mode shape inference), and the values they were inferred from where they can
    differ next time (None if they hold for every call with these input shapes). The op is
    built in a scratch graph on placeholders of those shapes, with the values of small
    inputs Python has (a ``Reshape``'s target shape it computed, or a local step's): where
    such a value is fed or computed, the specs are kept for it, in ``memo`` (specs by
    ``(step, key, values)``). Where the shape function leaves a dimension unknown, a
    Divergence: only a trace can tell. The scratch graph costs ~0.3 ms an op, so Python
    answers where it can: an elementwise op's shape is the broadcast of its inputs'
    (:func:`elementwise_shape`), and a reduction's follows from its axes where Python has
    them (:func:`reduction_shape`; a sum over a masked tensor meets a new row count every
    few steps): for every call where they are a constant, whatever its input's value."""
    shape = elementwise_shape(step.op_type, key)
    if shape is not None:
        return ((shape, step.out_specs[0][1]),), None
    flat = [a if type(a) is _EagerTensor else ops.convert_to_tensor(
        a, None if slot.dtype is None else dtypes.as_dtype(slot.dtype))
        for a, slot in zip(flat, step.slots, strict=True)]
    entries = [tensors.get(a._id) for a in flat]
    flat = [a if e is None or e.value is None else e.value  # a local step's value
            for a, e in zip(flat, entries, strict=True)]
    known = [(e is None or e.value is not None) and a._num_elements() <= SMALL_CONST and
             a.dtype != dtypes.resource for a, e in zip(flat, entries, strict=True)]
    always = all(slot.kind is SlotKind.CONST for slot, k in zip(step.slots, known) if k)
    values = None if always else tuple(a._numpy_internal().tobytes() if k else None
                                       for a, k in zip(flat, known))
    if values is not None and (step, key, values) in memo:
        return memo[(step, key, values)], values
    if step.op_type in opdefs.REDUCTIONS and known[1]:  # its axes: Python's
        shape = reduction_shape(step.op_type, step.attrs, key[0], flat[1]._numpy_internal())
        if shape is not None:  # else the axes are wrong: the shape function's error
            constant = step.slots[1].kind is SlotKind.CONST  # whatever the input's value
            return ((shape, step.out_specs[0][1]),), None if constant else values
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
    return specs, values


def elementwise_shape(op_type, shapes):
    """The output shape of elementwise ``op_type`` on inputs of ``shapes``; None for another
    op. Raises Divergence where the shapes do not broadcast."""
    if op_type in opdefs.SAME_SHAPE:
        return shapes[0]
    if op_type == "Select":  # no broadcast: its branches' shape, where the condition fits it
        cond, then, other = shapes
        if then == other and (cond == then or len(cond) == 1 and then[:1] == cond):
            return then
        return None  # the shape function decides (and its error)
    if op_type not in opdefs.BROADCAST:
        return None
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError as e:
        raise Divergence(f"{op_type} called with new input shapes {shapes}: {e}",
                         "shape change") from None


def reduction_shape(op_type, attrs, shape, axes):
    """The output shape of reduction ``op_type`` (``opdefs.REDUCTIONS``, ``attrs`` its
    normalized ones) on an input of ``shape`` over the array ``axes``, as its shape function
    gives it: ``shape`` without the dimensions reduced (1 in their place where
    ``keep_dims``); an axis named twice is reduced once, no axis reduces nothing. ``ArgMax``
    and ``ArgMin`` take one axis (a scalar), and give a scalar for an input of rank 0 or 1,
    whatever the axis. None where the shape function rejects the axes (out of range, or of
    another rank), for its error."""
    arg = op_type in ("ArgMax", "ArgMin")
    if axes.ndim > (0 if arg else 1):
        return None
    rank = len(shape)
    if arg and rank <= 1:
        return ()
    axes = axes.ravel().tolist()
    if not all(-rank <= a < rank for a in axes):
        return None
    reduced = {a % rank for a in axes}
    keep = not arg and dict(attrs)["keep_dims"]
    return tuple(1 if i in reduced else d for i, d in enumerate(shape)
                 if keep or i not in reduced)


def leaves(results, tensors):
    """The entries of a gradient call's flat ``results`` (tensors, IndexedSlices or None):
    what the replay gives their values."""
    return [tensors[x._id] for g in results if g is not None
            for x in ((g.values, g.indices, g.dense_shape) if hasattr(g, "indices") else (g,))
            if x is not None]


def to_indexed_slices(values, indices, dense_shape):
    from tensorflow.python.framework import indexed_slices

    return indexed_slices.IndexedSlices(values, indices, dense_shape)
