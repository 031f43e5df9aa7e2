"""What Terra needs to know about an op type, read once from its OpDef and cached.

Three consumers: the recorder normalizes attrs into hashable keys, the PythonRunner splits
fast-path arguments into inputs and attrs, and the graph builder turns recorded attrs back
into ``AttrValue`` protos. Keeping the OpDef parsing here keeps those three consistent.
"""

import functools
import threading

import numpy as np
from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import (
    constant_op,
    dtypes,
    errors,
    op_def_registry,
    ops,
    tensor_shape,
    tensor_util,
)
from tensorflow.python.ops import array_ops, handle_data_util

# Stateful ops that act on variables stay in the symbolic graph (paper §3.3.1): automatic
# control dependencies order them per resource, and the iteration-start snapshot makes
# re-execution after a fallback safe.
_VARIABLE_OPS = frozenset({
    "ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
    "ResourceGather", "ResourceGatherNd", "VariableShape", "RngReadAndSkip",
    "RngSkip", "ResourceStridedSliceAssign",
})
_VARIABLE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")

# Variable ops that only read: with the stateless ops, what the graph may run ahead of Python
# and drop (``OpInfo.effect_free``).
READ_ONLY_VARIABLE_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd",
                                    "VariableShape"})

# Stateful ops whose state is harmless to keep in the graph: they are deterministic
# functions of their inputs (the statefulness marks side-effect ordering only).
_PURE_STATEFUL_OPS = frozenset({"Assert", "CheckNumerics", "CheckNumericsV2"})

# Ops that create state: an iteration that runs one is a warm-up iteration, never a trace.
CREATION_OPS = frozenset({"VarHandleOp", "AnonymousSeedGenerator", "HashTableV2",
                          "MutableHashTableV2", "MutableDenseHashTableV2"})

# Stateful random ops get a fresh seed2 per call under a global seed; it is not part of what
# an op *is* (docs/architecture.md §3.5), and these ops run in Python anyway.
_IGNORED_KEY_ATTRS = frozenset({"seed2"})


class OpInfo:
    """Cached facts about one op type."""

    __slots__ = ("name", "op_def", "n_inputs", "list_inputs", "has_list", "attr_types",
                 "in_graph", "effect_free")

    def __init__(self, name, op_def):
        self.name = name
        self.op_def = op_def
        if op_def is None:  # a function call: its op type is the function's name
            self.n_inputs = None
            self.list_inputs = ()
            self.has_list = False
            self.attr_types = {}
            self.in_graph = _function_in_graph(name)  # False if there is no such function
            self.effect_free = False
            return
        args = op_def.input_arg
        self.n_inputs = len(args)
        self.list_inputs = tuple(bool(a.number_attr or a.type_list_attr) for a in args)
        self.has_list = any(self.list_inputs)
        self.attr_types = {a.name: a.type for a in op_def.attr}
        self.in_graph = (not op_def.is_stateful or name in _VARIABLE_OPS
                         or name.startswith(_VARIABLE_PREFIXES) or name in _PURE_STATEFUL_OPS)
        # the graph running it changes no state (Assert and CheckNumerics are stateful)
        self.effect_free = not op_def.is_stateful or name in READ_ONLY_VARIABLE_OPS


# Ops whose statefulness is that of the functions they call (checked through their
# function-valued attrs): calls and functional control flow.
_CALLING_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall", "If", "StatelessIf",
                          "While", "StatelessWhile", "Case", "StatelessCase"})


def _function_in_graph(name: str, seen=None) -> bool:
    """Whether every op the library function ``name`` runs (through nested calls and
    control-flow branches) may run in the symbolic graph, as ``OpInfo.in_graph`` says of
    an op. A stateful random op inside keeps the call in Python, like the op alone. (A
    ``tf.function`` called eagerly runs as an op named after such a function:
    ``terra.functions``.)"""
    seen = set() if seen is None else seen
    if name in seen:
        return True
    seen.add(name)
    ctx = context.context()
    if not ctx.has_function(name):
        return False
    fdef = ctx.get_function_def(name)
    forward = fdef.attr.get("forward_function_name")  # a backward function runs in the
    if forward is not None and not _function_in_graph(forward.s.decode(), seen):  # graph
        return False  # only with its forward function: its gradient region is skipped
    for node in fdef.node_def:
        called = [a.func.name for a in node.attr.values() if a.HasField("func")]
        called += [f.name for a in node.attr.values() if a.HasField("list")
                   for f in a.list.func]
        if not all(_function_in_graph(f, seen) for f in called):
            return False
        if op_def_registry.get(node.op) is None:
            if not _function_in_graph(node.op, seen):
                return False
        elif node.op not in _CALLING_OPS and not info(node.op).in_graph:
            return False
    return True


