"""The ``compile_segments`` pass: each segment between fetches as one XLA-compiled function.

Emission marks the compute ops of each segment with that segment's scope
(``Emitter._for_xla``). TF's auto-clustering merges marked ops only along data edges, so a
segment broke into many clusters (one per variable's optimizer update), each with a launch
cost a CPU kernel does not have. This pass instead moves every segment's marked ops into one
function with ``_XlaMustCompile`` (what ``tf.function(jit_compile=True)`` gives), called from
the generated function by a ``StatefulPartitionedCall``: TF compiles the call as one XLA
computation, independent updates included.

It rewrites the generated function's ``FunctionDef`` (and those of its ``tf.switch_case``
branches), registers the rewrite under a new name, and returns that name; the function's
signature and captures are unchanged. Ops stay outside the compiled functions when XLA has no
kernel for them, and a segment splits where it would otherwise form a cycle through an op
left outside (a random op reading one of its shapes, whose result it reads again): each part
is a convex piece, called once. XLA compiles each function at its first call;
``terra.precompile`` makes that first call before co-execution begins.
"""

import collections
import functools

from tensorflow.core.framework import function_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import kernels, op_def_registry

from terra.nodes import SlotKind

_MARKS = ("_XlaCompile", "_XlaScope", "_XlaSeparateCompiledGradients")
# A piece with fewer than _MIN_OPS ops besides these has too little for XLA to fuse to pay
# for its launch: it stays as TF ops
_MIN_OPS = 8
_TRIVIAL = frozenset({"Const", "Identity", "IdentityN", "NoOp", "ReadVariableOp", "EnsureShape",
                      "StopGradient", "Shape", "Snapshot"})


def compile_segments(function, spec):
    """Register a copy of ConcreteFunction ``function`` whose XLA segments are compiled
    functions. ``spec(ref)`` describes a tensor of the traced body (``terra.precompile``), None
    where its shape is not fully known: a piece of the body with such an input stays TF ops,
    since XLA would compile it again at every new shape (YOLOv3's loss after a boolean mask
    took 0.2 s more in four of its first six co-executed iterations). Returns the copy's name
    (the function's own when no op is marked) and, for ``terra.precompile``, the compiled
    functions of its body (not of its branches, whose argument shapes its graph does not
    hold) as ``[(name, [spec of each input])]``."""
    name = function._inference_function.name.decode()
    segments = []
    return _rewrite(name, spec, segments) or name, segments


def fixed_shapes(node):
    """Whether every trace saw ``node`` (a recorded op) with the same input and output
    shapes. XLA compiles a function once per input shape: an op downstream of a boolean
    mask's varying row count recompiled YOLOv3's loss at every step. TF's static shapes do
    not tell: a gradient's ``BroadcastGradientArgs`` has no static shape although it only
    depends on shapes that never change, and leaving it and what reads it out cut DCGAN's
    backward pass into twenty pieces."""
    def fixed(shape):
        return shape is not None and None not in shape

    if not all(fixed(shape) for shape in node.out_relaxed or ()):
        return False
    for slot in node.inputs:
        if slot.kind is SlotKind.NODE:
            if not all(fixed(p.out_relaxed[k]) for p, k in slot.alts):
                return False
        elif slot.kind is SlotKind.SAME:
            if not all(fixed(p.inputs[k].shape) for p, k in slot.alts):
                return False
        elif slot.kind is SlotKind.FEED and not fixed(slot.shape):
            return False
    return True


def _rewrite(name, spec=None, segments=None):
    """The name of the rewritten copy of ``name``, or None when it has no op marked for XLA;
    with ``spec``, only pieces whose inputs it knows are compiled, and they are appended to
    ``segments`` with their inputs' specs."""
    ctx = context.context()
    fdef = function_pb2.FunctionDef()
    fdef.CopyFrom(ctx.get_function_def(name))
    changed = False
    for node in fdef.node_def:  # a switch-case's branches first
        if node.op in ("Case", "StatelessCase"):
            branches = node.attr["branches"].list.func
            for branch in branches:
                new = _rewrite(branch.name)
                if new is not None:
                    branch.name = new
                    changed = True
    pieces = _pieces(fdef)
    if not changed and not any("_XlaScope" in n.attr for n in fdef.node_def):
        return None
    new_name = f"{name}_xla"
    origin = {}  # a call's output -> the traced tensor it stands for
    for k, piece in enumerate(pieces):
        if spec is not None:
            specs = [spec(origin.get(ref, ref)) for ref in _inputs(fdef, piece)]
            if None in specs:
                continue  # its ops stay TF ops (their marks are dropped below)
        call = f"xla_segment_{k}"
        _, outputs = _outline(fdef, piece, f"{new_name}_{k}", call)
        origin.update((f"{call}:output:{j}", ref) for ref, j in outputs.items())
        if spec is not None:
            segments.append((f"{new_name}_{k}", specs))
    fdef.signature.name = new_name
    for attrs in [n.attr for n in fdef.node_def] + [a.attr for a in fdef.arg_attr.values()]:
        for mark in _MARKS:  # what is left outside is not auto-clustered
            attrs.pop(mark, None)
    ctx.add_function_def(fdef)
    return new_name


