"""The user's tapes, again in the graph: TF's symbolic gradient summed as the tape summed.

Where a region's backward values follow shapes that change with data (a boolean mask's row
count), the graph computes its gradient itself rather than replaying the recorded backward
ops (``graph_builder._symbolic``). ``tf.gradients`` would do it, but it walks the graph in
its own order and adds the gradients a tensor receives from several consumers in another
order than the tape: on YOLOv3's loss 66 of its 78 variable gradients differed from eager's
in the last bits (1.8e-6 relative), which training grew past 1e-4 within 54 steps. A
``tf.GradientTape`` running while the graph is built (as one inside a ``tf.function`` does)
sums in the tape's order: the same 78 gradients were bit-identical to eager's.

So emission mirrors what the user's tapes did: a tape enter mark starts a graph tape, a
watch mark watches the same values, an exit mark stops it recording, and every forward op
emitted in between is recorded on it with its inputs, outputs and attributes, as TF's eager
executor records an op (emission creates ops with ``Graph.create_op``, which records
nothing). The gradient call then asks that tape, whose C++ backward pass is the one eager
ran, calling the same gradient functions in graph mode, where they compute shapes at run
time.

Only tapes some region needs are made (:func:`needs_tape`). A region whose forward pass
runs through a loop's ``While``, a switch-case or a library function call is not recorded
faithfully this way (those ops are built by TF's control-flow code, or recorded by eager
with the function's own backward function): it keeps ``tf.gradients``
(:meth:`GraphTapes.covers`). Recording pauses while such ops are built.
"""

import contextlib

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop
from tensorflow.python.eager import record as recording
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients

from terra import opdefs, regions
from terra.nodes import NodeKind, SlotKind


def needs_tape(node) -> bool:
    """Whether gradient region ``node`` emitted symbolically takes its tape's gradient: a
    region made for one forward path (not merged over a loop's trip counts nor folded over
    paths, whose forward ops a tape would not have recorded once) whose tape watched the
    same variables in every trace."""
    return node.rolled is None and not regions.folded(node) and node.watched is not None


