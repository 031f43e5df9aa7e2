"""The C fast path's calling convention, for ops the PythonRunner matches instead of running.

``TFE_Py_FastPathExecute`` takes an op's inputs and attrs as one flat argument list, reads
variable arguments itself, and returns one tensor, None or (nested) lists by the op's output
args. The runner takes the same arguments and must answer the same way.
"""

import numpy as np
from tensorflow.python.framework import ops
from tensorflow.python.ops import resource_variable_ops

_EagerTensor = ops.EagerTensor
_Variable = resource_variable_ops.BaseResourceVariable
_PLAIN = (int, float, bool, complex, np.ndarray, np.generic, str, bytes)


def flatten(info, inputs):
    """Fast-path arguments -> one entry per op input (list-valued inputs spread out)."""
    flat = []
    for k, a in enumerate(inputs):
        if info.list_inputs[k] and isinstance(a, (list, tuple)):
            flat.extend(a)
        else:
            flat.append(a)
    return flat


def fast_inputs(info, inputs):
    """Fast-path arguments that are not all EagerTensors, as the C fast path treats them:
    variables are read (here, through the door, so the read is matched like any op), plain
    Python values are left for conversion, anything else makes the fast path give up."""
    inputs = list(inputs)
    for k, a in enumerate(inputs):
        if type(a) is _EagerTensor:
            continue
        if isinstance(a, _Variable):
            inputs[k] = a.value()
        elif info.list_inputs[k] and isinstance(a, (list, tuple)):
            if not all(type(x) is _EagerTensor or isinstance(x, _PLAIN) for x in a):
                raise fallback_exception()
        elif not isinstance(a, _PLAIN) and not _plain_nested(a):
            raise fallback_exception()
    return inputs


def _plain_nested(a):
    if isinstance(a, (list, tuple)):
        return all(isinstance(x, _PLAIN) or _plain_nested(x) for x in a)
    return False


def fallback_exception():
    from tensorflow.python.eager import core

    return core._FallbackException()


def pack_fast(plan, outs):
    """Shape results like ``TFE_Py_FastPathExecute`` by ``plan`` (:func:`pack_plan`): one
    tensor, None, or (nested) lists."""
    if plan == "one":
        return outs[0]
    if plan == "all":
        return outs
    if plan == "none":
        return None
    grouped, k = [], 0
    for n in plan:
        if n is None:
            grouped.append(outs[k])
            k += 1
        else:
            grouped.append(outs[k:k + n])
            k += n
    return grouped


def pack_plan(info, step):
    """"one", "all", "none", or per output arg its list length (None: a single tensor)."""
    args = info.op_def.output_arg
    if not args:
        return "none"
    if len(args) == 1:
        return "all" if args[0].number_attr or args[0].type_list_attr else "one"
    attrs = dict(step.attrs)
    return tuple(attrs[a.number_attr] if a.number_attr else
                 len(attrs[a.type_list_attr]) if a.type_list_attr else None for a in args)
