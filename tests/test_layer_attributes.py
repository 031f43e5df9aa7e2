"""A layer region's guard reads the Python attributes of the layer and its sublayers at every
call (``layer_regions._attributes``); a quick test (``library_regions.Watch``) says when
nothing changed, so the last reading is used again. Each change the full reading sees must
still be seen: a stale reading would skip a call whose Python now does something else."""

import pytest
import tensorflow as tf

from terra.keras_families import FAMILIES
from terra.layer_regions import _attributes

KERAS3 = FAMILIES[0]

keras = tf.keras


@pytest.fixture
def model():
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3),
                          keras.layers.Dropout(0.5), keras.layers.Dense(2)])
    m(tf.zeros((1, 4)))
    return m


def test_nothing_changed_gives_the_last_reading_itself(model):
    seen = _attributes(model, KERAS3)
    assert _attributes(model, KERAS3, seen) is seen


def test_a_value_bound_anew_is_read_again_and_compared_by_value(model):
    seen = _attributes(model, KERAS3)
    model.layers[1].rate = float("0.5")  # another float object, the same value
    again = _attributes(model, KERAS3, seen)
    assert again is not seen and again == seen
    model.layers[1].rate = 0.25
    assert _attributes(model, KERAS3, again) != seen


@pytest.mark.parametrize("change", [
    lambda m: setattr(m.layers[0], "extra", 1),  # a new attribute
    lambda m: delattr(m.layers[0], "extra_list"),  # one gone
    lambda m: m.layers[0].extra_list.append(2),  # a container grown in place
    lambda m: setattr(m.layers[0].kernel_initializer, "seed", 7),  # inside an initializer
    lambda m: setattr(m.layers[2], "kernel_initializer", keras.initializers.Ones()),  # rebound
], ids=["added", "deleted", "appended", "nested", "rebound"])
def test_every_change_the_full_reading_sees_is_seen(model, change):
    model.layers[0].extra_list = [1]
    seen = _attributes(model, KERAS3)
    change(model)
    full = _attributes(model, KERAS3)
    assert full != seen  # the full reading sees it...
    assert _attributes(model, KERAS3, seen) != seen  # ...and so does the reading given the last one


def test_specs_made_anew_with_the_same_contents_and_a_reordered_dict_are_no_change(model):
    layer = model.layers[0]
    layer.extra_number = 3
    layer.spec = (keras.InputSpec(shape=(None, 4)),)
    seen = _attributes(model, KERAS3)
    layer.spec = (keras.InputSpec(shape=(None, 4)),)  # another object, the same contents
    del layer.extra_number
    layer.extra_number = 3  # deleted and set again: now last in the dict
    again = _attributes(model, KERAS3, seen)
    assert again is not seen and again == seen
    layer.spec = (keras.InputSpec(shape=(None, 5)),)
    assert _attributes(model, KERAS3, again) != seen
