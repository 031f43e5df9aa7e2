"""Emission: the plan's steps as the ops of one ConcreteFunction (paper §3.2.2).

Graph-side ops are recreated from their recorded type and attributes with ``create_op``
(a ``tf.function`` call, the rounding guards and XLA marks: ``terra.graph_ops``); TF's
automatic control dependencies order variable reads and writes as the trace did. Input
Feeding points become ``QueueDequeueV2`` on a per-point queue, Output Fetching points
``QueueEnqueueV2``; every dequeue waits for the enqueues of fetch points that precede it in
Python's order (Fig. 3.4), so the graph never waits for a value Python can only produce after
a fetch the graph has not served yet.

Switch-cases with several cases become ``tf.switch_case``s whose index the PythonRunner
feeds; values cross them as the ``tf.switch_case``'s outputs (a branch that did not compute
a value returns a placeholder of its dtype and shape, never read). An input that joins paths
(a ``phi`` slot) reads whichever of its producers ran last: in the graph, a running value
each of them overwrites.

One :class:`Emitter` per generation walks the plan with one dispatch on the step's kind: an
op or a tape mark here, a gradient region (``terra.region_emission``) or a loop node
(``terra.loop_emission``) by the functions there, which use the Emitter's ``emit_op``,
``slot_tensor``, ``output``, ``dequeue`` and ``define``. An error while emitting a step is
re-raised naming the node and the user's line that issued it.
"""

import collections
import functools
import itertools

import numpy as np
from tensorflow.python.framework import constant_op, ops
from tensorflow.python.ops import array_ops, control_flow_switch_case

from terra import opdefs
from terra.commit import may_write
from terra.folding import LocalSteps, static_value
from terra.graph_ops import (
    add_in_order,
    call_function,
    keep_eager_rounding,
    mark_for_xla,
    placeholder,
    reorders,
)
from terra.graph_tapes import GraphTapes
from terra.keys import Out, Phi, Read, spec, value_key
from terra.loop_emission import KeepUnrolled, emit_loop
from terra.nodes import NodeKind, SlotKind
from terra.plan import shape_fn_decides
from terra.queues import Channel
from terra.region_emission import NotSymbolic, emit_region
from terra.xla import fixed_shapes

# Outputs whose graph shape TF leaves unknown although it depends on nothing but the input
# shapes (a kernel's scratch space): not data-dependent, so not fetched
_SCRATCH_OUTPUTS = {"FusedBatchNormV3": frozenset({5}), "_FusedBatchNormEx": frozenset({5})}

class EmissionError(RuntimeError):
    """An error while emitting one step: names the node, which ends with the user's line
    that issued it (``TraceNode.format``)."""