def _pieces(fdef):
    """The marked nodes of ``fdef`` as convex pieces, ``[[node name]]``: per scope, a node's
    level is the highest level it reads from its own scope, plus one where the value
    reaches it through a node outside the scope. A path that leaves a piece and comes back
    therefore always enters a later piece, and no two calls wait for each other."""
    nodes = {n.name: n for n in fdef.node_def}
    marked = {n.name: n.attr["_XlaScope"].s for n in fdef.node_def
              if "_XlaScope" in n.attr and _compilable(n)}
    levels = {}  # marked node -> (scope, level)
    reach = {}  # node -> {scope: the highest level of that scope it depends on}
    for name in _topological(nodes):
        seen = {}
        for src in _sources(nodes[name]):
            for scope, level in reach.get(src, {}).items():
                seen[scope] = max(seen.get(scope, -1), level)
        scope = marked.get(name)
        if scope is not None:
            level = 0
            for src in _sources(nodes[name]):
                if levels.get(src, (None,))[0] == scope:
                    level = max(level, levels[src][1])
                elif scope in reach.get(src, {}):
                    level = max(level, reach[src][scope] + 1)
            levels[name] = scope, level
            seen[scope] = max(seen.get(scope, -1), level)
        reach[name] = seen
    groups = collections.defaultdict(list)
    for name, key in levels.items():
        if not _free(nodes[name]):
            groups[key].append(name)
    return [group for group in groups.values()
            if sum(nodes[n].op not in _TRIVIAL for n in group) >= _MIN_OPS]


def _inputs(fdef, piece):
    """The tensors the nodes ``piece`` of ``fdef`` read from outside it, in the order of the
    compiled function's arguments (:func:`_outline`'s)."""
    members = set(piece)
    nodes = {n.name: n for n in fdef.node_def}
    refs = {}
    for name in piece:
        for ref in nodes[name].input:
            src = _source(ref)
            if not ref.startswith("^") and src not in members and \
                    not (src in nodes and _free(nodes[src])):
                refs.setdefault(ref, len(refs))
    return list(refs)


def _outline(fdef, piece, fn_name, call):
    """Move the nodes ``piece`` of ``fdef`` into a new compiled function ``fn_name``, called
    where they were by node ``call``; returns the call's inputs (refs in ``fdef``) and its
    outputs (``{ref of the piece: index}``). Constants read from outside are copied in (XLA needs
    some inputs, a ``Reshape``'s shape, as constants); control edges into or out of the piece
    become the call's."""
    members = set(piece)
    nodes = {n.name: n for n in fdef.node_def}
    body = function_pb2.FunctionDef()
    body.signature.name = fn_name
    body.attr["_XlaMustCompile"].b = True
    inputs, outputs = {}, {}  # tensor ref -> argument index, output index
    copied, controls = set(), set()
    for name in piece:
        node = body.node_def.add()
        node.CopyFrom(nodes[name])
        del node.input[:]
        for ref in nodes[name].input:
            src = _source(ref)
            if ref.startswith("^"):
                if src in members:
                    node.input.append(ref)
                else:
                    controls.add(ref)
            elif src in members:
                node.input.append(ref)
            elif src in nodes and _free(nodes[src]):
                if src not in copied:
                    copied.add(src)
                    body.node_def.add().CopyFrom(nodes[src])
                node.input.append(ref)
            else:
                node.input.append(f"a{inputs.setdefault(ref, len(inputs))}")
        if _stateful(node.op):
            body.control_ret[name] = name
            body.signature.control_output.append(name)
    types = _types(fdef)
    for ref, i in inputs.items():
        arg = body.signature.input_arg.add()
        arg.name, arg.type = f"a{i}", types(ref)

    def output(ref):
        if ref not in outputs:
            outputs[ref] = len(outputs)
            arg = body.signature.output_arg.add()
            arg.name, arg.type = f"o{outputs[ref]}", types(ref)
            body.ret[arg.name] = ref
        return f"{call}:output:{outputs[ref]}"

    for node in fdef.node_def:
        if node.name in members:
            continue
        refs = list(node.input)
        del node.input[:]
        for ref in refs:
            src = _source(ref)
            if src not in members:
                node.input.append(ref)
            elif ref.startswith("^"):
                if f"^{call}" not in node.input:
                    node.input.append(f"^{call}")
            else:
                node.input.append(output(ref))
    for key, ref in list(fdef.ret.items()):
        if _source(ref) in members:
            fdef.ret[key] = output(ref)
    for key, ref in list(fdef.control_ret.items()):
        if ref in members:
            fdef.control_ret[key] = call
    for node in body.node_def:
        for mark in _MARKS:
            node.attr.pop(mark, None)
    context.context().add_function_def(body)
    kept = [n for n in fdef.node_def if n.name not in members]
    del fdef.node_def[:]
    fdef.node_def.extend(kept)
    add_call(fdef, call, fn_name, list(inputs) + sorted(controls),
              [a.type for a in body.signature.input_arg],
              [a.type for a in body.signature.output_arg])
    return list(inputs), outputs


