"""The tape's events in co-execution, the PythonRunner's part (a mixin: it reads the
runner's iteration, plan and checks, and moves it along its path): a tape's marks (enter,
exit, watch) matched like ops, a ``tape.gradient`` call passed whole, as one step whose
results are stand-ins (the graph runs the backward ops: section 3.4), and the backward
functions of ``tf.custom_gradient`` kept for a replay.
"""

from tensorflow.python.framework import ops
from tensorflow.python.util import nest

from terra.divergence import Divergence
from terra.fallback import GradientCall, LoggedCustomGradient, LoggedGradient, LoggedMark
from terra.nodes import NodeKind
from terra.standins import leaves, to_indexed_slices

_EagerTensor = ops.EagerTensor


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
        flat = [self._gradient_result(r) for r in step.results]
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

    def _gradient_result(self, r):
        """One flat result of a gradient call (``Step.results``): None, a stand-in, or the
        IndexedSlices of stand-ins."""
        if r is None:
            return None
        if r[0] == "t":
            return self._result(*r[1])
        return to_indexed_slices(*[None if p is None else self._result(*p) for p in r[1:]])

    def _result(self, node, out):
        """The stand-in of output ``out`` of ``node``, a backward op Python skipped; fetched
        where its shape can vary (unless known: ``graph_builder._result_shapes``)."""
        step = self.step_of[node]
        outs, entries = self.standins.make(self.it, step, (node.out_specs[out],),
                                           self.visits.get(step, 0), self.seq, out)
        if step.fetch[out] is not None and not step.known_shape[out] and \
                (step.dynamic or len(node.sigs) > 1):
            return self._fetched(entries[0])
        return outs[0]

    def _entries_of(self, structure):
        tensors = self.tensors
        return nest.map_structure(
            lambda x: tensors.get(x._id, x) if type(x) is _EagerTensor else x, structure)
