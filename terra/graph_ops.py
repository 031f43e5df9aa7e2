"""The graph ops emission makes other than a recorded op's copy, and the marks it puts on ops:
so that the graph computes what eager computed (to the bit with ``Config.exact``).

A recorded ``tf.function`` call becomes a call of a copy of its function that TF does not
inline (:func:`call_function`); a ``BiasAddGrad`` keeps oneDNN from merging it with the
convolution's filter gradient (:func:`keep_eager_rounding`); the Grappler rewrites that round
otherwise are turned off (:data:`EXACT_OFF`). Under XLA, compute ops get the marks
``jit_scope`` would give them, random ops and function calls never (:func:`mark_for_xla`).
A switch-case's branch returns a :func:`placeholder` for a value it does not compute.
"""

import functools

from tensorflow.core.framework import attr_value_pb2, function_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import dtypes
from tensorflow.python.ops import array_ops, gen_array_ops, gen_math_ops
from tensorflow.python.util import _pywrap_util_port, compat

_ONEDNN = _pywrap_util_port.IsMklEnabled()

# Grappler's rewrites that change how a value is rounded, off for an exact graph: constant
# folding turns ``x / c`` into ``x * (1 / c)`` (a hard-swish's ``/ 6`` drifted MobileNetV3 off
# eager), the arithmetic optimizer regroups sums and products and rewrites ``log(1 + x)`` as
# ``log1p(x)``, and the remapper fuses patterns into oneDNN kernels (layer norm, GELU,
# batch norm + activation) that compute them in another order.
EXACT_OFF = frozenset({"constant_folding", "arithmetic_optimization", "remapping"})


def keep_eager_rounding(created, reorder=True):
    """Keep the graph from rounding otherwise than eager, in the ``created`` graph ops.
    With ``reorder``, an ``AddN`` is replaced (see :func:`add_in_order`): its readers read
    the replacement, and ``{AddN output ref: replacement}`` is returned.

    With oneDNN on (TF's CPU default), the layout pass that runs on every function graph
    merges a ``BiasAddGrad`` with the ``Conv2DBackpropFilter`` reading the same gradient into
    one kernel, which sums the bias gradient in another order than eager's ``BiasAddGrad``:
    a few ulps apart on strided convolutions, which momentum then grows (a Sonnet ConvNet
    ended 1e-4 off eager after 40 steps). The pass merges only when both read the same
    tensor, so the bias gradient reads a ``Snapshot`` of it (a copy Grappler keeps; an
    ``Identity`` it would remove)."""
    replaced = {}
    for op in created:
        if op.type == "BiasAddGrad" and _ONEDNN:
            op._update_input(0, gen_array_ops.snapshot(op.inputs[0]))
        elif reorder and reorders(op.type, op.inputs):
            out = op.outputs[0]
            total = add_in_order(list(op.inputs))
            for reader in out.consumers():
                for i, t in enumerate(reader.inputs):
                    if t is out:
                        reader._update_input(i, total)
            replaced[out.ref()] = total
    return replaced


def reorders(op_type, inputs) -> bool:
    """Whether the graph's executor may sum ``AddN(inputs)`` in another order than eager."""
    return op_type == "AddN" and len(inputs) > 2 and inputs[0].dtype.is_floating


def add_in_order(inputs):
    """``AddN(inputs)``, summed in eager's order whatever buffers the graph reuses.

    ``AddN`` accumulates into one of its inputs' buffers where the executor lets it take one
    over (no other reader holds it), moving that input first. Eager never hands it a buffer
    no Python object holds, so it adds in order; Terra's graph of a test's fan-out handed it
    the ninth of eleven terms (the others were read by the backward pass), added first: 197
    of 512 values differed, and the gradients after them. So the sum is made of two-input
    adds, whose operands commute exactly, grouped as the kernel groups them: the first
    ``n % 8`` inputs (eight or nine where that leaves none or one), then eight at a time,
    each group summed and then added (bit for bit eager's ``AddN`` for 2 to 34 inputs of
    every float type: ``tests/test_graph_ops.py``)."""
    n = len(inputs)
    first = n if n < 8 else {0: 8, 1: 9}.get(n % 8, n % 8)
    total = _fold(inputs[:first])
    for i in range(first, n, 8):
        total = gen_math_ops.add_v2(total, _fold(inputs[i:i + 8]))
    return total


