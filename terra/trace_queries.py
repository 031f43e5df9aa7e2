"""What a finished trace says, read for the merge (``terra.tracegraph``).

The TraceGraph keeps what these functions find on its nodes: a record's input shapes
(:func:`in_shapes`), the loops in a path (:func:`periodic_runs`), and what a gradient call's
region depends on: the forward pass it differentiates (:func:`cone_of`), whether its tape
recorded that pass (:func:`taped`), and the iteration's signature before it
(:func:`observation_of`, :func:`signature_part`, which the PythonRunner computes alike while
co-executing).
"""

import numpy as np
from tensorflow.python.framework import dtypes

from terra.nodes import ONCE_CONST, SMALL_CONST, ExtRef, NodeKind, OpRef, SameRef, SlotKind, VarRef


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