def add_call(fdef, call, fn_name, inputs, in_types, out_types):
    """Add node ``call`` to ``fdef``: a call of compiled function ``fn_name``."""
    node = fdef.node_def.add()
    node.name, node.op = call, "StatefulPartitionedCall"
    node.input.extend(inputs)
    node.attr["Tin"].list.type.extend(in_types)
    node.attr["Tout"].list.type.extend(out_types)
    node.attr["f"].func.name = fn_name
    node.attr["config_proto"].s = b""
    node.attr["executor_type"].s = b""
    node.attr["_XlaMustCompile"].b = True


def _types(fdef):
    """``ref -> dtype`` for the tensors of ``fdef`` (an argument, or ``node:arg:index``)."""
    args = {a.name: a.type for a in fdef.signature.input_arg}
    nodes = {n.name: n for n in fdef.node_def}

    def dtype(ref):
        if ":" not in ref:
            return args[ref]
        name, arg, index = ref.split(":")
        return output_types(nodes[name])[arg][int(index)]

    return dtype


def output_types(node):
    """``{output arg name: [dtype]}`` of a FunctionDef node."""
    op_def = op_def_registry.get(node.op)
    if op_def is None:  # a call of a library function by name
        signature = context.context().get_function_def(node.op).signature
        return {a.name: [a.type] for a in signature.output_arg}
    defaults = {a.name: a.default_value for a in op_def.attr}

    def attr(name):
        return node.attr[name] if name in node.attr else defaults[name]

    out = {}
    for arg in op_def.output_arg:
        if arg.type_list_attr:
            out[arg.name] = list(attr(arg.type_list_attr).list.type)
        else:
            dtype = arg.type or attr(arg.type_attr).type
            out[arg.name] = [dtype] * (attr(arg.number_attr).i if arg.number_attr else 1)
    return out


def _compilable(node):
    """Whether XLA has a CPU kernel for ``node`` that accepts its types. A fed value's
    ``EnsureShape`` stays outside: a compiled function then takes an input whose shape the
    traced graph knows, which ``terra.precompile`` can make."""
    if node.op == "EnsureShape":
        return False
    for kernel in _xla_kernels(node.op):
        if all(_allowed(node, c) for c in kernel.constraint):
            return True
    return False


def _allowed(node, constraint):
    allowed = set(constraint.allowed_values.list.type)
    value = node.attr.get(constraint.name)
    if value is None:
        return True  # left at its default, which the kernel accepts
    types = value.list.type if value.HasField("list") else [value.type]
    return all(t in allowed for t in types)


@functools.cache
def _xla_kernels(op_type):
    return [k for k in kernels.get_registered_kernels_for_op(op_type).kernel
            if k.device_type == "XLA_CPU_JIT"]


@functools.cache
def _stateful(op_type):
    op_def = op_def_registry.get(op_type)
    return op_def is None or op_def.is_stateful


def _free(node):
    """A constant with no inputs: copied into every piece that reads it, never moved."""
    return node.op == "Const" and not node.input


def _source(ref):
    """The node a FunctionDef input names (or the function argument)."""
    return ref.lstrip("^").split(":")[0]


def _sources(node):
    return [_source(ref) for ref in node.input]


def _topological(nodes):
    """The names of ``nodes`` in an order where every node follows its inputs."""
    pending = {name: {s for s in _sources(n) if s in nodes} for name, n in nodes.items()}
    users = collections.defaultdict(list)
    for name, srcs in pending.items():
        for src in srcs:
            users[src].append(name)
    ready = [name for name, srcs in pending.items() if not srcs]
    order = []
    while ready:
        name = ready.pop()
        order.append(name)
        for user in users[name]:
            pending[user].discard(name)
            if not pending[user]:
                ready.append(user)
    return order
