"""TraceGraph merging on hand-written traces: coverage, branching, classification of external
inputs, and the order-insensitive matching of gradient regions."""

import numpy as np
import tensorflow as tf

from terra.location import Location
from terra.trace import OpRecord
from terra.tracegraph import TraceGraph

F32 = tf.float32.as_datatype_enum
HERE = Location("train.py", 7, "step")


def op(op_type, *inputs, shape=(4, 3), in_graph=True):
    return OpRecord("op", op_type, (), list(inputs), ((shape, F32),), HERE, in_graph)


def grad_head(body_len, *inputs):
    rec = OpRecord("grad", "gradient", (), list(inputs), (), HERE)
    rec.body_len = body_len
    rec.results = [("t", ("op", 1 + body_len, 0))]
    return rec


def ext(value):
    return ("ext", tf.constant(value, tf.float32))


def forward(x, w):
    return [OpRecord("mark", "enter", (), [], (), HERE), op("MatMul", x, ("var", w.handle))]


def test_a_repeated_trace_is_covered_and_prints_readably():
    w = tf.Variable(tf.ones((3, 3)))
    g = TraceGraph()
    covered, path = g.merge(forward(ext(np.ones((4, 3))), w))
    assert not covered and len(path) == 2
    covered, path = g.merge(forward(ext(np.full((4, 3), 2.0)), w))
    assert covered and [n.op_type for n in path] == ["enter", "MatMul"]
    assert "%3 = MatMul(feed[float32 4x3], var)  # train.py:7" in str(g), str(g)
    g.lint()


def test_external_inputs_are_classified_by_what_was_observed():
    big = tf.ones((100,))  # too big to be a constant
    graph = TraceGraph()
    for step in range(3):
        graph.merge([
            op("Neg", ext([1.0, 2.0])),  # small, same value each time: a constant
            op("Exp", ("ext", big)),  # the very same tensor object: captured
            op("Abs", ext(np.full((100,), float(step)))),  # changes: fed
        ])
    kinds = {n.op_type: n.inputs[0].kind for n in graph.nodes if n.inputs}
    assert kinds == {"Neg": "const", "Exp": "capture", "Abs": "feed"}, str(graph)


def test_a_different_producer_branches():
    w, v = tf.Variable(tf.ones((3, 3))), tf.Variable(tf.ones((3, 3)))
    g = TraceGraph()
    g.merge(forward(ext(np.ones((4, 3))), w))
    covered, _ = g.merge(forward(ext(np.ones((4, 3))), v))  # reads another variable
    assert not covered and len(g.branch_points) == 1, str(g)


def gradient_trace(order):
    x = ext(np.ones((4, 3)))
    body = {"a": op("Neg", ("op", 0, 0)), "b": op("Exp", ("op", 0, 0))}
    recs = [op("Square", x), grad_head(3, ("op", 0, 0))]
    index = {name: len(recs) + k for k, name in enumerate(order)}
    recs += [body[name] for name in order]
    recs.append(op("AddV2", ("op", index["a"], 0), ("op", index["b"], 0)))
    return recs


def test_a_gradient_region_matches_in_any_data_flow_order():
    g = TraceGraph()
    g.merge(gradient_trace(["a", "b"]))
    covered, path = g.merge(gradient_trace(["b", "a"]))  # TF visited the ready ops the other way
    assert covered and not g.branch_points, str(g)
    assert [n.op_type for n in path] == ["Square", "gradient", "Neg", "Exp", "AddV2"]


def test_a_gradient_region_with_a_different_op_still_branches():
    g = TraceGraph()
    g.merge(gradient_trace(["a", "b"]))
    changed = gradient_trace(["b", "a"])
    changed[2] = op("Log", ("op", 0, 0))
    covered, _ = g.merge(changed)
    assert not covered and len(g.branch_points) == 1, str(g)


def test_an_op_run_in_python_takes_any_resource_handle():
    """A fresh tf.data iterator each epoch must not split the node that reads from it."""
    g = TraceGraph()
    for _ in range(2):
        handle = tf.Variable(1.0).handle  # a new resource each time
        covered, _ = g.merge([op("IteratorGetNext", ("var", handle), in_graph=False)])
    assert covered, str(g)
    assert str(g).startswith("%2 = IteratorGetNext(resource)")


def test_graph_ops_never_merge_reads_of_different_variables():
    g = TraceGraph()
    for _ in range(2):
        covered, _ = g.merge([op("ReadVariableOp", ("var", tf.Variable(1.0).handle))])
    assert not covered and len(g.branch_points) == 1, str(g)
