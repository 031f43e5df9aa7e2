"""The scratch-graph shape inference that generation and the PythonRunner share, and the
gradient-flow answers the PythonRunner checks a folded gradient region with."""

import pytest
import tensorflow as tf
from tensorflow.python.framework import errors

from terra import opdefs


def matmul(a_shape, b_shape):
    attrs = opdefs.normalize_attrs("MatMul", ("T", tf.float32.as_datatype_enum))
    inputs = [("shape", None, tf.float32, a_shape), ("shape", None, tf.float32, b_shape)]
    return opdefs.scratch_output_shapes("MatMul", attrs, inputs)


def test_an_answer_asked_again_comes_from_the_memo_without_a_new_op():
    [first] = matmul((4, 3), (3, 5))
    ops_before = len(opdefs._scratch.graph.get_operations())
    [again] = matmul((4, 3), (3, 5))
    assert first.as_list() == again.as_list() == [4, 5]
    assert len(opdefs._scratch.graph.get_operations()) == ops_before
    [other] = matmul((2, 3), (3, 7))  # other shapes: inferred, not remembered
    assert other.as_list() == [2, 7]


def test_a_rejection_is_raised_every_time_it_is_asked():
    for _ in range(5):
        with pytest.raises((ValueError, errors.InvalidArgumentError)) as raised:
            matmul((4, 3), (2, 5))
        assert raised.value.__traceback__ is not None
        depth = len(list(_frames(raised.value.__traceback__)))
    assert depth < 10  # the memoized error's traceback does not grow with every raise


def _frames(tb):
    while tb is not None:
        yield tb
        tb = tb.tb_next


def test_gradient_flows_asks_the_registered_gradient_function():
    f32, i32 = tf.float32.as_datatype_enum, tf.int32.as_datatype_enum
    res = tf.resource.as_datatype_enum
    matmul_attrs = opdefs.normalize_attrs("MatMul", ("T", f32))
    assert opdefs.gradient_flows("MatMul", matmul_attrs, (f32, f32)) == (True, True)
    assert opdefs.gradient_flows("ReadVariableOp", (("dtype", f32),), (res,)) == (True,)
    # registered, but its gradient function gives None: no gradient reaches the input
    assert opdefs.gradient_flows("Round", (("T", f32),), (f32,)) == (False,)
    assert opdefs.gradient_flows("StopGradient", (("T", f32),), (f32,)) == (False,)
    # a gather differentiates its params, not its indices or axis
    gather = (("Tparams", f32), ("Tindices", i32), ("Taxis", i32), ("batch_dims", 0))
    assert opdefs.gradient_flows("GatherV2", gather, (f32, i32, i32)) == (True, False, False)
