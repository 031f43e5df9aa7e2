"""The TraceGraph's pieces (paper §3.2.2): its nodes, and the slots that say where each input
of a node comes from. The TraceGraph (``terra.tracegraph``) makes them and links them; the
generation passes read them, and transform copies of them. Also the kinds a trace shares with
them: ``NodeKind``, and the refs a record's inputs are (``OpRef``, ``VarRef``, ``ExtRef``,
``SameRef``), which a slot matches.

External inputs are classified over all observations, so the graph can treat them cheaply and
the PythonRunner can validate them soundly (:meth:`Slot.observe`):

- ``const``: a small tensor with the same value every time -> a graph constant, validated
  by value;
- ``capture``: the very same tensor object every time (checked over >= 2 traces) -> captured
  by identity like a variable;
- a value seen in one trace only is a ``const`` if it is tiny (``ONCE_CONST``), else a ``feed``;
- ``feed``: anything else -> an Input Feeding queue; its dtype is validated and its shape
  is validated against the shapes seen (a varying dimension is relaxed in the graph).

A constant that varied at one node varies at every node of its line (the TraceGraph's
``varying``): one Python expression computes them all (SDPoint's resize size, after whichever
block it down-samples), so they are fed too (:meth:`Slot.vary`).
"""

import enum
import math
from typing import TYPE_CHECKING

import numpy as np
from tensorflow.python.framework import dtypes

from terra import opdefs

if TYPE_CHECKING:  # for annotations only: ``terra.trace`` imports this module's constants
    from terra.trace import OpRecord

SMALL_CONST = 64  # elements; larger external tensors are always fed
# A value seen once cannot be told constant from varying. Guess by size: up to this many
# elements (scalars, shapes, strides, axes) it is taken for a constant, anything larger (a
# label batch) is fed. A wrong guess costs a fallback, or a feed of a value that never changes.
ONCE_CONST = 8
_INTEGERS = frozenset(d.as_datatype_enum for d in (dtypes.int32, dtypes.int64))


def relax(shape, new):
    """The most specific shape (None: unknown dim or rank) that both shapes satisfy."""
    if shape == new:
        return shape
    if shape is None or new is None or len(shape) != len(new):
        return None
    return tuple(a if a == b else None for a, b in zip(shape, new))


def relax_feeds(nodes):
    """Relax the fed inputs of ``nodes`` whose shape held still in a program whose inputs
    change shape: the dimensions whose size no varying input has as a fixed dimension.

    Where some fed input's shape varied between traces (an image of another size, a batch of
    another length), a value computed in Python per iteration (anchors over the image's
    feature map, a mask over the tokens) may have kept its shape in the traces by chance (two
    image sizes with the same area). A fixed dimension there costs a fallback, a trace and a
    second graph at the first size no trace had; an unknown one costs a little static shape
    information. A size the varying inputs keep fixed (the batch, the channels) is taken for
    that same quantity and kept, and so are sizes 0 and 1 (a batch of one, a kept dimension)
    and the length of a small integer vector (a shape, a size: its length is a rank).
    Relaxed as an observation would (:func:`relax`): validation and the graph follow it."""
    feeds = [s for n in nodes for s in n.inputs if s.kind is SlotKind.FEED and
             not small_int_feed(s)]
    varied = [s.shape or () for s in feeds if s.shape is None or None in s.shape]
    if not varied:
        return
    kept = {d for shape in varied for d in shape if d is not None} | {0, 1}
    for slot in feeds:
        if slot.shape and None not in slot.shape:
            slot.shape = tuple(d if d in kept else None for d in slot.shape)


def small_int_feed(slot):
    """Whether ``slot`` is fed a small integer tensor from Python (a size, a shape)."""
    return slot.kind is SlotKind.FEED and slot.dtype in _INTEGERS and slot.shape is not None \
        and None not in slot.shape and math.prod(slot.shape) <= SMALL_CONST


class NodeKind(enum.Enum):
    START = "start"
    END = "end"
    OP = "op"  # a TF op; ``in_graph`` says whether the graph or the PythonRunner runs it
    MARK = "mark"  # tape enter / exit / watch
    GRAD = "grad"  # head of a gradient region: the next ``body_len`` nodes are its ops
    # a loop node (terra.loops, only in a rolled copy): the next ``body_len`` nodes are one
    # trip of a Python loop, emitted as a tf.while_loop
    LOOP = "loop"


