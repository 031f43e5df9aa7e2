"""XLA's compilation of a new graph's compiled functions, before co-execution begins.

XLA compiles a function at its first call. Left to the graph's first call, that is the first
co-executed iteration, which then waits for every segment in turn (YOLOv3: 15 s, DCGAN: 5 s),
where it measures as a slow co-executed iteration. Here each compiled function of the graph's
body is called once, right after generation, on fresh variables and tensors of the shapes the
traced graph holds (integers with the values its static shapes give, zeros otherwise:
:class:`_Arg`): XLA's cache is keyed by
the function and its arguments' shapes and types, so the graph's first call finds them
compiled. The call goes through a caller built like the graph's call (a
``StatefulPartitionedCall`` with ``_XlaMustCompile`` inside a function): XLA's cache for
calls from a graph is not the one for a function run eagerly.

The training loop waits for it, as a ``tf.function(jit_compile=True)`` step waits at its
first call. Compiling in the background while the loop ran eager iterations was measured and
dropped: on two cores the compilations and the eager iterations beside them slowed each other
(DCGAN still compiling after 38 iterations, below eager's speed). With the loop waiting, the
functions compile side by side in one thread per core, and the graph's instantiation
(``terra.background.instantiate``) with them.

Every compiled function of the body has inputs of known shapes (``xla.compile_segments``
leaves the pieces of others as TF ops, and :func:`argument_spec` is what it asks). One that
fails on these arguments (an integer XLA compiles for the value of, which the static shapes
do not give), and those of a switch-case's branches, compile at the graph's first call;
:func:`compile_before_use` says how many were compiled here.
"""

import collections
import concurrent.futures
import os

import numpy as np
from tensorflow.core.framework import function_pb2
from tensorflow.python.eager import context, execute
from tensorflow.python.framework import constant_op, dtypes, errors, tensor_shape, tensor_util
from tensorflow.python.ops import array_ops, resource_variable_ops

from terra import background
from terra.xla import add_call, output_types


def compile_before_use(graph):
    """Instantiate ``graph`` and compile its XLA functions, side by side, one thread per
    core; returns how many of its functions were compiled (the rest compile at their first
    call)."""
    calls = [_Call(name, specs, graph.call_attrs) for name, specs in graph.xla_segments]
    workers = max(1, len(os.sched_getaffinity(0)))
    with concurrent.futures.ThreadPoolExecutor(workers, "terra-xla") as pool:
        jobs = [pool.submit(background.instantiate, graph)]
        jobs += [pool.submit(call) for call in sorted(calls, key=lambda c: -c.size)]
        results = [job.result() for job in jobs]
    return sum(results[1:])


class _Arg(collections.namedtuple("_Arg", "dtype shape variable value")):
    """A compiled function's argument as the traced graph knows it: a variable's handle
    (``variable``: a fresh variable of its dtype and shape stands in), or a tensor, whose
    ``value`` is known for an integer the graph computes from static shapes and constants
    (None otherwise: zeros stand in). XLA takes some arguments as compile-time constants (a
    ``Conv2DBackpropFilter``'s filter sizes) and compiles for their value: zeros there would
    compile another entry, or fail."""

    def make(self, held):
        if self.variable:
            held.append(resource_variable_ops.ResourceVariable(
                array_ops.zeros(self.shape, self.dtype)))
            return held[-1].handle
        if self.value is not None:
            return constant_op.constant(self.value, self.dtype)
        return array_ops.zeros(self.shape, self.dtype)


class _Call:
    """One compiled function's first call: its caller (built here, in the loop's thread:
    registering a function is not for the pool's threads) and the specs of its arguments
    (``specs``)."""

    def __init__(self, name, specs, attrs):
        self.name, self.specs, self.attrs = name, specs, attrs
        self.size = len(context.context().get_function_def(self.name).node_def)
        self.caller = _caller(self.name, [dtypes.resource.as_datatype_enum if a.variable
                                          else a.dtype for a in self.specs])

    def __call__(self):
        """Call the function once (in a pool thread, whose ops Terra does not intercept);
        whether it compiled."""
        held = []  # the fresh variables, alive until the call is over
        args = [a.make(held) for a in self.specs]
        try:
            execute.execute(self.caller, 0, args, self.attrs, context.context())
        except errors.OpError:
            return False  # arguments it cannot take: compiled at the graph's first call
        return True


def argument_spec(function):
    """``ref -> _Arg`` for the tensors of ``function``'s body (``node:arg:index``, or an
    argument: a captured tensor, or a captured variable's handle), None where the shape is not
    fully known."""
    graph = function.graph
    fdef = context.context().get_function_def(function._inference_function.name.decode())
    nodes = {n.name: n for n in fdef.node_def}
    # the body's arguments are its captures, in order
    captured = dict(zip((a.name for a in fdef.signature.input_arg), function.captured_inputs))

    def tensor(t, value):
        if not t.shape.is_fully_defined():
            return None
        known = value(t) if t.dtype.is_integer else None
        return _Arg(t.dtype.as_datatype_enum, t.shape.as_list(), False, known)

    def spec(ref):
        if ":" not in ref:
            t = captured.get(ref)
            if t is None:
                return None
            if t.dtype != dtypes.resource:
                return tensor(t, lambda t: t.numpy())
            data = getattr(t, "_handle_data", None)
            if not data or not data.shape_and_type:
                return None
            part = data.shape_and_type[0]
            shape = tensor_shape.TensorShape(part.shape)
            return _Arg(part.dtype, shape.as_list(), True, None) \
                if shape.is_fully_defined() else None
        node, arg, index = ref.split(":")
        flat = 0
        for name, types in output_types(nodes[node]).items():
            if name == arg:
                break
            flat += len(types)
        t = graph.get_operation_by_name(node).outputs[flat + int(index)]
        return None if t.dtype == dtypes.resource else tensor(t, _static_value)

    return spec


def _static_value(t):
    """The value of integer graph tensor ``t`` if static shapes and constants give it:
    ``tensor_util.constant_value``, and the ops it does not know that a gradient computes a
    compiled function's constant arguments with (a convolution's ``ShapeN``, a ``Tile``'s
    ``Reshape`` of a ``Transpose``)."""
    op = t.op
    if op.type == "ShapeN":
        shape = op.inputs[t.value_index].shape
        return np.array(shape.as_list(), t.dtype.as_numpy_dtype) \
            if shape.is_fully_defined() else None
    if op.type in ("Reshape", "Transpose"):
        x, arg = (_static_value(i) for i in op.inputs)
        if x is None or arg is None:
            return None
        return np.reshape(x, arg) if op.type == "Reshape" else np.transpose(x, arg)
    return tensor_util.constant_value(t)


def _caller(fn_name, in_types):
    """A function that calls compiled function ``fn_name`` as the generated graph does."""
    callee = context.context().get_function_def(fn_name).signature
    fdef = function_pb2.FunctionDef()
    fdef.signature.name = f"{fn_name}_caller"
    for i, dtype in enumerate(in_types):
        arg = fdef.signature.input_arg.add()
        arg.name, arg.type = f"a{i}", dtype
    add_call(fdef, "call", fn_name, [f"a{i}" for i in range(len(in_types))], in_types,
             [a.type for a in callee.output_arg])
    fdef.control_ret["call"] = "call"
    fdef.signature.control_output.append("call")
    fdef.signature.is_stateful = True
    context.context().add_function_def(fdef)
    return fdef.signature.name
