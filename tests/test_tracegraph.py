"""TraceGraph merging on hand-written traces: coverage, branching, classification of external
inputs, and the order-insensitive matching of gradient regions."""

import numpy as np
import tensorflow as tf

from terra.location import Location
from terra.nodes import ExtRef, NodeKind, OpRef, SlotKind, VarRef, relax, relax_feeds
from terra.trace import OpRecord
from terra.tracegraph import TraceGraph

F32 = tf.float32.as_datatype_enum
HERE = Location("train.py", 7, "step")


def op(op_type, *inputs, shape=(4, 3), in_graph=True):
    return OpRecord(NodeKind.OP, op_type, (), list(inputs), ((shape, F32),), HERE, in_graph)


def grad_head(body_len, *inputs):
    """A ``tape.gradient(target, sources)`` call: ``inputs`` are the target and sources."""
    attrs = ((), 1, len(inputs) - 1, True, "UnconnectedGradients.NONE")  # as the runtime's
    rec = OpRecord(NodeKind.GRAD, "gradient", attrs, list(inputs), (), HERE)
    rec.body_len = body_len
    rec.results = [("t", OpRef(1 + body_len, 0))]
    return rec


def ext(value):
    return ExtRef(tf.constant(value, tf.float32))


def forward(x, w):
    return [OpRecord(NodeKind.MARK, "enter", (), [], (), HERE), op("MatMul", x, VarRef(w.handle))]


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
            op("Exp", ExtRef(big)),  # the very same tensor object: captured
            op("Abs", ext(np.full((100,), float(step)))),  # changes: fed
        ])
    kinds = {n.op_type: n.inputs[0].kind for n in graph.nodes if n.inputs}
    assert kinds == {"Neg": SlotKind.CONST, "Exp": SlotKind.CAPTURE, "Abs": SlotKind.FEED}, \
        str(graph)


def test_an_input_seen_in_one_trace_is_fed():
    """One trace cannot tell a constant or the very same tensor from a value that changes:
    a path traced once (a branch taken once before the graph was built) feeds its inputs.
    Counting a new node's first observation twice made them a constant and a capture, and
    the next iteration on that path fell back ("constant value changed", "a different
    tensor")."""
    big = tf.ones((100,))
    graph = TraceGraph()
    graph.merge([op("Neg", ext([1.0, 2.0, 3.0, 4.0] * 4)), op("Exp", ExtRef(big))])
    kinds = {n.op_type: (n.inputs[0].kind, n.inputs[0].seen) for n in graph.nodes if n.inputs}
    assert kinds == {"Neg": (SlotKind.FEED, 1), "Exp": (SlotKind.FEED, 1)}, str(graph)


def test_a_different_producer_branches():
    w, v = tf.Variable(tf.ones((3, 3))), tf.Variable(tf.ones((3, 3)))
    g = TraceGraph()
    g.merge(forward(ext(np.ones((4, 3))), w))
    covered, _ = g.merge(forward(ext(np.ones((4, 3))), v))  # reads another variable
    assert not covered and len(g.branch_points) == 1, str(g)


def gradient_trace(order):
    x = ext(np.ones((4, 3)))
    body = {"a": op("Neg", OpRef(0, 0)), "b": op("Exp", OpRef(0, 0))}
    recs = [op("Square", x), grad_head(3, OpRef(0, 0))]
    index = {name: len(recs) + k for k, name in enumerate(order)}
    recs += [body[name] for name in order]
    recs.append(op("AddV2", OpRef(index["a"], 0), OpRef(index["b"], 0)))
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
    changed[2] = op("Log", OpRef(0, 0))
    covered, _ = g.merge(changed)
    assert not covered and len(g.branch_points) == 1, str(g)


def test_an_op_run_in_python_takes_any_resource_handle():
    """A fresh tf.data iterator each epoch must not split the node that reads from it."""
    g = TraceGraph()
    for _ in range(2):
        handle = tf.Variable(1.0).handle  # a new resource each time
        covered, _ = g.merge([op("IteratorGetNext", VarRef(handle), in_graph=False)])
    assert covered, str(g)
    assert str(g).startswith("%2 = IteratorGetNext(resource)")


def test_graph_ops_never_merge_reads_of_different_variables():
    g = TraceGraph()
    for _ in range(2):
        covered, _ = g.merge([op("ReadVariableOp", VarRef(tf.Variable(1.0).handle))])
    assert not covered and len(g.branch_points) == 1, str(g)


# -- merging back (paper §3.2.2, Figure 3.2) ----------------------------------------------


def at(line, occurrence=0):
    """An executed location: the line stands for the call stack, as terra.location interns
    it; ``occurrence`` counts the ops issued from it earlier in the iteration (loop trips)."""
    return Location("fig32.py", line, "f"), (line, occurrence)


