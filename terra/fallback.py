"""Fallback: leave co-execution mid-iteration with exactly the state eager would have.

Cancel the GraphRunner's job, restore the variables the graph writes from the snapshot taken
at the start of the iteration, then replay the matched prefix eagerly through the recording
callback: graph ops are executed (and recorded on any open tape), ops the PythonRunner ran
for real are only recorded (re-running them would repeat their side effects), tape marks
re-enter the real tapes, and gradient calls run the real ``tape.gradient``. Every stand-in
handed to Python gets its real value.
"""

import dataclasses
import operator

from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import context, execute, record
from tensorflow.python.framework import constant_op, dtypes, errors
from tensorflow.python.util import nest

from terra import functions, interception, opdefs
from terra.nodes import SlotKind
from terra.standins import Entry

_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})


# -- the log the replay runs: what co-execution matched, step by step (``Iteration.log``).
# Inputs are the validated ones (a stand-in by its PythonRunner entry); outputs are entries.
class LoggedOp(tuple):
    """A graph op Python issued; ``stopped``: gradient recording was paused then
    (``tf.stop_gradient``), so the replay does not record it on the tapes either.

    One flat tuple, ``(step, stopped, len(outputs), *outputs, *inputs)``: a co-executed
    iteration logs one per op, and a lane (``terra.lanes``) writes it as a tuple display,
    one object that outlives the op where a record and two lists were three (every object
    alive at an iteration's end is work for the garbage collector and the release)."""

    __slots__ = ()

    def __new__(cls, step, inputs, outputs, stopped):
        return tuple.__new__(cls, (step, stopped, len(outputs), *outputs, *inputs))

    step = property(operator.itemgetter(0))
    stopped = property(operator.itemgetter(1))

    @property
    def outputs(self):
        return self[3:3 + self[2]]

    @property
    def inputs(self):
        return self[3 + self[2]:]


# the records of a graph op Python issued: a LoggedOp, or the entry of the one output a
# lane made (``standins.Entry``, which is then its op's record)
OP_RECORDS = (LoggedOp, Entry)


@dataclasses.dataclass(slots=True)
class LoggedPythonOp:
    """An op the PythonRunner ran for real: replayed by recording its outputs, never run
    again (its side effect happened)."""

    step: object
    inputs: list
    outputs: list


@dataclasses.dataclass(slots=True)
class LoggedMark:
    """A mark of ``tape`` (a library region's: None); ``variables``: for a watch, the
    variable each input stands for, or None."""

    step: object
    inputs: list
    tape: object
    variables: list = ()


@dataclasses.dataclass(slots=True)
class LoggedSkip:
    """A library call Python skipped (``terra.library_regions``, ``terra.layer_regions``):
    its ``call`` mark, and the steps to its ``return`` mark, which the replay runs from the
    plan (their inputs are the graph's: earlier steps' outputs, variables and constants, or
    the call's arguments Python fed, ``fed``); ``stopped`` as for an op. ``outputs``: the
    entries of the stand-ins a skipped layer call returned, which the replay gives values."""

    step: object
    inputs: list
    steps: list
    stopped: bool
    fed: dict = dataclasses.field(default_factory=dict)  # (op index, input) -> tensor
    outputs: list = ()
    values: dict = None  # once replayed: (node, out) -> (order, value), ``_replayed``
    reads: dict = None  # ... and node -> (order, inputs) of its ops


@dataclasses.dataclass(slots=True)
class GradientCall:
    """The arguments of a ``tape.gradient`` call, stand-ins by their entries."""

    tape: object
    target: object
    sources: object
    output_gradients: object
    unconnected: object


@dataclasses.dataclass(slots=True)
class LoggedGradient:
    """A ``tape.gradient`` call; ``outputs``: the entries of its flat results."""

    step: object
    inputs: list
    outputs: list
    call: GradientCall


@dataclasses.dataclass(slots=True)
class LoggedCustomGradient:
    """A custom gradient put on the tapes after ``at`` logged steps (``record_operation``,
    or a ``tf.function``'s backward function, ``functions.TapeRecord``)."""

    at: int
    op_type: str
    outputs: list
    inputs: list
    backward: object


