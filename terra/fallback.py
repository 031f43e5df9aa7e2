"""Fallback: leave co-execution mid-iteration with exactly the state eager would have.

Cancel the GraphRunner's job, restore the variables the graph writes from the snapshot taken
at the start of the iteration, then replay the matched prefix eagerly through the recording
callback: graph ops are executed (and recorded on any open tape), ops the PythonRunner ran
for real are only recorded (re-running them would repeat their side effects), tape marks
re-enter the real tapes, and gradient calls run the real ``tape.gradient``. Every stand-in
handed to Python gets its real value.
"""

from tensorflow.python.eager import context, execute
from tensorflow.python.framework import constant_op, dtypes, errors
from tensorflow.python.util import nest

from terra import opdefs
from terra.tracegraph import NodeKind

_READS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})


def watch_read(tapes, op_type, handle):
    """Let open tapes watch a variable read whose Python side ran while they were not real.

    Eager tapes learn of a variable from ``variable_accessed`` before the read op runs. In
    co-execution no real tape is active then, so a read replayed, or run eagerly right after
    a fallback, must be announced here or its gradient would be missing."""
    if op_type in _READS:
        for tape in tapes:
            if tape.watch_accessed_variables and tape.real is not None:
                tape.real.watch(handle)


def restore(job, timeout):
    """Wait for ``job`` to stop and put back the variables it may have written."""
    if not job.done.wait(timeout):
        raise TimeoutError("Terra: the graph did not stop within the timeout after cancel")
    if job.snapshot is None:
        return
    ctx = context.context()
    for (handle, dtype), value in zip(job.graph.written, job.snapshot):
        execute.quick_execute("AssignVariableOp", 0, [handle, value],
                              ("dtype", dtype, "validate_shape", False), ctx)


def _flat_attrs(op_type, attrs):
    """Recorded attrs as the flat tuple eager execution takes, every defaulted attr spelled
    out: the tape hands gradient functions an op built from exactly these attrs, and a
    gradient function may read any of them (``_BiasAddGrad`` reads ``data_format``)."""
    given = {name: value for name, value in attrs if value is not None}
    flat = []
    for name, value in {**opdefs.defaults(op_type), **given}.items():
        if value is not None:
            flat.extend((name, list(value) if isinstance(value, tuple) else value))
    return tuple(flat)


def replay(log, recorder, open_tapes):
    """Re-execute a co-executed prefix eagerly, recording it into ``recorder``.

    A replay that raises (a graph-side error reproduced at its op) stops short of the exit
    marks of the tapes it re-entered. Tapes still open in user code (``open_tapes``) are
    exited by their own ``with``; the real tapes of those Python already left are exited here,
    or they would stay on TF's tape stack, recording and keeping alive every later op."""
    tapes = []  # Terra tapes the replay has re-entered, innermost last
    try:
        _replay(log, recorder, tapes)
    except BaseException:
        for tape in reversed(tapes):
            if not any(tape is t for t in open_tapes):
                tape.exit_real()
        raise


def _replay(log, recorder, tapes):
    ctx = context.context()
    issued = {}  # call stack -> ops replayed from it: a loop body's op occurs once per trip
    for step, inputs, outs, extra in log:
        node = step.node
        sid = node.site[0] if node.site else None
        n = issued[sid] = issued.get(sid, -1) + 1
        recorder.override = (node.location, (sid, n) if step.looped else node.site)
        try:
            if step.kind is NodeKind.MARK:
                _replay_mark(step, [_real(x) for x in inputs], extra, recorder)
                if step.op_type == "enter":
                    tapes.append(extra)
                elif step.op_type == "exit":
                    tapes.remove(extra)
            elif step.kind is NodeKind.GRAD:
                _replay_grad(step, outs, extra, recorder)
            elif step.python:
                recorder.record_op(node.op_type, [_tensor(_real(x), s) for x, s in
                                                  zip(inputs, step.slots)],
                                   _flat_attrs(node.op_type, node.attrs), outs)
            else:
                stopped = extra  # recording was paused when Python issued it
                args = [_tensor(_real(x), s) for x, s in zip(inputs, step.slots)]
                if not stopped:
                    watch_read(tapes, node.op_type, args[0] if args else None)
                attrs = _flat_attrs(node.op_type, node.attrs)
                try:
                    results = execute.execute_with_callbacks(
                        node.op_type, len(node.out_specs), args, attrs, ctx)
                except errors.OpError as e:  # the graph failed here: eager fails the same way
                    recorder.aborted = True
                    raise _at_user_line(e, node.location) from None
                if not stopped and execute.must_record_gradient():
                    execute.record_gradient(node.op_type, args, attrs, results)
                for entry, r in zip(outs, results):
                    entry.value = r
        finally:
            recorder.override = None


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


def _replay_mark(step, tensors, extra, recorder):
    tape = extra
    if step.op_type == "enter":
        tape.enter_real()
    elif step.op_type == "exit":
        tape.exit_real()
    else:
        tape.real.watch(tensors)
    recorder.mark(step.op_type, step.attrs, tensors)


def _replay_grad(step, entries, extra, recorder):
    tape, target, sources, output_gradients, unconnected = extra
    def resolve(x):
        return recorder.swap(_real(x))

    result = tape.traced_gradient(nest.map_structure(resolve, target), sources,
                                  nest.map_structure(resolve, output_gradients), unconnected)
    values = [x for g in nest.flatten(result) if g is not None
              for x in ((g.values, g.indices, g.dense_shape) if hasattr(g, "indices") else (g,))
              if x is not None]
    for entry, value in zip(entries, values):
        entry.value = value
