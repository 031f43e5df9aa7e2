"""Every way Python can read a tensor's value must return the resolved value for a stand-in."""

import contextlib
import copy
import io
import pickle

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

from terra import materialize

_Base = ops._EagerTensorBase


@pytest.fixture
def unhooked():
    """No hook installed during the test; a Terra runtime's global hook is put back after."""
    runtime_hook = materialize.installed()  # a Terra test ran first: its hook stays global
    materialize.uninstall()
    yield
    if runtime_hook:
        from terra import hooks

        hooks.install()


@pytest.fixture
def standins(unhooked):
    """Install with a resolver returning the registered "true" value; uninstall afterwards."""
    table = {}
    originals = {name: _Base.__dict__[name] for name in ("_numpy", "__array__", "__dlpack__")}
    materialize.install(table, lambda t: table[t._id])
    yield table
    materialize.uninstall()
    assert {name: _Base.__dict__[name] for name in originals} == originals


def _printed(x):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print(x)
    return buf.getvalue()


def _check_text_paths(t, true):
    ref = tf.constant(true)  # unregistered tensor holding the true value: TF's own formatting
    assert repr(t) == repr(ref)
    assert str(t) == str(ref)
    assert f"{t}" == f"{ref}"
    assert _printed(t) == _printed(ref)


def test_array_standin_every_path(standins):
    t = tf.constant([[1.0, 2.0], [3.0, 4.0]])  # the dummy buffer
    true = np.full((2, 2), 7.0, np.float32)
    standins[t._id] = true

    np.testing.assert_array_equal(t.numpy(), true)
    _check_text_paths(t, true)
    for a in (np.asarray(t), np.array(t), np.asarray(t, copy=False),
              keras.ops.convert_to_numpy(t), tf.get_static_value(t), np.from_dlpack(t)):
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, true)
    a64 = np.array(t, dtype=np.float64)
    assert a64.dtype == np.float64
    np.testing.assert_array_equal(a64, true)
    assert np.sum(t) == 28.0
    np.testing.assert_array_equal(np.add(t, 1), true + 1)

    # pickle materializes into a real tensor; deepcopy returns the stand-in itself (TF treats
    # EagerTensors as immutable), which keeps resolving while it is registered.
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(t)).numpy(), true)
    assert copy.deepcopy(t) is t
    np.testing.assert_array_equal(copy.deepcopy(t).numpy(), true)

    # Nothing handed out may write into the resolver's array.
    assert not np.asarray(t).flags.writeable
    for a in (t.numpy(), np.array(t), np.from_dlpack(t)):
        assert not np.shares_memory(a, true)
    with pytest.raises(TypeError):
        memoryview(t)


@pytest.mark.parametrize("as_scalar", [True, False], ids=["np-scalar", "0d-array"])
def test_scalar_standin_every_path(standins, as_scalar):
    def register(t, value):
        v = np.asarray(value, t.dtype.as_numpy_dtype)
        standins[t._id] = v[()] if as_scalar else v

    f = tf.constant(2.5)
    register(f, 7.25)
    assert float(f) == 7.25
    assert int(f) == 7
    assert complex(f) == 7.25
    assert f"{f:.3f}" == "7.250"
    assert np.float32(f) == np.float32(7.25)
    assert np.asarray(f).shape == () and np.asarray(f) == 7.25
    assert f.numpy() == 7.25 and tf.get_static_value(f) == 7.25
    _check_text_paths(f, np.float32(7.25))

    i = tf.constant(3)
    register(i, 5)
    assert i.__index__() == 5
    assert len(range(i)) == 5
    assert [0, 1, 2, 3, 4, 5][i] == 5
    _check_text_paths(i, np.int32(5))

    zero_buf, one_buf = tf.constant(0.0), tf.constant(1.0)
    register(zero_buf, 1.0)
    register(one_buf, 0.0)
    assert bool(zero_buf) and not bool(one_buf)
    taken = "yes" if zero_buf else "no"
    assert taken == "yes"


def test_unregistered_tensors_unchanged_and_zero_copy(standins):
    standins[tf.constant(0.0)._id] = np.float32(9.0)  # some other registered tensor
    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    t = tf.constant(value)
    s = tf.constant(3)

    np.testing.assert_array_equal(t.numpy(), value)
    for a in (np.asarray(t), np.array(t), keras.ops.convert_to_numpy(t),
              tf.get_static_value(t), np.from_dlpack(t), pickle.loads(pickle.dumps(t)).numpy()):
        np.testing.assert_array_equal(a, value)
    assert np.sum(t) == 15.0
    assert (int(s), float(s), bool(s), len(range(s)), f"{s:03d}") == (3, 3.0, True, 3, "003")
    assert "numpy=3" in repr(s) and str(s) == "tf.Tensor(3, shape=(), dtype=int32)"

    big = tf.constant(np.ones(1_000_000, np.float32))
    a, b = np.asarray(big), np.asarray(big)
    assert a.ctypes.data == b.ctypes.data  # both view the tensor's own buffer
    assert np.shares_memory(a, np.asarray(big, copy=False))
    assert not a.flags.writeable  # read-only, as with the buffer protocol
    assert not np.shares_memory(a, np.array(big))
    with pytest.raises(TypeError):
        memoryview(t)  # documented: the buffer protocol is closed for every EagerTensor


def test_dict_is_live(standins):
    t = tf.constant([1, 2])
    standins[t._id] = np.array([8, 9], np.int32)
    np.testing.assert_array_equal(np.asarray(t), [8, 9])
    del standins[t._id]
    np.testing.assert_array_equal(np.asarray(t), [1, 2])


def test_uninstall_restores_and_both_are_idempotent(unhooked):
    table = {}
    t = tf.constant([1.0, 2.0])
    table[t._id] = np.array([7.0, 7.0], np.float32)
    originals = {name: _Base.__dict__[name] for name in ("_numpy", "__array__", "__dlpack__")}

    materialize.install(table, lambda x: table[x._id])
    materialize.install(table, lambda x: table[x._id])  # second install: rebinds only
    assert materialize.installed()
    np.testing.assert_array_equal(np.asarray(t), [7.0, 7.0])
    with pytest.raises(TypeError):
        memoryview(t)

    materialize.uninstall()
    materialize.uninstall()
    assert not materialize.installed()
    assert {name: _Base.__dict__[name] for name in originals} == originals
    np.testing.assert_array_equal(np.asarray(memoryview(t)), [1.0, 2.0])
    for a in (t.numpy(), np.asarray(t), np.array(t), np.from_dlpack(t)):
        np.testing.assert_array_equal(a, [1.0, 2.0])
    assert float(tf.constant(2.5)) == 2.5 and "1., 2." in repr(t)
