"""The tape's events in co-execution, the PythonRunner's part (a mixin: it reads the
runner's iteration, plan and checks, and moves it along its path): a tape's marks (enter,
exit, watch) matched like ops, a ``tape.gradient`` call passed whole, as one step whose
results are stand-ins (the graph runs the backward ops: section 3.4), and the backward
functions of ``tf.custom_gradient`` kept for a replay.

A result whose shape varies (an ``Embedding``'s sparse gradient, as long as the batch's
sequence) would be fetched for its shape at every call, and each fetch waits for the backward
pass. Its shape follows from what the graph was fed before the call, which the iteration's
signature holds (``trace_queries.signature_part``: shapes and tiny integers of every value
fed, the shapes of data-dependent outputs): once two calls with one signature were fetched
with the same shapes, later calls with it get stand-ins of those shapes, as a layer region's
learned shapes (``skips.Learned``).
"""

from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from terra.divergence import Divergence
from terra.fallback import GradientCall, LoggedCustomGradient, LoggedGradient, LoggedMark
from terra.nodes import NodeKind
from terra.standins import leaves, to_indexed_slices

_EagerTensor = ops.EagerTensor
MAX_SHAPE_KEYS = 64  # signatures learned per gradient call (a length per batch: a few)


class TapeEvents:
    """The PythonRunner's methods for tape events."""

    def mark(self, what, attrs, tensors, tape, variables=()):
        """A tape's (``tape``; None: a library region's) mark; ``variables``: for a watch, the
        variable each handle in ``tensors`` stands for (None for a tensor), which a replay
        has the real tape watch."""
        step = self._expect(NodeKind.MARK, what, lambda s: s.attrs == attrs)
        if step.attrs != attrs:
            raise Divergence(f"tape {what} with different settings", "attribute change")
        inputs = self.checks.inputs(self.it, step, list(tensors), feed=False)
        self.it.log.append(LoggedMark(step, inputs, tape, variables))
        self._logged_move(step, None)

    def watched(self, attrs, tape):
        """``tape.watched_variables()``: the answer the traces recorded at this point."""
        step = self._expect(NodeKind.MARK, "watched", lambda s: s.attrs[0] == attrs)
        if step.attrs[0] != attrs:
            raise Divergence("tape watched_variables with different settings",
                             "attribute change")
        self.it.log.append(LoggedMark(step, [], tape))
        answer = tuple(ref.deref() for ref in step.attrs[1])
        self._logged_move(step, answer)
        return answer

    def gradient(self, attrs, tensors, extra):
        """Validate a ``tape.gradient`` call and return stand-ins for its flat results."""
        it, checks = self.it, self.checks
        step = self._expect(NodeKind.GRAD, "gradient",
                            lambda s: s.attrs == attrs and checks.gradient_fits(it, s, tensors))
        if step.attrs != attrs:
            raise Divergence("gradient call with different arguments", "attribute change")
        inputs = checks.inputs(it, step, list(tensors), feed=False)
        values = checks.gradient_call(it, step, inputs)
        if values is not None:
            for channel, value in zip(step.backward_feeds[0], values):
                channel.put(value)
        table = self.result_shapes.get(step) if it.signature is not None else None
        key = None if table is None else tuple(it.signature)
        learned = None if table is None else table.get(key)
        shapes = learned[0] if learned is not None and learned[1] else None
        fetched = {}
        flat = [self._gradient_result(r, shapes, fetched) for r in step.results]
        if table is not None and fetched and shapes is None:
            _learn_shapes(table, key, learned, fetched)
        tape, target, sources, output_gradients, unconnected = extra
        # the log names stand-ins by their entries: holding a stand-in would make it look
        # alive to finish() (an escape) although Python dropped it
        it.log.append(LoggedGradient(step, inputs, leaves(flat, self.tensors), GradientCall(
            tape, self._entries_of(target), self._entries_of(sources),
            self._entries_of(output_gradients), unconnected)))
        for body_step in step.body:  # the graph fills their channels whether or not Python looks
            if body_step.has_fetch:
                self._visit(body_step)
        self._logged_move(step, flat)
        return flat

    def custom_gradient(self, op_type, outputs, inputs, backward):
        """``tf.custom_gradient`` recorded its backward function for outputs of ops already
        matched: keep it (stand-ins by their entries) for a replay."""
        it = self.it
        it.customs.append(LoggedCustomGradient(len(it.log), op_type,
                                               self._entries_of(list(outputs)),
                                               self._entries_of(list(inputs)), backward))

    def _gradient_result(self, r, shapes, fetched):
        """One flat result of a gradient call (``Step.results``): None, a stand-in, or the
        IndexedSlices of stand-ins (``shapes``, ``fetched``: see ``_result``)."""
        if r is None:
            return None
        if r[0] == "t":
            return self._result(*r[1], shapes, fetched)
        return to_indexed_slices(*[None if p is None else self._result(*p, shapes, fetched)
                                   for p in r[1:]])

    def _result(self, node, out, shapes=None, fetched=None):
        """The stand-in of output ``out`` of ``node``, a backward op Python skipped; fetched
        where its shape can vary (unless known: ``graph_builder._result_shapes``, or learned
        for the iteration's signature: ``shapes``), its shape then noted in ``fetched``."""
        step = self.step_of[node]
        spec = node.out_specs[out]
        shaped = shapes is not None and (node, out) in shapes
        if shaped:
            spec = (shapes[(node, out)], spec[1])
        outs, entries = self.standins.make(self.it, step, (spec,),
                                           self.visits.get(step, 0), self.seq, out)
        if not shaped and _shape_fetched(step, out):
            value = self._fetched(entries[0])
            if fetched is not None:
                fetched[(node, out)] = value._shape_tuple()
            return value
        return outs[0]

    def _entries_of(self, structure):
        tensors = self.tensors
        return nest.map_structure(
            lambda x: tensors.get(x._id, x) if type(x) is _EagerTensor else x, structure)