def watch_read(tapes, op_type, handle):
    """Let open tapes watch a variable read whose Python side ran while they were not real.

    Eager tapes learn of a variable from ``variable_accessed`` before the read op runs. In
    co-execution no real tape is active then, so a read replayed, or run eagerly right after
    a fallback, must be announced here or its gradient would be missing. The tapes watch the
    variable itself, as eager's do (``interception.accessed``): watching its handle as a
    tensor gives the same gradient, but leaves it out of ``watched_variables()``, so a trace
    with a replayed gradient call seemed to watch other variables than the rest, and a
    symbolic region lost its graph tape for ``tf.gradients``, which sums in another order.
    The handle of a variable no tape watches as it is read (one not trainable) is not
    watched, as eagerly. A non-persistent tape whose gradient was taken no longer records
    (TF popped it), as eagerly."""
    if op_type in _READS:
        ref = interception.accessed.get(handle._id)
        variable = ref() if ref is not None else None
        if variable is None:
            return
        for tape in tapes:
            real = tape.real
            if tape.watch_accessed_variables and real is not None and real._tape is not None:
                pywrap_tfe.TFE_Py_TapeWatchVariable(real._tape._tape, variable)


class GraphStuck(TimeoutError):
    """A cancelled graph job did not stop within the timeout: the variables it writes cannot be
    put back (it may still write them), so the iteration cannot fall back."""


def restore(job, timeout):
    """Wait for ``job`` to stop and put back the variables it may have written.

    A gated graph (``terra.commit``) writes nothing before Python's token. Python sends it
    without a snapshot only once the iteration has ended and every op before the gate has
    run: a fallback after that (the graph failing in its writes, out of memory) cannot be
    undone, and is raised as :class:`GraphStuck` (Terra gives up) rather than replayed onto
    written variables."""
    if not job.done.wait(timeout):
        raise GraphStuck(f"the graph did not stop within {timeout:.0f}s of being cancelled")
    graph = job.graph
    if job.early is not None:
        assign(graph.written[:graph.n_early], job.early)
    if job.snapshot is not None:
        assign(graph.gated, job.snapshot)
    elif job.committed and graph.gated:
        raise GraphStuck("the iteration fell back after its graph was let write its "
                         "variables without a snapshot")


def assign(written, values):
    """Set the variables ``written`` (a graph's ``(handle, dtype)`` list) to ``values``,
    unseen by the doors and the tapes: Terra's own state change, not the iteration's."""
    ctx = context.context()
    for (handle, dtype), value in zip(written, values):
        execute.quick_execute("AssignVariableOp", 0, [handle, value],
                              ("dtype", dtype, "validate_shape", False), ctx)


def _flat_attrs(attrs):
    """Recorded attrs (every defaulted one spelled out, ``opdefs.normalize_attrs``) as the
    flat tuple eager execution takes: the tape hands gradient functions an op built from
    exactly these, and a gradient function may read any attr (``_BiasAddGrad`` reads
    ``data_format``)."""
    flat = []
    for name, value in attrs:
        if value is not None:  # a shape of unknown rank: left at its default
            flat.extend((name, list(value) if isinstance(value, tuple) else value))
    return tuple(flat)


def replay(log, recorder, open_tapes, customs=()):
    """Re-execute a co-executed prefix eagerly, recording it into ``recorder``.

    A replay that raises (a graph-side error reproduced at its op) stops short of the exit
    marks of the tapes it re-entered. Tapes still open in user code (``open_tapes``) are
    exited by their own ``with``; the real tapes of those Python already left are exited here,
    or they would stay on TF's tape stack, recording and keeping alive every later op."""
    tapes = []  # Terra tapes the replay has re-entered, innermost last
    # The fallback may come where the caller paused recording (``tf.init_scope`` while an
    # optimizer creates its slots): the logged steps were issued with recording on (each op
    # notes whether it was not), so they are replayed with it on, and the pause restored after.
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        _replay(log, recorder, tapes, list(customs))
    except BaseException:
        for tape in reversed(tapes):
            if not any(tape is t for t in open_tapes):
                tape.exit_real()
        raise
    finally:
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def _replay(log, recorder, tapes, customs):
    ctx = context.context()
    issued = {}  # call stack -> ops replayed from it: a loop body's op occurs once per trip
    customs.reverse()
    for index, logged in enumerate(log):
        while customs and customs[-1].at == index:
            _replay_custom(customs.pop())
        step, inputs = logged.step, logged.inputs
        node = step.node
        sid = node.site[0] if node.site else None
        n = issued[sid] = issued.get(sid, -1) + 1
        recorder.override = (node.location, (sid, n) if step.looped else node.site)
        try:
            kind = type(logged)
            if kind is LoggedMark:
                _replay_mark(step, [_real(x) for x in inputs], logged, recorder)
                if step.op_type in ("enter", "reenter"):
                    tapes.append(logged.tape)
                elif step.op_type == "exit":
                    tapes.remove(logged.tape)
            elif kind is LoggedGradient:
                _replay_grad(logged, recorder)
            elif kind is LoggedSkip:
                _replay_skip(logged, log[:index], recorder, tapes, ctx)
            elif kind is LoggedPythonOp:
                recorder.record_op(node.op_type, [_tensor(_real(x), s) for x, s in
                                                  zip(inputs, step.slots)],
                                   _flat_attrs(node.attrs), logged.outputs)
            else:  # an op's record (OP_RECORDS)
                args = [_tensor(_real(x), s) for x, s in zip(inputs, step.slots)]
                results = _execute(node, args, logged.stopped, tapes, recorder, ctx)
                for entry, r in zip(logged.outputs, results):
                    entry.value = r
        finally:
            recorder.override = None
    for custom in reversed(customs):  # recorded after the last matched step
        _replay_custom(custom)


