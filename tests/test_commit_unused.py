"""What the commit gate's ``ready`` enqueue does not wait for (``commit._unused``): ops whose
values nothing uses and that can neither have an effect nor fail, which TF then prunes. Eager
ran them (a gradient function computes every input's gradient); an op that may fail on its
values (an index, a check) must still run, or a graph would not raise eager's error."""

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import func_graph
from tensorflow.python.ops import gen_array_ops, gen_nn_ops

from terra import commit


def _graph(build):
    """The ops of a function graph ``build(x, w, index)`` makes, and what it returns."""
    graph = func_graph.FuncGraph("g")
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (2, 8, 8, 3))
        w = tf.constant(np.ones((3, 3, 3, 4), np.float32))
        index = tf.compat.v1.placeholder(tf.int32, ())
        out = build(x, w, index)
    return graph, out


def _types(ops):
    """The types of ``ops`` but function inputs and constants (never waited for anyway)."""
    return sorted(op.type for op in ops if op.type not in ("Placeholder", "Const"))


def test_an_unused_gradient_is_left_out_and_what_it_reads_with_it():
    def build(x, w, index):
        y = tf.nn.conv2d(x, w, 1, "SAME")
        dy = tf.ones_like(y)
        sizes = gen_array_ops.shape_n([x, w])
        gen_nn_ops.conv2d_backprop_input(sizes[0], w, dy, [1, 1, 1, 1], "SAME")  # unused
        return [y, gen_nn_ops.conv2d_backprop_filter(x, sizes[1], dy, [1, 1, 1, 1], "SAME")]

    graph, out = _graph(build)
    unused = commit._unused(graph.get_operations(), out)
    assert _types(unused) == ["Conv2DBackpropInput"]  # ShapeN: the filter's gradient reads it


def test_a_broadcast_gradients_sum_is_left_out():
    def build(x, w, index):
        b = tf.ones((8, 3))
        args = gen_array_ops.broadcast_gradient_args(tf.shape(x), tf.shape(b))
        reduced = tf.reduce_sum(x, args[1])
        tf.reshape(reduced, tf.shape(b))  # unused: the gradient of b, nobody's variable
        return [x * b]

    graph, out = _graph(build)
    unused = commit._unused(graph.get_operations(), out)
    assert {"Sum", "Reshape", "BroadcastGradientArgs"} <= set(_types(unused))


def test_ops_that_may_fail_on_their_values_are_waited_for():
    def build(x, w, index):
        tf.gather(tf.range(5.0), index)  # an index out of range fails
        tf.debugging.check_numerics(x, "x")  # a NaN fails
        tf.reshape(x, tf.stack([index, -1]))  # a shape from a value
        tf.random.uniform((2,))  # an effect
        return [x * 2.0]

    graph, out = _graph(build)
    unused = {op.type for op in commit._unused(graph.get_operations(), out)}
    assert not unused & {"GatherV2", "CheckNumerics", "Reshape", "RandomUniform"}, unused
