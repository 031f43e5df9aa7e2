"""Terra's graph rounds every value as eager's kernels do: bit-identical losses and variables.

A ``tf.function`` of the same step is not: Grappler rewrites ``x / c`` as ``x * (1 / c)``,
regroups arithmetic and fuses patterns into oneDNN kernels, and oneDNN's graph pass merges a
convolution's bias gradient into its filter gradient, summed in another order. Training turns
those last-bit differences into visible ones (a Sonnet ConvNet and Keras' MobileNetV3Small of
the corpus ended 1e-4 off eager), so each pattern here is compared bit for bit.
"""

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager

import terra

STEPS = 10


class StridedConvNet(tf.Module):
    """Raw variables: a stride-2 convolution with a bias, then a linear head."""

    def __init__(self, rng):
        self.w = tf.Variable(rng.standard_normal((3, 3, 16, 32)).astype(np.float32) * 0.1)
        self.b = tf.Variable(np.zeros(32, np.float32))
        self.head = tf.Variable(rng.standard_normal((32, 10)).astype(np.float32) * 0.1)

    def __call__(self, x):
        y = tf.nn.relu(tf.nn.bias_add(tf.nn.conv2d(x, self.w, 2, "SAME"), self.b))
        return tf.matmul(tf.reduce_mean(y, [1, 2]), self.head)


def _momentum_loop(tape_cls, steps, model, inputs, labels, lr=0.05):
    """Plain SGD with momentum written out: velocities carry last-bit differences forward."""
    velocities = [tf.Variable(tf.zeros_like(v)) for v in model.trainable_variables]
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            logits = model(inputs[step % len(inputs)])
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=labels[step % len(labels)], logits=logits))
        grads = tape.gradient(loss, model.trainable_variables)
        for var, vel, grad in zip(model.trainable_variables, velocities, grads, strict=True):
            vel.assign(0.9 * vel + grad)
            var.assign_sub(lr * vel)
        losses.append(loss)
    return {"losses": losses, "variables": list(model.trainable_variables),
            "velocities": velocities}


def strided_conv_bias(tape_cls, steps):
    rng = np.random.default_rng(0)
    inputs = [tf.constant(rng.standard_normal((32, 32, 32, 16)).astype(np.float32))
              for _ in range(3)]
    labels = [tf.constant(rng.integers(0, 10, 32).astype(np.int32)) for _ in range(3)]
    return _momentum_loop(tape_cls, steps, StridedConvNet(rng), inputs, labels)


class HardSwishMLP(tf.Module):
    """MobileNetV3's activation, ``x * relu6(x + 3) / 6``: a division by a constant."""

    def __init__(self, rng):
        self.w1 = tf.Variable(rng.standard_normal((24, 64)).astype(np.float32) * 0.3)
        self.w2 = tf.Variable(rng.standard_normal((64, 10)).astype(np.float32) * 0.3)

    def __call__(self, x):
        h = tf.matmul(x, self.w1)
        h = h * tf.nn.relu6(h + 3.0) / 6.0
        return tf.matmul(h, self.w2)


def hard_swish(tape_cls, steps):
    rng = np.random.default_rng(1)
    inputs = [tf.constant(rng.standard_normal((64, 24)).astype(np.float32)) for _ in range(3)]
    labels = [tf.constant(rng.integers(0, 10, 64).astype(np.int32)) for _ in range(3)]
    return _momentum_loop(tape_cls, steps, HardSwishMLP(rng), inputs, labels)


@pytest.mark.parametrize("program", [strided_conv_bias, hard_swish])
def test_graph_keeps_eagers_rounding(program):
    outcome = assert_same_as_eager(program, STEPS, exact=("losses", "variables", "velocities"))
    assert outcome.stats.coexecuted >= STEPS - 4


def test_tf_function_rounding_differs_so_the_test_can_fail():
    """The patterns above are ones where graph rewrites do change the numbers: the same
    computation under ``tf.function`` (every rewrite on) is not bit-identical to eager."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.standard_normal((32, 32, 32, 16)).astype(np.float32))
    dy = tf.constant(rng.standard_normal((32, 16, 16, 32)).astype(np.float32) * 1e-3)

    def bias_and_filter_gradients(x, dy):
        return (tf.compat.v1.nn.conv2d_backprop_filter(x, [3, 3, 16, 32], dy, [1, 2, 2, 1],
                                                        "SAME"),
                tf.raw_ops.BiasAddGrad(out_backprop=dy))

    def divide(x):
        return x * tf.nn.relu6(x + 3.0) / 6.0

    eager = bias_and_filter_gradients(x, dy)[1].numpy(), divide(x).numpy()
    graph = (tf.function(bias_and_filter_gradients)(x, dy)[1].numpy(),
             tf.function(divide)(x).numpy())
    assert not np.array_equal(eager[1], graph[1])  # Grappler's x / c -> x * (1 / c)
    from tensorflow.python.util import _pywrap_util_port
    if _pywrap_util_port.IsMklEnabled():  # oneDNN's merged bias gradient
        assert not np.array_equal(eager[0], graph[0])


def test_exact_off_gives_the_graph_tf_functions_rewrites():
    """``TERRA_EXACT=0``: the rewrites are back, so the hard-swish program's numbers are
    tf.function's, close to eager's but not bit-identical."""
    terra.configure(exact=False)
    try:
        outcome = assert_same_as_eager(hard_swish, STEPS, rtol=1e-4)
    finally:
        terra.configure(exact=True)
    eager, under_terra = outcome.eager["variables"], outcome.terra["variables"]
    assert any(not np.array_equal(a, b) for a, b in zip(eager, under_terra, strict=True))