@functools.cache
def info(op_type: str) -> OpInfo:
    return OpInfo(op_type, op_def_registry.get(op_type))


@functools.cache
def gradient_flows(op_type: str, attrs: tuple, in_dtypes: tuple) -> tuple:
    """Per input of ``op_type`` (these attrs, inputs of these dtype enums), whether TF's
    gradient function gives it a gradient. Asked once, of the op built in a scratch graph:
    a registered gradient may still give None (``tf.round``'s, an ``ArgMax``'s), and
    ``tf.stop_gradient`` and ops TF declares not differentiable give none. A ``tf.function``'s
    call (no op definition) passes every input: the tape records its backward function. An
    op whose gradient cannot be asked this way passes none."""
    if info(op_type).op_def is None:
        return (True,) * len(in_dtypes)
    try:
        with ops.Graph().as_default() as graph:
            inputs = [array_ops.placeholder(dtypes.as_dtype(d)) for d in in_dtypes]
            op = graph._create_op_internal(op_type, inputs, attrs=attr_protos(op_type, attrs))
            function = ops.get_gradient_function(op)
            if function is None:
                return (False,) * len(in_dtypes)
            grads = function(op, *[array_ops.ones_like(o) if o.dtype.is_floating else None
                                   for o in op.outputs])
    except Exception:  # noqa: BLE001 - unknown: no gradient flows (the caller falls back)
        return (False,) * len(in_dtypes)
    grads = list(grads) if isinstance(grads, (list, tuple)) else [grads]
    if len(grads) != len(in_dtypes):
        return (False,) * len(in_dtypes)
    return tuple(g is not None for g in grads)


def op_name(op_type) -> str:
    """Eager entry points pass op types as str or bytes; Terra always uses str."""
    return op_type.decode() if isinstance(op_type, bytes) else op_type


def _norm(kind: str, value):
    if value is None:  # fast-path callers may pass None for an attr left at its default
        return None
    if kind.startswith("list("):
        inner = kind[5:-1]
        return tuple(_norm(inner, v) for v in value)
    if kind == "type":
        return value if isinstance(value, int) else dtypes.as_dtype(value).as_datatype_enum
    if kind == "string":
        return value.encode() if isinstance(value, str) else bytes(value)
    if kind == "shape":
        shape = tensor_shape.as_shape(value)
        return None if shape.rank is None else tuple(shape.as_list())
    if kind == "func":
        return value if isinstance(value, str) else getattr(value, "name", str(value))
    if kind == "tensor":
        return tensor_util.make_tensor_proto(value).SerializeToString()
    if kind == "float":
        return float(value)
    if kind == "int":
        return int(value)
    return value


def normalize_attrs(op_type: str, flat) -> tuple:
    """Flat ``(name, value, ...)`` eager attrs -> sorted hashable ``((name, value), ...)``,
    with every attr that has a default spelled out: an attr given as None or not given is at
    its default, and the same op issued either way (a replayed op spells out its defaults: a
    gradient function may read any attr) must normalize the same."""
    try:
        return _normalized[op_type, flat]
    except KeyError:
        pass
    except TypeError:  # a list or a tensor among the values: not memoized
        return _normalize(op_type, flat)
    attrs = _normalize(op_type, flat)
    if len(_normalized) < _MEMO_SIZE:
        _normalized[op_type, flat] = attrs
    return attrs


# (op type, flat attrs as the op was issued) -> normalized: a training step issues the same
# few hundred combinations every iteration
_normalized: dict = {}
_MEMO_SIZE = 1 << 14


