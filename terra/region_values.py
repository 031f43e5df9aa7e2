"""What a layer region's call returned, as the call mark keeps it, and what it reads of its
arguments: the template a skipped call is handed its stand-ins through
(``terra.layer_regions``). Kept apart from the guards, which decide whether a call is skipped
at all."""

from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from terra.nodes import ExtRef

_EagerTensor = ops.EagerTensor


def encode(outputs, arguments):
    """(the tensors among ``outputs`` that are not the call's own ``arguments``, the
    structure of ``outputs`` as a hashable template: ``("t",)`` for the next such tensor
    (``("t", "no mask")``: one tf_keras gave ``_keras_mask = None``),
    ``("arg", i)`` for argument ``i``, ``("v", x)`` for a number), or a None template if
    the outputs are something else (a tensor carrying Python attributes, another object). Plain
    recursion, no closure: a recursive closure is a reference cycle, which would keep the
    tensors alive past the iteration until the garbage collector ran (an escape)."""
    by_id = {t._id: i for i, t in enumerate(arguments)}
    returned = []
    try:
        template = _encoded(outputs, by_id, returned)
    except _NotARegion:
        return [t for t in nest.flatten(outputs) if type(t) is _EagerTensor and
                t._id not in by_id], None
    return returned, template


def _encoded(x, by_id, returned):
    kind = type(x)
    if kind is _EagerTensor:
        if x._id in by_id:
            return ("arg", by_id[x._id])
        if x.__dict__:  # Python attributes on the tensor (Keras' _keras_mask, a softmax's
            if x.__dict__ != _NO_MASK:  # _keras_logits, which a loss reads): a stand-in
                raise _NotARegion  # has none, but the no-mask tf_keras sets on every
            returned.append(x)  # output of a layer that computes masks (a GRU's with
            return ("t", "no mask")  # return_state)
        returned.append(x)
        return ("t",)
    if kind in (int, float, bool, str, type(None)):
        return ("v", x)
    if kind in (list, tuple):
        return (kind.__name__, tuple(_encoded(v, by_id, returned) for v in x))
    if kind is dict:
        return ("dict", tuple((k, _encoded(v, by_id, returned)) for k, v in x.items()))
    raise _NotARegion


_NO_MASK = {"_keras_mask": None}


class _NotARegion(Exception):
    pass


def argument_reads(recorder, begin, arguments):
    """(op index in the region, input, argument index) of every input of the region's ops
    (``recorder.records[begin:]``) that read one of the call's ``arguments`` as an external
    tensor: what Python feeds when it skips the call."""
    by_id = {t._id: i for i, t in enumerate(arguments)}
    return tuple((j, k, by_id[ref.tensor._id])
                 for j, record in enumerate(recorder.records[begin:])
                 for k, ref in enumerate(record.inputs)
                 if type(ref) is ExtRef and ref.tensor._id in by_id)


def decode(template, flat, arguments):
    """The structure a skipped call returns: its ``template`` (the call mark's) filled with
    the stand-ins ``flat`` and the call's ``arguments``."""
    return _decoded(template, iter(flat), arguments)


def _decoded(code, tensors, arguments):
    kind = code[0]
    if kind == "t":
        t = next(tensors)
        if len(code) > 1:  # (a stand-in with attributes is never handed out again)
            t._keras_mask = None
        return t
    if kind == "arg":
        return arguments[code[1]]
    if kind == "v":
        return code[1]
    if kind == "dict":
        return {k: _decoded(v, tensors, arguments) for k, v in code[1]}
    values = [_decoded(v, tensors, arguments) for v in code[1]]
    return values if kind == "list" else tuple(values)