def _shape_fetched(step, out):
    """Whether output ``out`` of backward step ``step``, a gradient result, is fetched for
    its shape: its shape varies and is not the variable's."""
    return step.fetch[out] is not None and not step.known_shape[out] and \
        (step.dynamic or len(step.node.sigs) > 1)


def result_shape_tables(graph, signed):
    """Per gradient step of ``graph`` whose results' shapes are learned by the iteration's
    signature, its table (signature -> ``[shapes, agreed]``, filled in co-execution): none
    where a region is fed backward values (``signed``), whose signature a Python-run op's
    output shapes would have to join."""
    if signed:
        return {}
    return {s: {} for s in graph.steps.values()
            if s.kind is NodeKind.GRAD and _learns_shapes(graph, s)}


def _learn_shapes(table, key, learned, fetched):
    """The result shapes ``fetched`` at a call with signature ``key`` (``learned``: what
    ``table`` held for it): kept the first time, trusted when a second call agrees; a
    disagreement (a shape the signature does not decide) keeps the key fetching for the
    run."""
    if learned is None:
        if len(table) < MAX_SHAPE_KEYS:
            table[key] = [fetched, False]
    elif learned[1] is False:
        learned[1] = None if learned[0] != fetched else True


def _learns_shapes(graph, step):
    """Whether gradient step ``step`` of ``graph`` has results fetched for their shapes that
    the iteration's signature decides: some, none of them seen to have a shape that depends
    on data (``TraceNode.data_dependent``: equal input shapes, different output shapes), and
    one forward pass per region. A region folded over the paths or merged over a loop's trip
    counts (``TraceNode.rolled``), or a graph with a loop node, may differentiate forward
    passes of other shapes for one signature: which case or how many trips Python chose is
    not in it."""
    if step.node.rolled or graph.loops:
        return False
    step_of = graph.steps
    parts = [step_of[p[0]] for r in step.results or () if r is not None for p in r[1:]
             if p is not None and _shape_fetched(step_of[p[0]], p[1])]
    return bool(parts) and not any(s.node.data_dependent for s in parts)