class Emitter:
    """The body of one generation's function: every switch-case of the plan, in order.

    ``steps``: the plan's Steps by node; ``planned``: ``[(SwitchCase, Case Select channel
    or None, skip index or None)]``; ``exports``: per switch-case, the emission keys its
    branches return; ``symbolic``: gradient heads emitted as TF's symbolic gradient;
    ``wanted``: (node, out) -> ``"value"`` where Python needs the value although no Python
    op reads it directly (a Python-run op does), ``"shape"`` where it needs the shape (a
    gradient result whose shape varies, if the graph's is not fully defined), ``"fixed"``
    where it knows the shape (a variable's gradient): no fetch for it; ``unseen``:
    backward ops Python never sees; ``phi_of``, ``slots``: the phi slots each value
    updates. After :meth:`__call__` has run (inside the function being traced), ``written``
    holds the variables the graph writes; ``first_write``, the index among the top graph's
    ops before which no op changes state (None: none does, or one inside a switch-case or
    loop does), and ``enqueued``, every fetch point's ``(enqueue op, Channel)``: the commit
    gate's (``terra.commit``)."""

    def __init__(self, name, steps, planned, exports, loops, conds, symbolic, wanted, unseen,
                 phi_of, slots, xla, exact):
        self.name = name
        self.steps, self.planned, self.exports = steps, planned, exports
        self.loops, self.conds = loops, conds
        self.symbolic, self.wanted, self.unseen = symbolic, wanted, unseen
        self.phi_of, self.slots = phi_of, slots
        self.xla, self.exact = xla, exact
        self.written = {}
        self.first_write = None
        self._nested_write = False
        self.enqueued = []
        self._segments = itertools.count()  # XLA scopes: a new one after every fetch
        self._scope = None
        self.looping = False  # emitting a loop's body
        self._top = None
        self._outer = {}  # id -> the top graph's capture of an eager tensor
        self._consts = {}  # one Const op per value per graph (and XLA scope)
        self._static = {}  # graph tensor -> its value in every iteration, or None (folding)
        self._locals = LocalSteps(steps)  # which steps Python computes itself (folding)
        self.tapes = GraphTapes(symbolic, self._captured)
        self._dispatch = {
            NodeKind.OP: self.emit_op, NodeKind.MARK: self._emit_mark,
            NodeKind.GRAD: functools.partial(emit_region, self),  # terra.region_emission
            NodeKind.LOOP: functools.partial(emit_loop, self),  # terra.loop_emission
        }

    # -- the function's body ------------------------------------------------------------
    def __call__(self):
        self._top = ops.get_default_graph()
        env = {}  # emission key -> graph tensor (see value_key)
        last_fetch = []  # the fetches every later dequeue waits for (Fig. 3.4)
        with self.tapes.emission():
            self._emit_all(env, last_fetch)
        if self._nested_write:
            self.first_write = None

    def _emit_all(self, env, last_fetch):
        for (sc, channel, skip), keys in zip(self.planned, self.exports):
            if channel is None:
                self._emit_block(sc.cases[0].block, env, last_fetch)
                continue
            index = self.dequeue(channel, last_fetch)
            fetched = []
            branches = [self._branch(case.block, keys, env, fetched) for case in sc.cases]
            if skip is not None:
                branches.append(self._branch((), keys, env, fetched))
            graph = ops.get_default_graph()
            n_ops = len(graph.get_operations())
            with ops.control_dependencies(last_fetch), self.tapes.paused():
                outs = control_flow_switch_case.switch_case(index, branches)
            for key, t in zip(keys, outs or ()):
                if type(key) is Out:  # only its producer's branch gives a value that is read
                    t.set_shape(key.node.out_relaxed[key.out])
                env[key] = t
            if any(fetched):
                last_fetch[:] = [op for op in graph.get_operations()[n_ops:]
                                 if op.type in ("Case", "StatelessCase")]

    def _emit_block(self, block, env, last_fetch):
        for head in block:
            step = self.steps[head]
            try:
                self._dispatch[step.kind](step, env, last_fetch)
            except (NotSymbolic, KeepUnrolled, EmissionError):
                raise
            except Exception as e:  # noqa: BLE001 - re-raised naming the node (torch.fx's way)
                raise EmissionError(f"while emitting {step.node.format()}: "
                                    f"{type(e).__name__}: {e}") from e

    def _branch(self, block, keys, env, fetched):
        """One case: its block, returning ``keys`` (placeholders where it has none)."""

        def fn():
            local = collections.ChainMap({}, env)
            last_fetch = []
            self._emit_block(block, local, last_fetch)
            fetched.append(bool(last_fetch))
            return [local[k] if k in local else placeholder(*spec(k, self.slots))
                    for k in keys]

        return fn

    # -- ops and marks (regions and loops: terra.region_emission, terra.loop_emission) ---
    def emit_op(self, step, env, last_fetch):
        node = step.node
        graph = ops.get_default_graph()
        n_ops = len(graph.get_operations())
        if step.python:
            if self.tapes.recording and any(p.in_graph for slot in step.slots
                                             if slot.kind is SlotKind.NODE for p, _ in slot.alts):
                self.tapes.unfaithful()  # eager's tapes may have recorded it
            for k, channel in enumerate(step.out_feed):
                if channel is not None:
                    self.define(env, Out(node, k), self.dequeue(channel, last_fetch))
            return
        inputs = [self.slot_tensor(step, i, slot, env, last_fetch)
                  for i, slot in enumerate(step.slots)]
        if may_write(node.op_type):  # the commit gate's (terra.commit)
            if graph is not self._top or self.looping:
                self._nested_write = True
            elif self.first_write is None:
                self.first_write = n_ops
        summed = self.exact and reorders(node.op_type, inputs)
        with graph.device(node.device):  # where eager ran it ("": where TF places it)
            if opdefs.info(node.op_type).op_def is None:  # a tf.function's forward or backward
                op = call_function(graph, node, inputs)
            elif summed:
                op = add_in_order(inputs).op  # what stands for the sum, recorded as an AddN
            else:
                op = graph._create_op_internal(
                    node.op_type, inputs, attrs=opdefs.attr_protos(node.op_type, node.attrs))
        if self.exact:
            keep_eager_rounding([op])
        if self.tapes.recording:
            self.tapes.record(node, op, *(
                (inputs, op.outputs, ("N", len(inputs), "T", inputs[0].dtype)) if summed else ()))
        if self.xla and not step.check_shapes and not self.looping and fixed_shapes(node):
            self.for_xla(graph, n_ops)  # (a While's body is not compiled)
        if node.in_graph and node.op_type not in opdefs.READ_ONLY_VARIABLE_OPS:
            for slot in step.slots:
                if slot.kind is SlotKind.VAR:
                    self.written.setdefault(slot.tensor._id,
                                            (slot.tensor, _var_dtype(node, slot.tensor)))
        self._locals.emitted(node, op)
        for k, t in enumerate(op.outputs):  # decided for all outputs before any is
            self._note_dynamic(step, k, t)  # emitted: a data-dependent op fetches every one
        for k, t in enumerate(op.outputs):
            self.output(step, k, t, env, last_fetch)

    def _emit_mark(self, step, env, last_fetch):
        """A tape mark: nothing in the graph but what the graph tapes do with it."""
        what, attrs = step.op_type, step.attrs
        if what in ("enter", "reenter"):
            self.tapes.enter(attrs, again=what == "reenter")
        elif what == "exit":
            self.tapes.exit(attrs)
        elif what == "watch" and self.tapes.recording:
            self.tapes.watch(attrs, [self.slot_tensor(step, i, slot, env, last_fetch)
                                      for i, slot in enumerate(step.slots)
                                      if slot.kind is not SlotKind.FEED])

    # -- values -------------------------------------------------------------------------
    def _captured(self, t):
        c = self._outer.get(t._id)
        if c is None:
            # TF captures a small tensor as a Const made in the *default* graph: inside a
            # switch-case's branch that is the branch's, and another branch reading the
            # cached capture fails generation ("accessed from branch 1")
            with self._top.as_default():
                c = self._outer[t._id] = self._top.capture(t)
        return c

    def dequeue(self, channel, last_fetch):
        """The channel's next value, its relaxed shape stated by an ``EnsureShape`` op.

        ``set_shape`` informs only this Python graph: TF infers the instantiated
        function's shapes again from the ops' shape functions, and a dequeue's is unknown
        (the captured queue handle carries no shapes). Grappler may recover the rank from
        the consumers, but not where a switch-case's branches use one joined value as two
        shapes (each applies it to its own variable): a fused Conv2D reading the dequeue
        then recorded an unknown-rank input shape, which oneDNN's rewrite reads as rank 0,
        a CHECK failure that aborts the process. ``EnsureShape``'s own shape function gives
        the shape; at run time it checks what Python validated before feeding."""
        with ops.control_dependencies(last_fetch):
            op = ops.get_default_graph()._create_op_internal(
                "QueueDequeueV2", [self._captured(channel.handle)],
                attrs={"component_types": opdefs.attr_value("list(type)", [channel.dtype]),
                       "timeout_ms": opdefs.attr_value("int", -1)})
        t = op.outputs[0]
        if channel.shape is not None:
            t = array_ops.ensure_shape(t, channel.shape)
        return t

    def _enqueue(self, step, k, t, last_fetch):
        shape = tuple(t.shape.as_list()) if t.shape.rank is not None else None
        with ops.init_scope():  # the graph's shape: relaxed where observations differ
            channel = Channel(t.dtype.as_datatype_enum, shape)
        with ops.control_dependencies(last_fetch):
            op = ops.get_default_graph()._create_op_internal(
                "QueueEnqueueV2", [self._captured(channel.handle), t],
                attrs={"Tcomponents": opdefs.attr_value("list(type)", [channel.dtype]),
                       "timeout_ms": opdefs.attr_value("int", -1)})
        last_fetch[:] = [op]
        self.enqueued.append((op, channel))
        self._scope = None
        step.fetch[k] = channel
        step.has_fetch = True

    def define(self, env, key, t):
        env[key] = t
        for sid in self.phi_of.get(key, ()):
            env[Phi(sid)] = t

    def _constant(self, value, dtype):
        """A constant input: made once per value where the same graph reads it again (an
        optimizer's hyperparameters, once per variable). TF-Agents' DQN graph had 167
        constants among 589 ops, 34 after; generation makes each op in Python."""
        array = np.asarray(value)
        if array.dtype.hasobject:
            return constant_op.constant(value, dtype=dtype)
        key = (ops.get_default_graph(), self._scope, dtype, array.shape, array.dtype.str,
               array.tobytes())
        t = self._consts.get(key)
        if t is None:
            t = self._consts[key] = constant_op.constant(value, dtype=dtype)
        return t

    def slot_tensor(self, step, i, slot, env, last_fetch):
        if slot.kind in (SlotKind.NODE, SlotKind.SAME):
            return env[value_key(slot)]
        if slot.kind in (SlotKind.VAR, SlotKind.CAPTURE):
            t = self._captured(slot.tensor)
        elif slot.kind is SlotKind.CONST:
            t = self._constant(slot.value, slot.dtype)
        else:
            t = self.dequeue(step.feed[i], last_fetch)
            if ops.get_default_graph() is not self._top:
                # in a switch-case's branch: TF's gradient through the Case differentiates
                # the branch with respect to all its inputs, the captured queue handle too,
                # and a dequeue has no gradient. A value Python feeds has none either.
                t = array_ops.stop_gradient(t)
        self.define(env, Read(step.node, i), t)
        return t

    def for_xla(self, graph, n_ops):
        """Mark the compute ops created since ``n_ops`` for XLA (section 3.12)."""
        if self._scope is None:
            self._scope = f"{self.name}_{next(self._segments)}".encode()
        mark_for_xla(graph.get_operations()[n_ops:], self._scope)

    def _note_dynamic(self, step, k, t):
        """Whether output ``k`` of ``step`` (``t`` in the graph) has a shape its input
        shapes do not imply: the op's outputs are then fetched, not stood in for."""
        node = step.node
        if k in _SCRATCH_OUTPUTS.get(node.op_type, ()):
            return
        if (not t.shape.is_fully_defined() or node.data_dependent) and \
                self._locals.infer_shapes(step):
            return
        if not t.shape.is_fully_defined() and not step.check_shapes and \
                not node.data_dependent and shape_fn_decides(node):
            # the traces had one shape here, the graph's varies (a mask's row count): the
            # stand-ins' shapes follow from the inputs', looked up or inferred, as where the
            # traces' shapes varied; fetched, Python would wait for the graph at this op
            step.check_shapes = True
            return
        if not t.shape.is_fully_defined() and not step.check_shapes or node.data_dependent \
                or step.check_shapes and k == 0 and not shape_fn_decides(node):
            step.dynamic = True

    def output(self, step, k, t, env, last_fetch):
        """Output ``k`` of ``step`` is ``t``: what later ops read, and a fetch if Python
        reads it (or needs its data-dependent shape)."""
        node = step.node
        self.define(env, Out(node, k), t)
        if t.dtype.as_datatype_enum != step.out_specs[k][1]:
            raise AssertionError(f"{node.format()}: graph dtype {t.dtype} differs")
        self._note_dynamic(step, k, t)
        need = self.wanted.get((node, k))
        if need == "shape" and t.shape.is_fully_defined() or need == "fixed":
            step.known_shape[k] = True  # a gradient result whose shape is the recorded one
        wanted = k in node.fetched or k in node.escaped or need == "value" or \
            need == "shape" and not step.known_shape[k]
        if wanted or step.dynamic and node not in self.unseen and not step.known_shape[k]:
            value = static_value(t, self._static) if wanted else None
            if value is not None:
                with ops.init_scope():
                    step.static[k] = constant_op.constant(value)
            elif self._locals.can(step):
                self._locals.make(step)
            else:
                self._enqueue(step, k, t, last_fetch)




def _var_dtype(node, handle):
    """The dtype of the variable behind ``handle``: from its handle data (an eager handle
    carries it), else from the writing op's attrs (``RngReadAndSkip``, which writes a
    ``tf.random.Generator``'s state, names no dtype)."""
    data = getattr(handle, "_handle_data", None)
    if data is not None and data.shape_and_type:
        return data.shape_and_type[0].dtype
    attrs = dict(node.attrs)
    return attrs.get("dtype", attrs.get("T"))
