"""Static values (``terra.folding``): what Python reads of static shapes is handed out at once
in co-execution instead of being fetched from the graph, and stays eager's number."""

import inspect

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, mlp_task

from terra import folding


def _static_values(build):
    """``folding.static_value`` of each tensor ``build`` returns, inside a graph."""
    found = []

    @tf.function(autograph=False)
    def f(x):
        memo = {}
        found.extend(folding.static_value(t, memo) for t in build(x))
        return x

    f.get_concrete_function(tf.TensorSpec([4, 6, 3], tf.float32))
    return found


def test_shape_arithmetic_on_a_fully_defined_shape_is_folded():
    index, sliced, product, packed = _static_values(lambda x: (
        tf.shape(x)[1], tf.shape(x)[1:], tf.reduce_prod(tf.shape(x)),
        tf.stack([tf.shape(x)[0], 2 * tf.shape(x)[2]])))
    assert index == 6 and sliced.tolist() == [6, 3] and product == 72
    assert packed.tolist() == [4, 6]


def test_values_that_depend_on_data_or_round_are_not_folded():
    data, rounding = _static_values(lambda x: (
        tf.cast(tf.reduce_sum(x), tf.int32),  # reads the data
        tf.cast(tf.shape(x)[1], tf.float32) / 3.0))  # a float op: the graph's rounding
    assert data is None and rounding is None


def test_a_value_too_large_to_hold_is_not_folded():
    (big,) = _static_values(lambda x: (tf.range(folding.MAX_ELEMENTS + 1),))
    small = _static_values(lambda x: (tf.range(folding.MAX_ELEMENTS),))[0]
    assert big is None and np.array_equal(small, np.arange(folding.MAX_ELEMENTS))


def _noise_shape_loop(tape_cls, steps):
    """Dropout-like masking whose noise shape Python reads element by element from
    ``tf.shape`` (what Keras' dropout makes TF do), every step."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    gen = tf.random.Generator.from_seed(1)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            h = model.layers[0](x)
            noise_shape = [int(d) for d in tf.shape(h)]  # read: shape
            h = h * tf.cast(gen.uniform(noise_shape) > 0.2, h.dtype)
            loss = loss_fn(y, model.layers[1](h))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(loss)
    return {"losses": losses, "variables": model.trainable_variables}


def test_a_shape_read_in_co_execution_waits_for_no_graph_and_keeps_eagers_numbers():
    outcome = assert_same_as_eager(_noise_shape_loop, steps=10, min_coexecuted=4)
    source, first = inspect.getsourcelines(_noise_shape_loop)
    (offset,) = [i for i, s in enumerate(source) if s.rstrip().endswith("# read: shape")]
    read_at = f"{inspect.getsourcefile(_noise_shape_loop)}:{first + offset} "
    waits = [row for row in outcome.explain.splitlines() if " waits, " in row]
    assert waits and not [row for row in waits if read_at in row], outcome.report()
