"""``standins.elementwise_shape``: the output shape of an elementwise op for input shapes no
trace had, computed in Python instead of TF's shape function on a scratch graph; it must be
what the shape function gives, for every op it answers."""

import pytest
from tensorflow.python.framework import dtypes

from terra import opdefs, standins
from terra.divergence import Divergence

SHAPES = [((3, 4),), ((3, 1), (1, 4)), ((), (5, 2)), ((2, 1, 4), (3, 1)), ((7,), (7,))]
FLOAT = dtypes.float32.as_datatype_enum
BOOL = dtypes.bool.as_datatype_enum


def _attrs(op_type, n):
    dtype = BOOL if op_type.startswith("Logical") else FLOAT
    if op_type == "Cast":
        return ("SrcT", FLOAT, "DstT", FLOAT, "Truncate", False)
    return () if op_type.startswith("Logical") else ("T", dtype)


def _scratch(op_type, shapes):
    dtype = dtypes.bool if op_type.startswith("Logical") else dtypes.float32
    inputs = [("shape", None, dtype, s) for s in shapes]
    if op_type in ("Select", "SelectV2"):
        inputs[0] = ("shape", None, dtypes.bool, shapes[0])
    attrs = opdefs.normalize_attrs(op_type, _attrs(op_type, len(shapes)))
    [out] = opdefs.scratch_output_shapes(op_type, attrs, inputs)
    return tuple(out.as_list())


@pytest.mark.parametrize("op_type", sorted(opdefs.SAME_SHAPE | opdefs.BROADCAST))
def test_the_shape_is_the_shape_functions(op_type):
    n = 3 if op_type == "SelectV2" else 1 if op_type in opdefs.SAME_SHAPE else 2
    for shapes in SHAPES:
        shapes = (shapes * 3)[:n] if len(shapes) < n else shapes[:n]
        if op_type == "SelectV2" and len(shapes) < 3:
            continue
        assert standins.elementwise_shape(op_type, shapes) == _scratch(op_type, shapes), shapes


def test_shapes_that_do_not_broadcast_are_a_divergence():
    with pytest.raises(Divergence):
        standins.elementwise_shape("Mul", ((3, 4), (2, 4)))


def test_other_ops_are_left_to_the_shape_function():
    assert standins.elementwise_shape("MatMul", ((3, 4), (4, 2))) is None


@pytest.mark.parametrize("shapes", [((3, 4), (3, 4), (3, 4)), ((3,), (3, 4), (3, 4)),
                                    ((5,), (5,), (5,)), ((), (), ())])
def test_select_has_its_branches_shape_where_the_condition_fits(shapes):
    assert standins.elementwise_shape("Select", shapes) == _scratch("Select", shapes)


@pytest.mark.parametrize("shapes", [((), (3, 4), (3, 4)), ((4,), (3, 4), (3, 4)),
                                    ((3, 4), (3, 4), (1, 4))])
def test_select_leaves_other_conditions_to_the_shape_function(shapes):
    assert standins.elementwise_shape("Select", shapes) is None
