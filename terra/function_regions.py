"""Function regions: TF's own composite functions the skeleton skips, like a built-in layer.

Some TF functions are Python that issues ops: a tensor's slicing (``x[..., :2]``: TF parses
the spec and packs its bounds into constants for one ``StridedSlice``, ~40 us),
``tf.boolean_mask`` (shape arithmetic, a ``Where``, a ``Gather``: ~17 ops, ~0.5 ms),
``tf.nn.sigmoid_cross_entropy_with_logits`` (checks and seven ops), the softmax cross
entropies (checks, reshapes to rank 2 and back). In a user's loss they are most of what the
skeleton's Python does every step, although the graph holds their ops
and Python looks at none of their values. A call of one of :data:`FUNCTIONS` is therefore
recorded and skipped as a layer call is (``terra.layer_regions``, whose machinery it
shares): a ``call`` mark, the ops, a ``return`` mark; where the plan runs the ops between
them straight through, the PythonRunner hands Python stand-ins for what it returned and TF's
Python is not run.

The guard is the one a compiler would use for a pure function: the function is TF's own (the
one wrapped here; a user's function of the same name is not), and everything it reads is in
the call mark: its tensors as inputs (the same producers as in the traces), every other
argument by value (a slice spec's slices, ``Ellipsis`` and ``None``; ``name=``), but
integers, which a skip is learned for value by value (:func:`encode`). An argument of any
other kind (a NumPy array, a variable) and the call runs as usual, op by op.

Where the shape of what it returned depends on data (a mask's rows), the graph fetches it and
Python takes the real value, as it does for a ``Where`` on the per-op path
(``path.data_shaped_returns``). A call in the body of a loop whose trips the GraphGenerator
rolls into a While has no marks in the plan (``loops``: a trip is ops alike, ``x[:, t]``'s
``t`` a per-trip feed); there the call runs op by op (:func:`marked_here`).
"""

import functools
import sys
import threading

import numpy as np
from tensorflow.python.eager import context
from tensorflow.python.framework import ops

from terra import runtime
from terra.nodes import FUNCTION_TOKEN, NodeKind

_EagerTensor = ops.EagerTensor
_PHASES = ("tracing", "coexecution")

# (module, class or None, attribute): the functions wrapped. TF's public names
# (``tf.boolean_mask``, ``tf.nn.sigmoid_cross_entropy_with_logits``) are thin wrappers that
# call these by their module's global name.
FUNCTIONS = (
    ("tensorflow.python.framework.tensor", "Tensor", "__getitem__"),
    ("tensorflow.python.ops.array_ops", None, "boolean_mask"),
    ("tensorflow.python.ops.nn_impl", None, "sigmoid_cross_entropy_with_logits"),
    # what tf.nn.(sparse_)softmax_cross_entropy_with_logits and Keras 3's categorical losses
    # call: shape checks, reshapes to rank 2 and back, a cast (GPT-2's loss: ~1.5 ms a step)
    ("tensorflow.python.ops.nn_ops", None, "sparse_softmax_cross_entropy_with_logits"),
    ("tensorflow.python.ops.nn_ops", None, "softmax_cross_entropy_with_logits_v2_helper"),
)
_installed = set()


def install():
    """Wrap each of :data:`FUNCTIONS` whose module is imported (TF's are, with TF)."""
    for module_name, cls_name, attr in FUNCTIONS:
        module = sys.modules.get(module_name)
        if (module_name, cls_name, attr) in _installed or module is None:
            continue
        owner = module if cls_name is None else getattr(module, cls_name)
        original = getattr(owner, attr)
        _installed.add((module_name, cls_name, attr))
        name = attr if cls_name is None else f"{cls_name}.{attr}"
        setattr(owner, attr, _wrap(original, name))


def _wrap(original, name):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        rt = runtime.current()
        if rt is None or rt.phase not in _PHASES or rt.layers.depth or rt.regions.depth or \
                not context.executing_eagerly() or rt.layer_owner != threading.get_ident():
            return original(*args, **kwargs)
        return rt.layers.function(rt, original, name, args, kwargs)
    return wrapper


def marked_here(runner, name):
    """Whether the plan has a call mark of function ``name`` where co-execution is: a step
    after the current one. Not where a rolled loop's body has the function's ops alone, nor
    where its ops come unmarked into a loop's next trip: the call runs op by op. Asked once
    per step and name (``PythonRunner.marked``: the plan does not change)."""
    key = (runner.cur, name)
    found = runner.marked.get(key)
    if found is None:
        found = runner.marked[key] = any(
            s is not None and s.kind is NodeKind.MARK and s.op_type == "call" and
            s.attrs[0] == name and s.attrs[1] == FUNCTION_TOKEN for s in runner.cur.next)
    return found


def encode(args, kwargs):
    """``(tensors, leaves, ints)``: the call's tensors in order; its arguments as a hashable
    value, ``"t"`` for each tensor and ``"i"`` for each integer; the integers, in order.
    Integers are apart because a training loop's ``labels[step]`` changes them every step:
    the traced ops read them as constants that become fed values, and a skip is learned
    per value (``skips.RegionSkips.layer_call``), where a call mark of its own per value
    would be a new path every step. None if an argument is of a kind not checked by value
    (then the call is no region)."""
    tensors, ints = [], []
    try:
        leaves = (_leaf(args, tensors, ints),
                  tuple([(k, _leaf(v, tensors, ints)) for k, v in sorted(kwargs.items())])
                  if kwargs else ())
    except _NotEncodable:
        return None
    return tensors, leaves, tuple(ints)


class _NotEncodable(Exception):
    pass


def _leaf(x, tensors, ints):
    kind = type(x)
    if kind is _EagerTensor:
        tensors.append(x)
        return "t"
    if kind is int:
        ints.append(x)
        return "i"
    if kind is str or x is None:
        return x
    if kind is slice:  # its bounds: mostly None, no call for those
        start, stop, step = x.start, x.stop, x.step
        return ("slice", start if start is None else _leaf(start, tensors, ints),
                stop if stop is None else _leaf(stop, tensors, ints),
                step if step is None else _leaf(step, tensors, ints))
    if kind is tuple or kind is list:
        return (kind.__name__, tuple([_leaf(v, tensors, ints) for v in x]))
    if kind is bool or kind is float:  # not equal to an int of the same value as a key
        return (kind.__name__, x)
    if x is Ellipsis:
        return ("...",)
    if isinstance(x, np.integer):
        ints.append(x.item())
        return ("np", x.dtype.str)
    if isinstance(x, np.bool_):
        return ("np", x.dtype.str, x.item())
    raise _NotEncodable