def op_at(where, op_type, *inputs):
    rec = op(op_type, *inputs)
    rec.location, rec.site = where
    return rec


def figure_3_2_trace(true_path, trips):
    """Figure 3.2(a): ``if rval > 0.5: x1 = Op1(x, rval); x2 = Op2(x1)`` (lines 5-6) ``else:
    x2 = Op2(x)`` (line 9); ``x3 = Op3(x2)`` (line 10); ``for ...: x3 = Op4(x3)`` (line 13)."""
    x, rval = ext(np.ones((4, 3))), ext(np.full((4, 3), 0.7 if true_path else 0.2))
    if true_path:
        recs = [op_at(at(5), "Op1", x, rval), op_at(at(6), "Op2", OpRef(0, 0))]
    else:
        recs = [op_at(at(9), "Op2", x)]
    recs.append(op_at(at(10), "Op3", OpRef(len(recs) - 1, 0)))
    for trip in range(trips):
        recs.append(op_at(at(13, trip), "Op4", OpRef(len(recs) - 1, 0)))
    return recs


def test_figure_3_2_the_false_path_branches_then_merges_back_at_op3():
    g = TraceGraph()
    g.merge(figure_3_2_trace(True, 2))
    covered, path = g.merge(figure_3_2_trace(False, 2))
    assert not covered
    g.lint()
    op2 = [n for n in g.nodes if n.op_type == "Op2"]
    op3 = [n for n in g.nodes if n.op_type == "Op3"]
    assert len(op2) == 2, "the two Op2 ran at different locations: two nodes\n" + str(g)
    assert len(op3) == 1 and set(op3[0].preds) == set(op2), str(g)
    assert [p for p, _ in op3[0].inputs[0].alts] == op2, "x2 comes from either Op2"
    assert "Op3(phi(" in str(g), str(g)
    assert [n.op_type for n in path] == ["Op2", "Op3", "Op4", "Op4"]
    assert len(g.nodes) == 2 + 6, str(g)  # start, end, Op1, Op2 x2, Op3, Op4 x2


def test_a_shorter_loop_leaves_early_and_a_longer_one_extends_it():
    g = TraceGraph()
    g.merge(figure_3_2_trace(True, 2))
    g.merge(figure_3_2_trace(False, 1))
    g.merge(figure_3_2_trace(True, 3))
    g.lint()
    op4 = [n for n in g.nodes if n.op_type == "Op4"]
    assert len(op4) == 3, str(g)  # one node per trip: no loop nodes yet
    assert g.end in op4[0].succs and g.end in op4[1].succs, str(g)
    covered, _ = g.merge(figure_3_2_trace(False, 3))
    assert covered, "every node of that path has been seen twice\n" + str(g)


def test_merging_back_never_makes_a_cycle():
    a, b = at(1), at(2)
    g = TraceGraph()
    g.merge([op_at(a, "Neg", ext(np.ones((4, 3)))), op_at(b, "Exp", ext(np.ones((4, 3))))])
    g.merge([op_at(b, "Exp", ext(np.ones((4, 3)))), op_at(a, "Neg", ext(np.ones((4, 3))))])
    g.lint()  # raises on a cycle
    assert len([n for n in g.nodes if n.op_type == "Neg"]) == 2, str(g)


def test_a_join_takes_only_a_producer_that_ran_last():
    """``x2`` read from Op1 although Op2 ran after it in that trace: merged into the phi, the
    graph would hand it Op2's value. The node must not join; a new one reads Op1."""
    x = ext(np.ones((4, 3)))
    g = TraceGraph()
    g.merge([op_at(at(1), "Op1", x), op_at(at(2), "Op3", OpRef(0, 0))])
    g.merge([op_at(at(5), "Op2", x), op_at(at(2), "Op3", OpRef(0, 0))])
    later = [op_at(at(1), "Op1", x), op_at(at(5), "Op2", x), op_at(at(2), "Op3", OpRef(0, 0))]
    g.merge(later)
    g.lint()
    op3 = [n for n in g.nodes if n.op_type == "Op3"]
    assert len(op3) == 2, str(g)


def test_a_gradient_region_is_reused_only_for_the_forward_pass_it_differentiates():
    """An if/else joins before the loss: both traces reach the same gradient call with the
    same inputs and the same backward ops, but the backward pass differentiates different
    forward ops. Taking one region for the other would be a silently wrong gradient."""
    def trace(branch_line):
        x = ext(np.ones((4, 3)))
        recs = [op_at(at(branch_line), "Tanh", x), op_at(at(10), "Square", OpRef(0, 0))]
        head = grad_head(1, OpRef(1, 0))
        head.site = at(11)[1]
        body = op_at(at(11), "Neg", OpRef(1, 0))
        return recs + [head, body]

    g = TraceGraph()
    g.merge(trace(5))
    g.merge(trace(7))
    g.lint()
    assert len([n for n in g.nodes if n.op_type == "Square"]) == 1, str(g)
    assert len([n for n in g.nodes if n.op_type == "gradient"]) == 2, str(g)