def _normalize(op_type: str, flat) -> tuple:
    types = info(op_type).attr_types
    pairs = dict(normalized_defaults(op_type))
    for i in range(0, len(flat or ()), 2):
        if flat[i + 1] is None:
            continue
        name = op_name(flat[i])
        kind = types.get(name)
        pairs[name] = _norm(kind, flat[i + 1]) if kind else flat[i + 1]
    return tuple(sorted(pairs.items()))


def key_attrs(attrs: tuple) -> tuple:
    """The attrs that identify an op for matching (drops per-call seeds). Memoized: merging
    a trace asks it of every candidate node, and the same few hundred attrs come every
    iteration."""
    try:
        return _keys[attrs]
    except KeyError:
        pass
    except TypeError:  # an unhashable value: not memoized
        return _key_attrs(attrs)
    key = _key_attrs(attrs)
    if len(_keys) < _MEMO_SIZE:
        _keys[attrs] = key
    return key


_keys: dict = {}


def _key_attrs(attrs):
    return tuple(p for p in attrs
                 if not (isinstance(p, tuple) and p and p[0] in _IGNORED_KEY_ATTRS))


def attr_value(kind: str, value) -> attr_value_pb2.AttrValue:
    """A normalized attr value -> AttrValue proto for ``Graph.create_op``."""
    a = attr_value_pb2.AttrValue()
    if kind.startswith("list("):
        inner = kind[5:-1]
        field = {"type": "type", "int": "i", "float": "f", "bool": "b", "string": "s",
                 "shape": "shape"}[inner]
        lst = getattr(a.list, field)
        for v in value:
            if inner == "shape":
                lst.add().CopyFrom(tensor_shape.TensorShape(v).as_proto())
            else:
                lst.append(v)
        if not value:
            a.list.SetInParent()
        return a
    if kind == "type":
        a.type = value
    elif kind == "int":
        a.i = value
    elif kind == "float":
        a.f = value
    elif kind == "bool":
        a.b = value
    elif kind == "string":
        a.s = value
    elif kind == "shape":
        a.shape.CopyFrom(tensor_shape.TensorShape(value).as_proto())
    elif kind == "tensor":
        a.tensor.ParseFromString(value)
    elif kind == "func":
        a.func.name = value
    else:
        raise TypeError(f"unsupported attr kind {kind!r}")
    return a


def _from_proto(a):
    """An OpDef default ``AttrValue`` -> the plain value an eager op wrapper would pass."""
    which = a.WhichOneof("value")
    if which == "list":
        lst = a.list
        for field in ("s", "i", "f", "b", "type"):
            values = getattr(lst, field)
            if values:
                return list(values)
        return []
    if which == "shape":
        return None if a.shape.unknown_rank else [d.size for d in a.shape.dim]
    if which == "tensor":
        return a.tensor
    return getattr(a, which) if which else None


@functools.cache
def defaults(op_type: str) -> dict:
    """The op's attrs that have default values, as eager op wrappers pass them; not those
    inferred from the inputs (a type or length attr: a fast-path call leaves them out, and
    its default, if any, is not what the inputs give)."""
    op_def = info(op_type).op_def
    if op_def is None:
        return {}
    inferred = {name for arg in op_def.input_arg
                for name in (arg.type_attr, arg.number_attr, arg.type_list_attr) if name}
    return {a.name: _from_proto(a.default_value) for a in op_def.attr
            if a.HasField("default_value") and a.name not in inferred}


@functools.cache
def normalized_defaults(op_type: str) -> tuple:
    types = info(op_type).attr_types
    return tuple((name, _norm(types[name], value)) for name, value in defaults(op_type).items())


def attr_protos(op_type, attrs):
    """Recorded ``(name, value)`` attrs as the AttrValue protos ``Graph.create_op`` takes."""
    types = info(op_type).attr_types
    return {name: attr_value(types[name], value)
            for name, value in attrs if name in types and value is not None}