def _execute(node, args, stopped, tapes, recorder, ctx):
    """Run ``node``'s op eagerly on ``args``, recorded (and on the tapes unless ``stopped``).

    A ``stopped`` op ran with gradient recording paused (``tf.stop_gradient``), and runs so
    again: the trace of the iteration notes it untaped as eager's traces do. Run with the
    tapes live and only kept off them, a BatchNorm's stopped mean was noted taped in that
    one trace, and no graph tape could stand for the tape that skipped it (its region kept
    ``tf.gradients``, which sums in another order)."""
    attrs = _flat_attrs(node.attrs)
    if stopped:
        with record.stop_recording():
            return _run(node, args, attrs, recorder, ctx)
    watch_read(tapes, node.op_type, args[0] if args else None)
    results = _run(node, args, attrs, recorder, ctx)
    # a tf.function's call has no registered gradient: its backward function is put back
    # on the tapes among the iteration's custom gradients
    if execute.must_record_gradient() and opdefs.info(node.op_type).op_def is not None:
        execute.record_gradient(node.op_type, args, attrs, results)
    return results


def _run(node, args, attrs, recorder, ctx):
    """The op itself; an error the graph met here is raised as eager raises it."""
    try:
        if node.device and node.device != ctx.device_name:  # a replica's op, from another
            with ctx.device(node.device):  # replica's thread: on its device, as it ran
                return execute.execute_with_callbacks(
                    node.op_type, len(node.out_specs), args, attrs, ctx)
        return execute.execute_with_callbacks(
            node.op_type, len(node.out_specs), args, attrs, ctx)
    except errors.OpError as e:  # the graph failed here: eager fails the same way
        recorder.aborted = True
        raise _at_user_line(e, node.location) from None


# Ops TF's own Python issues with gradient recording paused (``tf.stop_gradient``): a tape
# never sees them in eager, so a replayed skipped call runs them paused too (recorded, they
# change the order the backward pass sums in: eager's rounding is lost).
PAUSES_TAPE = frozenset({"StopGradient"})


def _replay_skip(logged, before, recorder, tapes, ctx):
    """Run a skipped library call's ops from the plan: what its method would have issued,
    each recorded at the executed location it was traced at, on the replayed values of its
    producers (``before``: the log replayed so far)."""
    values, reads = _replayed(before)
    logged.values, logged.reads = values, reads
    step, fed = logged.step, logged.fed
    recorder.mark("call", step.attrs, [_real(x) for x in logged.inputs])
    ops = logged.steps[:-1]
    for j, s in enumerate(ops):
        node = s.node
        recorder.override = (node.location, node.site)
        args = [fed[(j, k)] if (j, k) in fed else _skipped_input(slot, values, reads)
                for k, slot in enumerate(s.slots)]
        order = len(before) + (j + 1) / (len(ops) + 1)  # after the call, before what follows
        reads[node] = (order, args)
        stopped = logged.stopped or node.op_type in PAUSES_TAPE
        for k, r in enumerate(_execute(node, args, stopped, tapes, recorder, ctx)):
            values[(node, k)] = (order, r)
    end = logged.steps[-1]
    recorder.override = (end.node.location, end.node.site)
    returned = [_skipped_input(slot, values, reads) for slot in end.slots]
    recorder.mark("return", end.attrs, returned)
    for entry in logged.outputs:
        entry.value = values[(entry.step.node, entry.out)][1]


