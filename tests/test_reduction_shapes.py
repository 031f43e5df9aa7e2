"""``standins.reduction_shape``: the output shape of a reduction for an input shape no trace
had, computed in Python from axes Python has instead of TF's shape function on a scratch
graph; it must be what the shape function gives, and None exactly where the shape function
raises (the caller then builds the op for its error). ``inferred_specs`` answers with it and
keeps the memo's contract: the specs hold for every call with these input shapes where the
axes are a constant, and for the axes' value where Python feeds them."""

import itertools
import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import dtypes

from terra import opdefs, standins
from terra.divergence import Divergence
from terra.nodes import SlotKind

SHAPES = [(), (5,), (0, 4), (3, 4), (2, 3, 4)]
# scalars and 1-D arrays: in range, negative, repeated (also as its negative), empty, out of
# range either way; of rank 2 (the shape function takes rank 1 at most, ArgMax rank 0)
AXES = [0, 1, 2, -1, -2, -3, 3, -4, [], [0], [-1], [0, 1], [1, 0], [0, 0], [0, -3], [2, -1],
        [0, 1, 2], [-1, -2, -3], [0, 5], [-4, 0], [[0]], [[0, 1]]]
X = tf.zeros((20, 4))  # more elements than Python holds as a value: its shape only


def _attrs(op_type, keep_dims, tidx):
    dtype = dtypes.bool if op_type in ("All", "Any") else dtypes.float32
    raw = ("T", dtype.as_datatype_enum, "Tidx", tidx.as_datatype_enum)
    raw += ("output_type", dtypes.int64.as_datatype_enum) if op_type.startswith("Arg") else \
        ("keep_dims", keep_dims)
    return opdefs.normalize_attrs(op_type, raw)


def _scratch(op_type, attrs, shape, axes):
    """The shape function's output shape, or None where it raises."""
    dtype = dtypes.bool if op_type in ("All", "Any") else dtypes.float32
    tidx = dtypes.as_dtype(dict(attrs)["Tidx"])
    try:
        [out] = opdefs.scratch_output_shapes(op_type, attrs, [
            ("shape", None, dtype, shape), ("value", axes, tidx, None)])
    except ValueError:
        return None
    return tuple(out.as_list())


@pytest.mark.parametrize("op_type", sorted(opdefs.REDUCTIONS))
def test_the_shape_is_the_shape_functions(op_type):
    answered = rejected = 0
    for keep_dims, tidx, shape, axes in itertools.product(
            (False, True), (dtypes.int32, dtypes.int64), SHAPES, AXES):
        attrs = _attrs(op_type, keep_dims, tidx)
        axes = np.asarray(axes, tidx.as_numpy_dtype)
        expected = _scratch(op_type, attrs, shape, axes)
        assert standins.reduction_shape(op_type, attrs, shape, axes) == expected, \
            (keep_dims, shape, axes)
        answered += expected is not None
        rejected += expected is None
    assert answered > 50 and rejected > 50  # the premise: both kinds of case, many of each


class _Step:
    """The parts of a ``plan.Step`` that ``inferred_specs`` reads, its axes in a ``kind``
    slot."""

    def __init__(self, op_type, kind, keep_dims=False):
        self.op_type, self.attrs = op_type, _attrs(op_type, keep_dims, dtypes.int32)
        self.out_specs = (((), "float32"),)
        self.slots = (types.SimpleNamespace(kind=SlotKind.NODE, dtype="float32"),
                      types.SimpleNamespace(kind=kind, dtype="int32"))


@pytest.fixture
def no_scratch(monkeypatch):
    """The scratch graph, counted: ``inferred_specs`` should not need it."""
    calls = []
    original = opdefs.scratch_output_shapes

    def counted(*args):
        calls.append(args[0])
        return original(*args)

    monkeypatch.setattr(opdefs, "scratch_output_shapes", counted)
    return calls


def test_constant_axes_give_specs_for_every_call(no_scratch):
    specs, values = standins.inferred_specs(
        _Step("Mean", SlotKind.CONST, keep_dims=True), [X, [0]], ((20, 4), (1,)), {}, {})
    assert specs == (((1, 4), "float32"),) and values is None
    small = tf.zeros((3, 4))  # a value Python has, computed: the shape holds whatever it is
    specs, values = standins.inferred_specs(
        _Step("Max", SlotKind.CONST), [small, -1], ((3, 4), ()), {}, {})
    assert specs == (((3,), "float32"),) and values is None
    assert no_scratch == []


def test_fed_axes_give_specs_for_their_value(no_scratch):
    step = _Step("Sum", SlotKind.FEED)
    specs, values = standins.inferred_specs(step, [X, np.array([1])], ((20, 4), (1,)), {}, {})
    assert specs == (((20,), "float32"),)
    other = standins.inferred_specs(step, [X, np.array([0])], ((20, 4), (1,)), {}, {})
    assert other[0] == (((4,), "float32"),)
    assert values is not None and other[1] is not None and other[1] != values
    assert no_scratch == []


def test_axes_out_of_range_are_the_shape_functions_divergence(no_scratch):
    with pytest.raises(Divergence, match="Invalid reduction dimension 2"):
        standins.inferred_specs(_Step("Sum", SlotKind.CONST), [X, [2]],
                                ((20, 4), (1,)), {}, {})
    assert no_scratch == ["Sum"]


def test_axes_python_has_not_are_left_to_the_shape_function(no_scratch):
    """Axes a graph op computes (a stand-in whose entry has no value): the shape function
    gives no output shape, a Divergence as before."""
    axes = tf.constant([0])
    tensors = {axes._id: types.SimpleNamespace(value=None)}
    with pytest.raises(Divergence, match="no output shape"):
        standins.inferred_specs(_Step("Sum", SlotKind.NODE), [X, axes],
                                ((20, 4), (1,)), tensors, {})
    assert no_scratch == ["Sum"]
