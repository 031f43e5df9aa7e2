"""Graph generation from hand-written traces: the switch-cases it emits, the Case Select puts
the PythonRunner follows, and the Grappler settings of the generated function."""

import itertools

import numpy as np
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context, execute
from test_tracegraph import at, ext, op_at

from terra.graph_builder import generate
from terra.nodes import OpRef
from terra.tracegraph import TraceGraph


def trace(middle_line, middle_op, rows=4, value=1.0):
    """``y = Neg(x)``; ``z = <middle_op>(y)`` at ``middle_line``; ``Exp(z)`` at line 9, whose
    value Python reads."""
    x = ext(np.full((rows, 3), value))
    recs = [op_at(at(1), "Neg", x), op_at(at(middle_line), middle_op, OpRef(0, 0)),
            op_at(at(9), "Exp", OpRef(1, 0))]
    recs[-1].fetched.add(0)
    return recs


def graph_of(*traces, xla=False, exact=True):
    g = TraceGraph()
    for t in traces:
        g.merge(t)
    return g, generate(g, xla=xla, exact=exact)


def rewriter(graph, name):
    attrs = dict(zip(graph.call_attrs[::2], graph.call_attrs[1::2]))
    config = config_pb2.ConfigProto()
    config.ParseFromString(attrs["config_proto"])
    return getattr(config.graph_options.rewrite_options, name)


def constant_folding(graph):
    return rewriter(graph, "constant_folding")


def feed_and_fetch(g, graph):
    """The channels of the hand-written trace's feed (``x``) and fetch (``Exp``); ``g``: the
    TraceGraph, or the graph itself where a loop was rolled (its steps are for a copy)."""
    nodes = g.steps if g is graph else g.nodes
    steps = {n.op_type: graph.steps[n] for n in nodes if n.op_type in ("Neg", "Exp")}
    [feed] = [c for c in steps["Neg"].feed if c is not None]
    [fetch] = [c for c in steps["Exp"].fetch if c is not None]
    return steps, feed, fetch


def test_an_if_else_that_joins_is_one_switch_case_with_a_phi_after_it():
    g, graph = graph_of(trace(5, "Abs"), trace(7, "Square"), trace(5, "Abs"), trace(7, "Square"))
    assert "Exp(phi(" in str(g), str(g)
    switches = [sc for sc, channel in graph.switch_cases if channel is not None]
    assert len(switches) == 1 and len(switches[0].cases) == 2, str(graph)
    ops = [op.type for op in graph.function.graph.get_operations()]
    assert ops.count("Case") + ops.count("StatelessCase") == 1, ops
    neg = graph.steps[next(n for n in g.nodes if n.op_type == "Neg")]
    # taking either edge out of Neg feeds that case's index to the one Case Select channel
    assert [[k for _, k in puts] for puts in neg.puts] == [[0], [1]]


def test_an_exact_graph_has_the_rewrites_that_round_otherwise_off():
    _, graph = graph_of(trace(5, "Abs"), trace(5, "Abs"))
    for name in ("constant_folding", "arithmetic_optimization", "remapping"):
        assert rewriter(graph, name) == rewriter_config_pb2.RewriterConfig.OFF, name


def test_constant_folding_stays_on_where_shapes_never_vary_unless_exact():
    _, graph = graph_of(trace(5, "Abs"), trace(5, "Abs"), exact=False)
    assert constant_folding(graph) != rewriter_config_pb2.RewriterConfig.OFF


def test_constant_folding_is_off_where_a_fed_shape_varies():
    """Grappler would unify a tensor shared by branches with one branch's shapes and fold
    ``tf.shape`` of it to a constant (a stale feature-map size, found on FasterRCNN)."""
    g, graph = graph_of(trace(5, "Abs", rows=4), trace(5, "Abs", rows=6), exact=False)
    assert "feed[float32 ?x3]" in str(g), str(g)
    assert constant_folding(graph) == rewriter_config_pb2.RewriterConfig.OFF
    assert all(step.check_shapes for step in graph.steps.values()), "shapes are looked up"


def test_the_generated_function_runs_the_taken_case():
    """Feed x and the Case Select by hand, as the PythonRunner would, and fetch Exp."""
    g, graph = graph_of(*[trace(line, op_type, value=v) for v, (line, op_type) in
                          enumerate([(5, "Abs"), (7, "Square")] * 2)])
    steps, feed, fetch = feed_and_fetch(g, graph)
    x = np.full((4, 3), 0.5, np.float32)
    for path, expected in ((1, np.exp(np.square(-x))), (0, np.exp(np.abs(-x)))):
        feed.put(tf.constant(x))
        [(channel, index)] = steps["Neg"].puts[path]
        channel.put(tf.constant(index, tf.int32))
        graph.function()
        np.testing.assert_allclose(fetch.get(), expected, rtol=1e-6)


def executed_ops(graph):
    """Run the generated function once; the nodes of its executed partition graphs."""
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        execute.execute(graph.fn_name, 0, graph.captures, graph.call_attrs, ctx)
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return list(itertools.chain.from_iterable(
        p.node for f in metadata.function_graphs for p in f.partition_graphs))


def compiled_calls(graph):
    """The calls of XLA-compiled functions in the function the runner calls, and the op
    types of each called function."""
    ctx = context.context()
    calls = [n for n in ctx.get_function_def(graph.fn_name).node_def
             if n.attr["_XlaMustCompile"].b]
    bodies = [ctx.get_function_def(n.attr["f"].func.name) for n in calls]
    assert all(body.attr["_XlaMustCompile"].b for body in bodies)
    return calls, [sorted(n.op for n in body.node_def) for body in bodies]