class _Scratch:
    """One scratch graph for shape inference, reused across calls: its placeholders (by dtype
    and shape), constants (by dtype, shape and bytes) and variable handles are made once, so
    inferring an op's output shapes costs one op added to the graph, not a graph and every
    input's op (a sequence length new at every step asks for hundreds of inferences). The
    answers are memoized by op, attrs and inputs: every generation asks again for every op
    of the TraceGraph (a fifth of a ResNet's generation time before the memo)."""

    LIMIT = 20000  # ops, then a fresh graph (and a fresh memo)

    def __init__(self):
        self.graph = None
        self.inputs = {}
        self.ops = 0
        self.memo = {}  # (op_type, attrs, input keys) -> output shapes, or the error raised

    def tensor(self, kind, key, make):
        t = self.inputs.get((kind, key))
        if t is None:
            with self.graph.as_default():
                t = self.inputs[(kind, key)] = make()
        return t

    def output_shapes(self, op_type, attrs, inputs):
        if self.graph is None or self.ops > self.LIMIT:
            self.graph, self.inputs, self.ops, self.memo = ops.Graph(), {}, 0, {}
        keys, makers = [], []
        for kind, value, dtype, shape in inputs:
            if kind == "value":
                value = np.asarray(value)
                keys.append((kind, (dtype, value.shape, value.tobytes())))
                makers.append(lambda v=value, d=dtype: constant_op.constant(v, d))
            elif kind == "handle":  # the variable's shape and dtype ride on its handle data
                keys.append((kind, value._id))
                makers.append(lambda h=value: _handle_of(h))
            else:
                keys.append((kind, (dtype, None if shape is None else tuple(shape))))
                makers.append(lambda d=dtype, s=shape: array_ops.placeholder(d, s))
        memo_key = (op_type, attrs, tuple(keys))
        known = self.memo.get(memo_key)
        if known is None:
            self.ops += 1
            tensors = [self.tensor(kind, key, make) for (kind, key), make in zip(keys, makers)]
            try:
                with self.graph.as_default():
                    op = self.graph._create_op_internal(op_type, tensors,
                                                        attrs=attr_protos(op_type, attrs))
                known = self.memo[memo_key] = [t.shape for t in op.outputs]
            except (ValueError, TypeError, errors.OpError) as e:
                known = self.memo[memo_key] = e
        if isinstance(known, Exception):
            raise known.with_traceback(None)  # not one traceback grown by every raise
        return known


def _handle_of(handle):
    placeholder = array_ops.placeholder(dtypes.resource, ())
    handle_data_util.copy_handle_data(handle, placeholder)
    return placeholder


_scratch = _Scratch()
_scratch_lock = threading.Lock()


def scratch_output_shapes(op_type, attrs, inputs):
    """The output shapes ``op_type``'s shape function gives (TF's graph-mode shape inference)
    on ``inputs``, each ``(kind, value, dtype, shape)``: ``("value", array, dtype, None)`` a
    known value, ``("handle", eager handle, None, None)`` a variable (its shape data), or
    ``("shape", None, dtype, shape)`` a tensor of that shape. Raises what ``create_op``
    raises when the shape function rejects them."""
    with _scratch_lock:
        return _scratch.output_shapes(op_type, attrs, inputs)


# Elementwise ops whose output has their one input's shape, or their inputs' broadcast
# (numpy's rules are TF's for these; an incompatible pair raises, as TF's shape function does)
SAME_SHAPE = frozenset({
    "OnesLike", "ZerosLike", "Identity", "StopGradient", "Neg", "Abs", "Sign", "Exp", "Expm1",
    "Log", "Log1p", "Sqrt", "Rsqrt", "Square", "Reciprocal", "Sigmoid", "Tanh", "Relu",
    "Relu6", "Elu", "Selu", "Softplus", "LeakyRelu", "Floor", "Ceil", "Round", "Cast",
    "LogicalNot", "IsNan", "IsFinite", "Erf", "Sin", "Cos",
})
BROADCAST = frozenset({
    "AddV2", "Sub", "Mul", "RealDiv", "DivNoNan", "MulNoNan", "Maximum", "Minimum", "Pow",
    "SquaredDifference", "FloorDiv", "FloorMod", "Less", "LessEqual", "Greater",
    "GreaterEqual", "LogicalAnd", "LogicalOr", "Atan2", "SelectV2",
})
# Reductions: their input's shape without the axes their second input names (``keep_dims``:
# 1 in their place); ``ArgMax``/``ArgMin`` take one axis and keep no dimension
REDUCTIONS = frozenset({"Sum", "Prod", "Max", "Min", "Mean", "All", "Any", "ArgMax", "ArgMin"})
