"""Emission of a loop node (paper §3.2.2, ``terra.loops``): a While whose Loop Cond the
PythonRunner feeds after each trip, and before the first rolled one.

The loop variables are a token, which orders a trip's dequeues after the previous trip's
fetches (Fig. 3.4 across trips), and the body's values read by the next trip or after the
loop, starting from the last peeled trip's. A value whose shape the body changes cannot be a
loop variable of a While: :class:`KeepUnrolled` tells the generator to leave that loop
unrolled.
"""

import collections

from tensorflow.python.framework import constant_op, ops, tensor_shape
from tensorflow.python.ops import array_ops, math_ops, while_loop

from terra.keys import Out, Phi, value_key
from terra.nodes import relax


class KeepUnrolled(Exception):
    """A loop's While, or TF's symbolic gradient through it, cannot be built: generate again
    with that loop unrolled."""

    def __init__(self, key):
        super().__init__(key)
        self.key = key


def emit_loop(em, step, env, last_fetch):
    """The loop node of ``step`` as a While, as ``em`` (the :class:`~terra.emitter.Emitter`)
    emits a step: its body's steps are emitted in the While's body function."""
    node = step.node
    carried = node.carried
    cond = em.conds[node]
    with ops.control_dependencies(last_fetch):
        token = array_ops.identity(constant_op.constant(0))
    start_values = [env[value_key(slot)] for slot in node.inputs]
    invariants = [tensor_shape.TensorShape([])] + [
        tensor_shape.TensorShape(relax(b.out_relaxed[k], slot.alts[0][0].out_relaxed[k]))
        .most_specific_compatible_shape(t.shape)
        for (b, k), slot, t in zip(carried, node.inputs, start_values, strict=True)]
    fetched = []

    def go_on(token, *_):
        return math_ops.not_equal(em.dequeue(cond, [token]), 0)

    def trip(token, *values):
        local = collections.ChainMap({}, env)
        for (b, k), v in zip(carried, values, strict=True):
            for sid in em.phi_of.get(Out(b, k), ()):
                local[Phi(sid)] = v
        trip_fetch = [token]
        for body_step in step.body:
            em.emit_op(body_step, local, trip_fetch)
        fetched.append(trip_fetch[0] is not token)
        with ops.control_dependencies(trip_fetch):
            token = array_ops.identity(token)
        return [token] + [local[Out(b, k)] for b, k in carried]

    em.looping = True
    try:
        with em.tapes.paused():
            outs = while_loop.while_loop(
                go_on, trip, [token] + start_values, shape_invariants=invariants,
                parallel_iterations=1, return_same_structure=True)
    except (ValueError, TypeError) as e:  # a value whose shape the body changes
        raise KeepUnrolled(em.loops[node]) from e
    finally:
        em.looping = False
    for (b, k), t in zip(carried, outs[1:], strict=True):
        em.define(env, Out(b, k), t)
    if any(fetched):
        last_fetch[:] = [outs[0].op]