UNARY = ("Abs", "Tanh", "Square", "Sin", "Cos", "Sigmoid", "Softplus", "Exp")


def chain(value, shape=(4, 3), line=1, start=None):
    """``Neg`` of a fed ``x`` (or of op ``start``), then the ops of ``UNARY`` in turn, one
    line each from ``line``: enough ops for a segment to be compiled (``terra.xla``)."""
    first = op_at(at(line), "Neg", ext(np.full(shape, value)) if start is None else start)
    return [first] + [op_at(at(line + 1 + i), op_type, None) for i, op_type in enumerate(UNARY)]


def linked(recs, offset=0):
    """``recs`` from :func:`chain`, each op reading the one before it."""
    for i, rec in enumerate(recs[1:], 1):
        rec.inputs = [OpRef(offset + i - 1, 0)]
    return recs


def unary_chain(x):
    y = -x
    for op_type in UNARY:
        y = getattr(tf.math, {"Square": "square", "Softplus": "softplus"}.get(
            op_type, op_type.lower()))(y)
    return y


def test_with_xla_the_compute_ops_run_as_one_compiled_function():
    """The chain runs inside one XLA-compiled function; the queues stay TF ops. Grappler's
    arithmetic optimizer would otherwise fuse ops into an unmarked
    ``_UnaryOpsComposition`` first."""

    def traced(value):
        recs = linked(chain(value))
        recs[-1].fetched.add(0)
        return recs

    _, graph = graph_of(traced(0.0), traced(1.0), xla=True)
    [feed] = [c for s in graph.steps.values() for c in s.feed if c is not None]
    [fetch] = [c for s in graph.steps.values() for c in s.fetch if c is not None]
    x = np.full((4, 3), 0.5, np.float32)
    feed.put(tf.constant(x))
    executed = executed_ops(graph)
    np.testing.assert_allclose(fetch.get(), unary_chain(x), rtol=1e-5)
    assert [n.op for n in executed if n.attr["_XlaMustCompile"].b] == \
        ["StatefulPartitionedCall"], executed
    ops = {n.op for n in executed}
    assert not {"Neg", *UNARY, "_UnaryOpsComposition", "_XlaRun"} & ops, ops
    _, [body] = compiled_calls(graph)
    assert {"Neg", *UNARY} <= set(body), body


def test_with_xla_independent_ops_of_a_segment_are_one_compiled_call():
    """Two chains that share no data edge but run before the same fetch (of the second
    chain's end): one compiled function, where TF's clustering made one cluster each. A
    third chain from the first one's end, after that fetch, is the next segment's: a
    second call."""

    def traced(value):
        first = linked(chain(value))
        second = linked(chain(value, shape=(2, 2), line=20), offset=len(first))
        third = linked(chain(value, line=40, start=OpRef(len(first) - 1, 0)),
                       offset=len(first) + len(second))
        second[-1].fetched.add(0)
        third[-1].fetched.add(0)
        return first + second + third

    _, graph = graph_of(traced(0.0), traced(1.0), xla=True)
    calls, bodies = compiled_calls(graph)
    assert len(calls) == 2, bodies
    assert bodies[0].count("Neg") == 2 and bodies[1].count("Neg") == 1, bodies


def loop_trace(trips, value):
    """``y = Neg(x)``; ``for _ in range(trips): y = Tanh(y)`` (line 5); ``Exp(y)``, read."""
    recs = [op_at(at(1), "Neg", ext(np.full((4, 3), value)))]
    for t in range(trips):
        recs.append(op_at(at(5, t), "Tanh", OpRef(len(recs) - 1, 0)))
    recs.append(op_at(at(9), "Exp", OpRef(len(recs) - 1, 0)))
    recs[-1].fetched.add(0)
    return recs


def test_a_loop_node_is_a_while_that_runs_the_trips_the_loop_cond_asks_for():
    """Traced with 1 and 2 trips; run by hand with 1, 2 and 5 (more than any trace), putting
    on the Loop Cond what the PythonRunner puts on the edges it takes."""
    _, graph = graph_of(loop_trace(1, 0.0), loop_trace(2, 1.0))
    ops = [op.type for op in graph.function.graph.get_operations()]
    assert ops.count("While") + ops.count("StatelessWhile") == 1, ops
    [loop] = graph.loops
    [peeled] = [graph.steps[n] for n in loop.preds]
    [body] = graph.steps[loop].body
    exp = graph.steps[next(n for n in graph.steps if n.op_type == "Exp")]
    # from the peeled trip and from the body alike: round again (1) or out to Exp (0)
    for step in (peeled, body):
        assert step.next == [body, exp], step.next
        [[(go, on)], [(stop, off)]] = step.puts
        assert go is stop and (on, off) == (1, 0), step.puts
    _, feed, fetch = feed_and_fetch(graph, graph)  # the steps are the rolled copy's
    x = np.full((4, 3), 0.5, np.float32)
    for trips in (1, 2, 5):
        feed.put(tf.constant(x))
        for _ in range(trips - 1):
            go.put(tf.constant(1, tf.int32))
        go.put(tf.constant(0, tf.int32))
        graph.function()
        expected = -x
        for _ in range(trips):
            expected = np.tanh(expected)
        np.testing.assert_allclose(fetch.get(), np.exp(expected), rtol=1e-6)