class _Ref:
    """A trace's ref (``OpRecord.inputs``, ``terra.trace``): where one input of a record came
    from. One small class per kind, told apart by type (``type(ref) is OpRef``), never by a
    tag. ``__slots__`` classes: made on the recording path for every input and output, they
    cost less to make and to read than a ``NamedTuple``. Not changed once made; compared by
    identity (code asks a ref's kind and fields, never whether two refs are equal)."""

    __slots__ = ()

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(repr(getattr(self, f)) for f in self.__slots__)})"


class OpRef(_Ref):
    """A recorded input: output ``out`` of record ``index`` of the same trace."""

    __slots__ = ("index", "out")

    def __init__(self, index: int, out: int):
        self.index = index
        self.out = out


class VarRef(_Ref):
    """A recorded input: a resource tensor no recorded op produced (a variable's handle, an
    iterator), captured by identity."""

    __slots__ = ("handle",)

    def __init__(self, handle):
        self.handle = handle


class ExtRef(_Ref):
    """A recorded input: any other tensor no recorded op produced (a batch, a converted Python
    scalar, a tensor of an earlier iteration); the merge classifies it (:meth:`Slot.observe`)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class SameRef(_Ref):
    """A recorded input: the external tensor already read by input ``k`` of record ``index``
    (a graph-side op), read again: fed once however many ops read it."""

    __slots__ = ("index", "k")

    def __init__(self, index: int, k: int):
        self.index = index
        self.k = k


Ref = OpRef | VarRef | ExtRef | SameRef


class SlotKind(enum.StrEnum):
    """Where an input of a node comes from: a closed set, which :class:`Slot` checks. A
    ``str`` enum: a kind prints as its word in a TraceGraph's lines and in the PythonRunner's
    messages (``is a Python value, recorded a feed``), and equals it (the PythonRunner's
    per-input validation compares ``slot.kind`` with the words)."""

    NODE = "node"  # an output of a node (``Slot.alts``: the producers it may come from)
    VAR = "var"  # a variable's handle, captured by identity
    # any resource handle, for ops run in Python (the iterator of an epoch)
    RESOURCE = "resource"
    CONST = "const"  # external, the same small value every time: a graph constant
    CAPTURE = "capture"  # external, the very same tensor every time: captured by identity
    FEED = "feed"  # external, anything else: fed through a queue
    # the value of input ``out`` of ``node`` (an external value read again)
    SAME = "same"


_EXTERNAL = frozenset({SlotKind.CONST, SlotKind.CAPTURE, SlotKind.FEED})


class Slot:
    """Where one input of a node comes from."""

    __slots__ = ("kind", "alts", "tensor", "value", "value_bytes",
                 "dtype", "shape", "ids", "values_vary", "seen")

    def __init__(self, kind: SlotKind, node=None, out=0, tensor=None):
        if type(kind) is not SlotKind:  # a misspelt kind would match nothing, silently
            raise TypeError(f"a slot's kind is a SlotKind, not {kind!r}")
        self.kind = kind
        # node / same: the producers this input may come from, ``(node, out)`` each. More
        # than one where paths join (the paper's Figure 3.2: x2 comes from either branch):
        # the input is then the one of them that ran last, in eager as in the graph.
        self.alts = [(node, out)] if node is not None else []
        self.tensor = tensor
        self.value = self.value_bytes = None
        self.dtype = self.shape = None
        self.ids = set()
        self.values_vary = False
        self.seen = 0  # observations (external slots)

    @classmethod
    def external(cls, t):
        """An external input first seen as ``t``; the merge observes ``t`` (once: a value seen
        in one trace is not yet known to be constant, nor the same tensor every time)."""
        slot = cls(SlotKind.FEED)
        slot.dtype, slot.shape = t._datatype_enum(), t._shape_tuple()
        return slot

    def observe(self, t):
        """Fold one more observation of an external input into the classification."""
        self.seen += 1
        self.shape = relax(self.shape, t._shape_tuple())
        self.ids.add(t._id)
        if not self.values_vary and t._num_elements() <= SMALL_CONST and \
                t.dtype != dtypes.string and t.dtype != dtypes.variant:
            value = t._numpy_internal()  # bypasses the materialization hook
            if self.value is None:
                self.value = np.array(value)
                self.value_bytes = self.value.tobytes()
            elif value.shape != self.value.shape or value.tobytes() != self.value_bytes:
                self.values_vary = True  # by bytes, as the PythonRunner validates
        else:
            self.values_vary = True
        if self.value is not None and not self.values_vary and \
                (self.seen > 1 or self.value.size <= ONCE_CONST):
            self.kind, self.tensor = SlotKind.CONST, None
        elif self.seen > 1 and len(self.ids) == 1:
            self.kind, self.tensor = SlotKind.CAPTURE, t  # the very same tensor every time
        else:
            self.kind, self.tensor = SlotKind.FEED, None

    def vary(self):
        """Take the input for one whose value varies, though none was seen to yet: fed."""
        self.values_vary = True
        if self.kind is SlotKind.CONST:
            self.kind = SlotKind.FEED

    def matches(self, ref, trace, join=False):
        """Whether the input ``ref`` of a record of ``trace`` (the part of a trace merged so
        far, ``tracegraph._Matched``) fits. With ``join`` a new producer fits too if it ran
        after the others (merging back)."""
        kind = type(ref)
        if kind is OpRef:
            if self.kind is not SlotKind.NODE:
                return False
            p = (trace.nodes[ref.index], ref.out)
        elif kind is SameRef:
            if self.kind is not SlotKind.SAME:
                return False
            p = (trace.nodes[ref.index], ref.k)
        elif kind is VarRef:
            return self.kind is SlotKind.RESOURCE or \
                self.kind is SlotKind.VAR and self.tensor._id == ref.handle._id
        else:
            return self.kind in _EXTERNAL and self.dtype == ref.tensor._datatype_enum()
        if p not in self.alts:
            return join and trace.ran_last(p[0], self.alts, ref.index)
        return len(self.alts) == 1 or trace.ran_last(p[0], self.alts, ref.index)

    def join(self, ref, trace):
        """Add the producer of ``ref`` to the alternatives (it ``matches`` with ``join``)."""
        kind = type(ref)
        if kind is OpRef or kind is SameRef:
            p = (trace.nodes[ref.index], ref.out if kind is OpRef else ref.k)
            if p not in self.alts:
                self.alts.append(p)

    def __str__(self):
        if self.kind in (SlotKind.NODE, SlotKind.SAME):
            alts = "|".join(f"%{n.id}" + (f".in{k}" if self.kind is SlotKind.SAME else
                                          f".{k}" if k else "") for n, k in self.alts)
            return alts if len(self.alts) == 1 else f"phi({alts})"
        if self.kind in (SlotKind.VAR, SlotKind.RESOURCE):
            return self.kind.value
        if self.kind is SlotKind.CONST:
            return f"const({np.array2string(self.value, threshold=4)})"
        shape = "?" if self.shape is None else "x".join("?" if d is None else str(d)
                                                         for d in self.shape)
        return f"{self.kind.value}[{dtypes.as_dtype(self.dtype).name} {shape}]"


class TraceNode:
    """A node of the TraceGraph. ``repr`` is ``%id``; :meth:`format` is one full line."""

    def __init__(self, node_id, kind, rec: "OpRecord | None" = None):
        self.id = node_id
        self.kind = kind
        self.succs: list[TraceNode] = []
        self.preds: list[TraceNode] = []
        self.op_type = rec.op_type if rec else kind.value
        self.attrs = rec.attrs if rec else ()
        self.location = rec.location if rec else None
        self.site = rec.site if rec else None
        self.in_body = False  # an op of a gradient region (only its head is ever a target)
        self.in_graph = rec.in_graph if rec else False
        self.inputs: list[Slot] = []
        self.out_specs = rec.out_specs if rec else ()
        self.sigs: dict[tuple, tuple] = {}  # input shapes -> output specs
        self.out_relaxed = None  # per output: the shape over every observation (relax())
        self.data_dependent = False  # output shapes seen to differ for equal input shapes
        self.body_len = rec.body_len if rec else 0
        self.results = None  # GRAD: per source leaf None | ("t", (node, out)) | ("is", ...)
        # GRAD: where every input in the cone of its target came from when it was recorded
        # (``trace_queries.cone_of``); a region is only valid where the forward pass was the same
        self.cone = None
        # GRAD: per trace through it, (what came before the call: (node, input, signature
        # part) per external input and (node, None, output shapes) per op, {(body node,
        # input): value} of the body's external inputs): backward ops compute shape-derived
        # values in Python; Terra feeds them by the iteration's signature
        self.observations = []
        # GRAD: in every trace, the forward ops its sources reach its target through were
        # recorded by its tape (``trace_queries.taped``): TF's symbolic gradient of the graph then
        # differentiates what the tape did
        self.taped = True
        # GRAD: the handles of the trainable variables its tape watched as they were read, the
        # same in every trace (else None): a graph tape watches them (``terra.graph_tapes``)
        self.watched = ()
        # OP: it ran with the tapes paused (True), not (False), or either in different traces
        # (None): whether a graph tape records it (``terra.graph_tapes``)
        self.untaped = rec.untaped if rec else False
        self.device = rec.device if rec else ""  # OP: the device scope of its first trace
        self.fetched: set[int] = set()
        self.escaped: set[int] = set()
        self.seen = 0  # traces that went through this node
        self.loop = None  # in a rolled copy (terra.loops): the LOOP node whose body it is
        # GRAD, in a rolled copy: the regions of every trip count through a loop, merged;
        # emitted as TF's symbolic gradient through the While. The loop's first trip's nodes
        # (its key in ``TraceGraph.trips``), else None
        self.rolled = None
        # what a node of the same op, issued from the same call stack, shares with it in
        # every trip of a loop (its key but the occurrence)
        self.stack_key = (kind, self.op_type, opdefs.key_attrs(self.attrs),
                          self.site[0] if self.site else None)

    @property
    def key(self):
        return match_key(self)

    def __repr__(self):
        return f"%{self.id}"

    def format(self) -> str:
        attrs = ", ".join(f"{k}={_short(v)}" for k, v in self.attrs if k not in ("T", "dtype")) \
            if self.kind == NodeKind.OP else ""
        args = ", ".join(str(s) for s in self.inputs)
        extra = []
        if not self.in_graph and self.kind == NodeKind.OP:
            extra.append("python")
        if self.fetched:
            extra.append(f"fetch={sorted(self.fetched)}")
        if self.escaped:
            extra.append(f"escape={sorted(self.escaped)}")
        if self.kind in (NodeKind.GRAD, NodeKind.LOOP):
            extra.append(f"body={self.body_len}")
        if self.kind == NodeKind.LOOP:  # its inputs: the values its first rolled trip reads
            extra.append(f"trips={'|'.join(map(str, self.counts))} peeled={self.peeled}")
        where = f"  # {_where(self.location)}" if self.location else ""
        succ = " -> " + ", ".join(repr(s) for s in self.succs) if len(self.succs) > 1 else ""
        tags = f" [{' '.join(extra)}]" if extra else ""
        head = f"{self.op_type}[{attrs}]" if attrs else self.op_type
        return f"%{self.id} = {head}({args}){tags}{succ}{where}"


def _short(v):
    s = repr(v)
    return s if len(s) <= 24 else s[:21] + "..."


def _where(loc):
    return f"{loc.file.rsplit('/', 1)[-1]}:{loc.line}"


def match_key(n):
    """What a node and a record (either is ``n``) must share to match (paper §3.2.2): type,
    attributes and executed location."""
    return (n.kind, n.op_type,
            opdefs.key_attrs(n.attrs), n.site)


def region_body(head):
    """The backward ops of the gradient region ``head`` (a loop node's body), in the graph's
    order: the chain of ``body_len`` nodes after it."""
    body, n = [], head
    for _ in range(head.body_len):
        n = n.succs[0]
        body.append(n)
    return body


def result_structure(region):
    """What regions of one call made one must share: per source, None, or the result's kind
    and which of its parts are None."""
    return tuple(None if r is None else (r[0], tuple(q is None for q in r[1:]))
                 for r in region.results)


def result_map(region, kept):
    """``(node, out)`` of each result of the gradient region ``region`` -> the same result of
    ``kept``, for regions of one call made one."""
    return {part: part_kept for r, r_kept in zip(region.results, kept.results, strict=True)
            for part, part_kept in zip((r or ())[1:], (r_kept or ())[1:]) if part is not None}


FUNCTION_TOKEN = "fn"  # a TF function's marks (``terra.function_regions``) carry it second


def function_mark(n) -> bool:
    """Whether ``n`` is a ``call`` or ``return`` mark of a TF function's region
    (``terra.function_regions``): marks a loop's trips may hold and a While drops."""
    return n.kind is NodeKind.MARK and len(n.attrs) > 1 and n.attrs[1] == FUNCTION_TOKEN