class GraphTapes:
    """The graph tapes of one emission, for the gradient ``regions`` emitted symbolically;
    enter marks with attributes (``TerraGradientTape.mark_attrs``) none of them has make no
    graph tape. ``capture``: a variable's eager handle -> the graph's."""

    def __init__(self, regions, capture):
        self._wanted = {}  # attrs -> handles of the variables a tape with them watches
        for node in regions:
            if needs_tape(node):
                handles = self._wanted.setdefault(node.attrs[0], {})
                handles.update((h._id, h) for h in node.watched)
        self._capture = capture
        self._unfaithful = set()  # ids of the graph tapes that are not eager's (record())
        self._open = []  # [attrs, tape, recording] per graph tape entered, innermost last
        self._last = {}  # attrs -> the graph tape last entered with them (a gradient's)
        self._paused = 0

    @property
    def recording(self) -> bool:
        """Whether a graph tape records what is emitted now (one entered and not stopped,
        outside a loop or switch-case)."""
        return not self._paused and any(live for _, _, live in self._open)

    def enter(self, attrs, again=False):
        """A tape enter mark; ``again``: a tape entered again, whose regions are not taped
        (``trace_queries.taped``): a placeholder its exit mark closes."""
        if again:
            self._open.append([attrs, None, False])
            return
        if attrs not in self._wanted:
            return
        if self._paused:  # entered inside a loop or switch-case: no region can use it
            self._last.pop(attrs, None)
            return
        tape = backprop.GradientTape(persistent=True, watch_accessed_variables=False)
        variables = [self._capture(h) for h in self._wanted[attrs].values()]
        with _live():
            tape._push_tape()
            tape.watch(variables)  # eager's watched each as it was first read: no earlier op
        self._open.append([attrs, tape, True])
        self._last[attrs] = tape

    def exit(self, attrs):
        if self._paused:
            return
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == attrs:
                self._stop(self._open.pop(i))
                return

    def watch(self, attrs, tensors):
        """A watch mark: the innermost tape entered with ``attrs`` watches ``tensors``."""
        for a, tape, _ in reversed(self._open):
            if a == attrs:
                if tape is not None:
                    with _live():
                        tape.watch(tensors)
                return

    def called(self, node):
        """Gradient call ``node`` (before it is emitted, either way) stops its tape recording
        if that is not persistent, as ``tf.GradientTape.gradient`` inside its ``with`` does."""
        tape = self._last.get(node.attrs[0])
        if not node.attrs[0][0]:
            for entry in self._open:
                if entry[1] is tape:
                    self._stop(entry)

    @staticmethod
    def _stop(entry):
        if entry[2]:
            entry[1]._pop_tape()
            entry[2] = False

    def record(self, node, op, inputs=None, outputs=None, attrs=None):
        """Record ``node``'s emitted forward op on the recording tapes, as eager's executor
        did: graph op ``op``, or an op of ``node``'s type reading ``inputs``, giving
        ``outputs``, with ``attrs`` ``(name, value, ...)`` that stands for it. Where eager's
        tapes may have recorded what these do not (an op that ran with the tapes paused in
        one trace only; a library function's call, which eager records with the function's
        own backward function), their numbering is not eager's: they are :meth:`unfaithful`."""
        if not self.recording:
            return
        if inputs is None:
            inputs, outputs = list(op.inputs), list(op.outputs)
        if opdefs.info(node.op_type).op_def is None:  # (its call pauses the tapes around it)
            with _live():
                if recording.should_record_backprop(inputs):
                    self.unfaithful()
            return
        if node.untaped:
            return
        if node.untaped is None:
            self.unfaithful()
            return
        if attrs is None:
            attrs = tuple(x for name in op.node_def.attr for x in (name, op.get_attr(name)))
        with _live():
            backprop.record_gradient(node.op_type, inputs, attrs, outputs)

    def unfaithful(self):
        """The recording tapes no longer number ops as eager's did: no gradient from them."""
        for _, tape, live in self._open:
            if live:
                self._unfaithful.add(id(tape))

    @contextlib.contextmanager
    def emission(self):
        """The whole emission: nothing is recorded but what these methods record. Eager's
        tape numbered the ops it recorded, and the order its backward pass adds gradients in
        follows those numbers: an op of Terra's own recorded among them (a fetch's
        ``Identity``) would renumber the rest, and sum them otherwise."""
        if not self._wanted:
            yield
            return
        with recording.stop_recording():
            try:
                yield
            finally:
                for entry in self._open:
                    self._stop(entry)

    @contextlib.contextmanager
    def paused(self):
        """Build a loop or switch-case: its ops are TF's control flow, not recorded."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def covers(self, step, steps) -> bool:
        """Whether region ``step``'s gradient can be its graph tape's: it needs one, its tape
        was entered at the top of the graph, and every forward op of its cone was emitted
        there, recorded op by op."""
        node = step.node
        tape = self._last.get(node.attrs[0])
        if not needs_tape(node) or tape is None or id(tape) in self._unfaithful:
            return False
        return all(steps[p].kind is NodeKind.OP and p.loop is None and
                   opdefs.info(p.op_type).op_def is not None
                   for kind, p, _ in node.cone.values() if kind is SlotKind.NODE)

    def gradient(self, node, targets, sources, output_gradients):
        """Region ``node``'s gradient, from the graph tape its tape's enter mark made (after
        :meth:`called`)."""
        unconnected = UnconnectedGradients[node.attrs[4].split(".")[-1]]
        with _live():  # the backward ops are recorded on the tapes still recording, as eager's
            return self._last[node.attrs[0]].gradient(
                targets, sources, output_gradients, unconnected_gradients=unconnected)


@contextlib.contextmanager
def _live():
    """Recording on again for what a graph tape does inside :meth:`GraphTapes.emission`."""
    pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        yield
    finally:
        pywrap_tfe.TFE_Py_TapeSetStopOnThread()