def resize_trace(after_exp, size):
    """``h = Neg(x)``, ``Exp(h)`` first if ``after_exp``; then ``ResizeBilinear(h, size)``
    at one line (line 66: one helper called after either), with ``size`` a small constant."""
    recs = [op_at(at(1), "Neg", ext(np.ones((4, 3))))]
    if after_exp:
        recs.append(op_at(at(2), "Exp", OpRef(0, 0)))
    resize = op_at(at(66), "ResizeBilinear", OpRef(len(recs) - 1, 0),
                   ExtRef(tf.constant([size, size])))
    resize.site = (66, len(recs))  # another call stack on each path
    return recs + [resize]


def test_a_constant_that_varied_at_one_node_of_a_line_is_fed_at_every_node_of_it():
    g = TraceGraph()
    for after_exp, size in [(False, 16), (True, 8), (False, 16), (True, 8)]:
        g.merge(resize_trace(after_exp, size))
    resizes = [n for n in g.nodes if n.op_type == "ResizeBilinear"]
    assert len(resizes) == 2 and all(n.inputs[1].kind is SlotKind.CONST for n in resizes), str(g)
    g.merge(resize_trace(False, 24))  # SDPoint's other ratio, after one block
    # the other block's size is fed as well: its other ratio would fall back too
    assert all(n.inputs[1].kind is SlotKind.FEED for n in resizes), str(g)
    g.merge(resize_trace(True, 8))  # observed again: stays fed
    assert resizes[1].inputs[1].kind is SlotKind.FEED, str(g)
    g.lint()


def library_trace(counter):
    """Two ``AddV2`` of a library's, from two call stacks inside one call of the user's (one
    user line, as every op of a Keras ``fit`` has): the first adds a step counter that
    changes every iteration, the second a constant that never does."""
    first = op_at(at(42), "AddV2", ext(np.ones((4, 3))), ExtRef(tf.constant(float(counter))))
    second = op_at(at(42), "AddV2", OpRef(0, 0), ExtRef(tf.constant(5.0)))
    second.site = (43, 0)  # the same user line, another call stack
    return [first, second]


def test_a_constant_that_varied_is_fed_only_where_its_call_stack_issued_it():
    g = TraceGraph()
    for counter in (1, 2, 3):
        g.merge(library_trace(counter))
    first, second = (n for n in g.nodes if n.op_type == "AddV2")
    assert first.inputs[1].kind is SlotKind.FEED, str(g)
    assert second.inputs[1].kind is SlotKind.CONST, str(g)
    g.lint()


def test_fed_inputs_whose_shape_held_still_are_relaxed_where_others_varied():
    """Images of two sizes with one area: the value computed per iteration over their
    feature map (anchors) kept its length in both traces by chance. Where an input's shape
    varied, the others' dimensions are relaxed, but not the sizes the varying ones keep (the
    batch, the channels), nor 0 and 1, nor a small integer vector's length (a shape's)."""
    graph = TraceGraph()
    for h, w in ((4, 6), (6, 4)):
        graph.merge([
            op("Relu", ext(np.ones((1, h, w, 3)))),  # the image: varies
            op("Mul", ext(np.ones((h * w * 5,))), ext(np.ones((h * w * 5, 3))),
               shape=(h * w * 5,)),  # per-iteration values of one length
            op("Neg", ext(np.ones((7, 1)) * h)),  # 7: no size the image keeps; 1: kept
            op("Reshape", OpRef(1, 0), ExtRef(tf.constant([h * w, 5 + h]))),  # a shape
        ])
    relax_feeds(graph.nodes)
    shapes = {n.op_type: [s.shape for s in n.inputs if s.kind is SlotKind.FEED]
              for n in graph.nodes if n.inputs}
    assert shapes == {"Relu": [(1, None, None, 3)], "Mul": [(None,), (None, 3)],
                      "Neg": [(None, 1)], "Reshape": [(2,)]}, str(graph)


def test_fed_inputs_keep_their_shapes_where_no_input_varied():
    graph = TraceGraph()
    for step in range(2):
        graph.merge([op("Abs", ext(np.full((100,), float(step))))])
    relax_feeds(graph.nodes)
    assert [s.shape for n in graph.nodes for s in n.inputs] == [(100,)], str(graph)


def test_relax_takes_an_unknown_rank_on_either_side():
    assert relax((2, 3), (2, 4)) == (2, None)
    assert relax((2, 3), None) is None  # a phi whose later producer has an unknown rank
    assert relax(None, (2, 3)) is None
    assert relax((2, 3), (2, 3, 1)) is None
