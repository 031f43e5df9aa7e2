"""The differential helper itself must be able to fail: programs that return something else when
they are given Terra's tape, and the JSON round trip used for child processes."""

import json

import numpy as np
import pytest
import tensorflow as tf
from differential import _decode, _encode, assert_same_as_eager


def diverging(change):
    """A tapeless program returning ``change(value)`` instead of ``value`` in the Terra run."""

    def program(tape_cls, steps):
        under_terra = tape_cls is not tf.GradientTape
        losses = [np.float32(1.0 / (step + 1)) for step in range(steps)]
        results = {
            "losses": losses,
            "grads": [[np.ones((2, 2), np.float32), None] for _ in range(steps)],
            "count": 3,
            "printed": ["loss: 0.5000"],
        }
        return change(results) if under_terra else results

    return program


def bump_loss(results):
    results["losses"][3] = results["losses"][3] * np.float32(1.001)
    return results


def fill_none(results):
    results["grads"][2][1] = np.zeros((2, 2), np.float32)
    return results


def count_plus_one(results):
    results["count"] += 1
    return results


def reword(results):
    results["printed"] = ["loss= 0.5000"]
    return results


def drop_step(results):
    results["losses"].pop()
    return results


@pytest.mark.parametrize(
    "change, where",
    [
        (bump_loss, r"losses\[3\]"),
        (fill_none, r"grads\[2\]\[1\]"),
        (count_plus_one, r"count"),
        (reword, r"printed\[0\]"),
        (drop_step, r"losses: eager has 8 items, Terra 7"),
    ],
)
def test_helper_reports_where_terra_differs(change, where):
    with pytest.raises(AssertionError, match="Terra differs from eager at " + where):
        assert_same_as_eager(diverging(change), 8, min_coexecuted=0)


def within_tolerance(results):
    results["losses"] = [loss * np.float32(1 + 2e-7) for loss in results["losses"]]
    results["printed"] = ["loss: 0.50000001"]
    return results


def test_helper_tolerates_rounding_but_not_in_exact_keys(monkeypatch):
    monkeypatch.delenv("DIFFERENTIAL_EXACT", raising=False)
    try:
        assert_same_as_eager(diverging(within_tolerance), 8, min_coexecuted=0)
    except AssertionError as error:  # only Terra's stats may be off for a tapeless program
        assert "Terra differs" not in str(error)
    with pytest.raises(AssertionError, match=r"Terra differs from eager at losses\[0\]"):
        assert_same_as_eager(diverging(within_tolerance), 8, exact=("losses",), min_coexecuted=0)


def test_json_round_trip_is_exact():
    value = {
        "f32": np.array([[0.1, np.nan], [-np.inf, 1e-40]], np.float32),
        "scalar": np.float32(1 / 3),
        "ints": np.arange(3, dtype=np.int64),
        "mask": [True, None, 2.5, "text"],
        "empty": np.zeros((0, 3), np.float32),
    }
    back = json.loads(json.dumps(_encode(value)), object_hook=_decode)
    for key in ("f32", "ints", "empty"):
        assert back[key].dtype == value[key].dtype and back[key].shape == value[key].shape
        assert back[key].tobytes() == value[key].tobytes()
    assert back["scalar"].dtype == np.float32 and back["scalar"] == value["scalar"]
    assert back["mask"] == value["mask"]
