"""Emission of a gradient region (paper §3.2.2): the backward ops the trace recorded, or, where
they read values that change with shapes, TF's symbolic gradient of the graph's forward ops.

The symbolic gradient comes from the graph tape that mirrors the region's tape where it can
(``terra.graph_tapes``: summed in the tape's order, bit for bit eager's), else from
``tf.gradients``. Either must be structured as the tape's gradient was (a dense tensor or
``IndexedSlices`` per source, ``None`` where the tape gave none); where it is not, or TF has
no gradient for an op, :class:`NotSymbolic` tells the generator to emit the recorded ops.
"""

from tensorflow.python.framework import ops
from tensorflow.python.ops import gradients_impl
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

from terra.graph_ops import keep_eager_rounding
from terra.xla import fixed_shapes


class NotSymbolic(Exception):
    """TF's symbolic gradient of a region does not stand for its tape's: emit its recorded
    backward ops instead."""

    def __init__(self, node):
        super().__init__(node)
        self.node = node


def emit_region(em, step, env, last_fetch):
    """A gradient region, as ``em`` (the :class:`~terra.emitter.Emitter`) emits a step: its
    recorded backward ops, which Python skips, or TF's symbolic gradient."""
    em.tapes.called(step.node)
    if step.node in em.symbolic:
        _emit_symbolic(em, step, env, last_fetch)
        return
    for body_step in step.body:
        em.emit_op(body_step, env, last_fetch)


def _emit_symbolic(em, step, env, last_fetch):
    node = step.node
    graph = ops.get_default_graph()
    n_ops = len(graph.get_operations())
    _, n_target, n_sources, no_output_gradients, unconnected = node.attrs
    tensors = [em.slot_tensor(step, i, slot, env, last_fetch)
               for i, slot in enumerate(step.slots)]
    targets, sources = tensors[:n_target], tensors[n_target:n_target + n_sources]
    output_gradients = None if no_output_gradients else tensors[n_target + n_sources:]
    try:
        if em.tapes.covers(step, em.steps):
            grads = em.tapes.gradient(node, targets, sources, output_gradients)
        else:
            grads = gradients_impl.gradients(
                targets, sources, output_gradients,
                unconnected_gradients=UnconnectedGradients[unconnected.split(".")[-1]])
    except (LookupError, ValueError, TypeError) as e:  # e.g. an op with no gradient
        raise NotSymbolic(node) from e
    replaced = {}
    if em.exact:  # (a graph tape recording would not know the replacement: kept)
        replaced = keep_eager_rounding(graph.get_operations()[n_ops:],
                                       reorder=not em.tapes.recording)
    if em.xla and not any(em.steps[p].check_shapes or not fixed_shapes(p)
                          for _, p, _ in node.cone.values()):
        em.for_xla(graph, n_ops)
    for result, g in zip(node.results, grads, strict=True):
        parts = (None,) if g is None else (
            (g.values, g.indices, g.dense_shape) if hasattr(g, "indices") else (g,))
        if result is None and g is None:
            continue
        if result is None or len(result) - 1 != len(parts) or any(
                (p is None) != (t is None) for p, t in zip(result[1:], parts)):
            raise NotSymbolic(node)  # structured unlike the tape's gradient
        for p, t in zip(result[1:], parts, strict=True):
            if p is not None:
                t = replaced.get(t.ref(), t)
                em.output(em.steps[p[0]], p[1], t, env, last_fetch)