def _fold(inputs):
    total = inputs[0]
    for t in inputs[1:]:
        total = gen_math_ops.add_v2(total, t)
    return total


def call_function(graph, node, inputs):
    """The call of library function ``node.op_type`` as eager made it: a
    ``StatefulPartitionedCall`` of a copy marked ``_noinline``, with eager's call config. TF
    then instantiates and optimizes the body on its own, as for the eager call, and its
    numbers are eager's to the bit; inlined into the exact graph, the body's ops would round
    as separate eager ops do, not as the function did (Grappler rewrites a ``tf.function``'s
    body: ``x / 6`` is ``x * (1/6)`` there, 358 of 1000 values differed in the last bit)."""
    attrs = dict(node.attrs)
    out_types = [dtype for _, dtype in node.out_specs]

    def types(values):
        return attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(type=values))

    op = graph._create_op_internal(
        "StatefulPartitionedCall", inputs, dtypes=out_types, attrs={
            "Tin": types([t.dtype.as_datatype_enum for t in inputs]), "Tout": types(out_types),
            "f": attr_value_pb2.AttrValue(
                func=attr_value_pb2.NameAttrList(name=_noinline_copy(node.op_type))),
            "config_proto": attr_value_pb2.AttrValue(
                s=compat.as_bytes(attrs.get("config_proto") or b"")),
            "executor_type": attr_value_pb2.AttrValue(
                s=compat.as_bytes(attrs.get("executor_type") or b""))})
    for t, shape in zip(op.outputs, node.out_relaxed, strict=True):
        t.set_shape(shape)
    return op


@functools.cache
def _noinline_copy(name):
    """A copy of library function ``name`` that TF's inliners leave alone."""
    ctx = context.context()
    fdef = function_pb2.FunctionDef()
    fdef.CopyFrom(ctx.get_function_def(name))
    fdef.signature.name = copy = f"{name}_terra_call"
    fdef.attr["_noinline"].b = True
    ctx.add_function_def(fdef)
    return copy


def mark_for_xla(created, scope):
    """Mark the compute ops among ``created`` for XLA in segment scope ``scope``, which
    ``terra.xla`` compiles as one function (section 3.12): not queue ops (XLA has no kernels
    for them), not random ops (XLA draws other numbers than TF's kernels for the same seed),
    not ``call_function``'s calls (XLA would not round as the function did)."""
    for op in created:
        if not op.type.startswith("Queue") and not _draws_random(op) \
                and op.type != "StatefulPartitionedCall":
            _compile_with_xla(op, scope)


def _draws_random(op):
    return any(word in op.type for word in ("Random", "TruncatedNormal", "Multinomial"))


def _compile_with_xla(op, scope):
    """Mark ``op`` for XLA in segment scope ``scope``: the attributes ``jit_scope`` gives the
    ops created under it (one scope per segment between fetches cannot be a ``with`` block
    here: a segment starts and ends in the middle of emitting a node)."""
    op._set_attr("_XlaCompile", attr_value_pb2.AttrValue(b=True))
    op._set_attr("_XlaScope", attr_value_pb2.AttrValue(s=scope))
    op._set_attr("_XlaSeparateCompiledGradients", attr_value_pb2.AttrValue(b=False))


def placeholder(dtype, shape):
    """A value a branch returns for what it does not compute (never read)."""
    dt = dtypes.as_dtype(dtype)
    if dt in (dtypes.resource, dtypes.variant):
        raise NotImplementedError(f"a {dt.name} value leaves a branch of a switch-case")
    if shape is None:
        return array_ops.zeros((), dt)
    return array_ops.zeros([0 if d is None else d for d in shape], dt)
