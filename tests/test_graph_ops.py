"""``graph_ops.add_in_order``: a sum of many terms, in a graph, bit for bit eager's ``AddN``."""

import numpy as np
import pytest
import tensorflow as tf

from terra.graph_ops import add_in_order, reorders


def _terms(rng, n, dtype):
    return [tf.cast(tf.constant(rng.normal(size=(64, 33)) * 10 ** rng.uniform(-3, 3)), dtype)
            for _ in range(n)]


def _bits(t):
    return tf.bitcast(t, tf.uint16 if t.dtype.size == 2 else
                      tf.uint32 if t.dtype.size == 4 else tf.uint64).numpy()


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.float16, tf.bfloat16])
def test_grouped_like_the_kernel_for_any_count(dtype):
    rng = np.random.default_rng(0)
    for n in range(2, 35):
        terms = _terms(rng, n, dtype)
        np.testing.assert_array_equal(_bits(add_in_order(terms)), _bits(tf.add_n(terms)),
                                      err_msg=f"{n} terms of {dtype.name}")


def test_only_sums_of_three_or_more_floats_are_rewritten():
    floats = [tf.ones((2,))] * 3
    assert reorders("AddN", floats)
    assert not reorders("AddN", floats[:2])  # two terms commute exactly
    assert not reorders("AddN", [tf.ones((2,), tf.int32)] * 3)  # integers add exactly
    assert not reorders("AddV2", floats)