def _replayed(before):
    """What the replayed steps ``before`` produced, ``(node, out) -> (order, value)``, and
    read, ``node -> (order, inputs)``: the order tells which of several producers of a joined
    input ran last."""
    values, reads = {}, {}
    for order, earlier in enumerate(before):
        kind = type(earlier)
        if kind in OP_RECORDS or kind is LoggedGradient:
            for e in earlier.outputs:
                if e is not None:
                    values[(e.step.node, e.out)] = (order, e.value)
        elif kind is LoggedPythonOp:
            for k, t in enumerate(earlier.outputs):
                values[(earlier.step.node, k)] = (order, t)
        elif kind is LoggedSkip:
            values.update(earlier.values)
            reads.update(earlier.reads)
        if kind in OP_RECORDS or kind is LoggedPythonOp:
            reads[earlier.step.node] = (order, earlier.inputs)
    return values, reads


def _skipped_input(slot, values, reads):
    """The value an input of a skipped op reads: its producer's output (the one that ran last
    of a joined input's), an external value an earlier op read first, or the slot's own."""
    kind = slot.kind
    if kind is SlotKind.NODE:
        return max((values[a] for a in slot.alts if a in values), key=_first)[1]
    if kind is SlotKind.SAME:
        order, inputs, k = max(((*reads[n], k) for n, k in slot.alts if n in reads),
                               key=_first)
        return _real(inputs[k])
    if kind is SlotKind.CONST:
        return _tensor(slot.value, slot)
    return slot.tensor  # a variable's handle, a capture


def _first(pair):
    return pair[0]


def _replay_custom(custom):
    """Put a custom gradient back on the tapes, over the replayed outputs it was recorded for
    (eager recorded it right after the ops that produced them). A ``tf.function``'s forward
    call that co-execution matched with its inference twin is recorded as TF records it."""
    outputs = [_real(x) for x in custom.outputs]
    inputs = [_real(x) for x in custom.inputs]
    if isinstance(custom.backward, functions.TapeRecord):
        custom.backward.record(outputs, inputs)
    else:
        record.record_operation(custom.op_type, outputs, inputs, custom.backward)


def _real(x):
    """A logged input: a PythonRunner entry (a stand-in's producer) -> its value by now."""
    return x.value if hasattr(x, "step") else x


def _at_user_line(error, location):
    """The same error type, its message naming the user's line that issued the op."""
    where = f"{location.file}:{location.line} ({location.func})" if location else "unknown"
    return type(error)(error.node_def, error.op,
                       f"{error.message}\n  raised by the op issued at {where}; Terra ran it "
                       "in its graph and re-ran the iteration eagerly up to it")


def _tensor(x, slot):
    if x is None or hasattr(x, "_id"):
        return x
    return constant_op.constant(x, dtype=dtypes.as_dtype(slot.dtype))


def _replay_mark(step, tensors, logged, recorder):
    """A tape's mark; a library region's (no tape) is only recorded."""
    tape, what = logged.tape, step.op_type
    if tape is not None:
        if what in ("enter", "reenter"):
            tape.enter_real()
        elif what == "exit":
            tape.exit_real()
        elif what == "watch":  # the variable itself, as TF's tape watches it
            tape.real.watch([t if v is None else v
                             for t, v in zip(tensors, logged.variables or [None] * len(tensors))])
    recorder.mark(what, step.attrs, tensors)


def _replay_grad(logged, recorder):
    call = logged.call

    def resolve(x):
        return recorder.swap(_real(x))

    # a source may be a tensor of the iteration (a nested tape's watched activation): the
    # replayed one, not the stand-in, is what the replayed forward pass computed
    result = call.tape.traced_gradient(nest.map_structure(resolve, call.target),
                                       nest.map_structure(resolve, call.sources),
                                       nest.map_structure(resolve, call.output_gradients),
                                       call.unconnected)
    values = [x for g in nest.flatten(result) if g is not None
              for x in ((g.values, g.indices, g.dense_shape) if hasattr(g, "indices") else (g,))
              if x is not None]
    for entry, value in zip(logged.outputs, values):
        entry.value = value
