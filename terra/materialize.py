"""Route every materialization of a stand-in tensor through a resolver.

During co-execution Terra hands out *stand-ins*: real ``EagerTensor`` objects sharing a dummy
buffer, whose true value lives elsewhere (keyed by ``t._id``). Whenever Python reads a tensor's
value we must return the true value, never the dummy buffer. In TF 2.21 almost every such read
(``numpy()``, ``float``/``int``/``bool``/``__index__``, formatting, ``repr``/``str``, pickling,
``__array__``, ``tf.get_static_value``) goes through ``_EagerTensorBase._numpy``, so we patch it.

Two paths read the C buffer without calling ``_numpy``, so they are closed too:

* numpy's buffer protocol (``np.asarray``/``np.array``/``np.sum``/``np.float32(t)``,
  ``keras.ops.convert_to_numpy``): we clear the ``tp_as_buffer`` slot of the ``EagerTensor`` C
  type so numpy falls back to ``__array__`` (patched here; still zero-copy, and still read-only
  unless a copy is requested). While installed, ``memoryview(t)`` raises ``TypeError`` for *every*
  EagerTensor; ``uninstall()`` restores the slot.
* ``__dlpack__`` (``np.from_dlpack``): for a stand-in we build a real tensor from the resolved
  value on the stand-in's device and export *that* (a copy, not a view of the stand-in).

Tensors not in ``standins`` pay one dict membership test per materialization, but
``np.asarray(t)`` now goes through Python ``__array__`` (about 0.5 -> 2.7 us per call, most of
it numpy probing ``__array_struct__``/``__array_interface__`` through TF's Python
``Tensor.__getattr__``). On 3.12 the PEP 688 ``t.__buffer__`` wrapper still reads the buffer.
"""

import ctypes
import sys

import numpy as np
from tensorflow.python.eager import context
from tensorflow.python.framework import ops

__all__ = ["install", "uninstall", "installed"]

_Base = ops._EagerTensorBase
_EagerTensor = ops.EagerTensor
_PATCHED = ("_numpy", "__array__", "__dlpack__")

# Byte offsets into CPython's PyTypeObject (64-bit). The fields up to tp_flags are identical in
# 3.11 and 3.12: PyVarObject header (3 words), tp_name, tp_basicsize, tp_itemsize, tp_dealloc,
# tp_vectorcall_offset, tp_getattr, tp_setattr, tp_as_async, tp_repr, tp_as_number,
# tp_as_sequence, tp_as_mapping, tp_hash, tp_call, tp_str, tp_getattro, tp_setattro,
# tp_as_buffer (word 20), tp_flags (word 21); checked on 3.11.7 (EagerTensor) and 3.12.1
# (array.array: same clear/restore). Cross-checked at install time against the values the
# interpreter reports for tp_basicsize, tp_itemsize and tp_flags.
_SUPPORTED_PYTHONS = ((3, 11), (3, 12))
_OFF_BASICSIZE = 4 * 8
_OFF_ITEMSIZE = 5 * 8
_OFF_AS_BUFFER = 20 * 8
_OFF_FLAGS = 21 * 8

_originals = None  # {name: original attribute} while installed
_saved_as_buffer = None  # original tp_as_buffer pointer while installed


def _as_buffer_slot():
    """Return the ctypes view of EagerTensor's ``tp_as_buffer`` slot, after checking the layout."""
    if sys.version_info[:2] not in _SUPPORTED_PYTHONS or ctypes.sizeof(ctypes.c_void_p) != 8:
        raise RuntimeError(
            "terra.materialize: closing the buffer protocol of EagerTensor relies on the "
            f"PyTypeObject layout of 64-bit CPython {_SUPPORTED_PYTHONS}; running "
            f"{sys.version.split()[0]} ({8 * ctypes.sizeof(ctypes.c_void_p)}-bit)."
        )
    addr = id(_EagerTensor)
    basicsize = ctypes.c_ssize_t.from_address(addr + _OFF_BASICSIZE).value
    itemsize = ctypes.c_ssize_t.from_address(addr + _OFF_ITEMSIZE).value
    flags = ctypes.c_ulong.from_address(addr + _OFF_FLAGS).value
    if (basicsize, itemsize, flags) != (
        _EagerTensor.__basicsize__,
        _EagerTensor.__itemsize__,
        _EagerTensor.__flags__,
    ):
        raise RuntimeError("terra.materialize: unexpected PyTypeObject layout for EagerTensor.")
    return ctypes.c_void_p.from_address(addr + _OFF_AS_BUFFER)


def _type_modified():
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(_EagerTensor))


def install(standins: dict, resolve) -> None:
    """Patch the materialization paths.

    ``standins`` is a dict keyed by ``EagerTensor._id``; for a tensor ``t`` whose ``t._id`` is in
    it, every materialization path returns ``resolve(t)`` (a numpy array or numpy scalar with t's
    shape and dtype) instead of reading t's buffer. The dict is read live, so entries may be added
    and removed after installing. Other tensors behave as before (zero-copy ``np.asarray``), except
    that ``memoryview(t)`` raises ``TypeError`` while installed. Calling ``install`` again rebinds
    ``standins``/``resolve``; the saved originals are kept.
    """
    global _originals, _saved_as_buffer
    if _originals is None:
        for name in _PATCHED:
            if name in _EagerTensor.__dict__ or name not in _Base.__dict__:
                raise RuntimeError(f"terra.materialize: unexpected TF layout for {name!r}.")
        slot = _as_buffer_slot()
        if not slot.value:
            raise RuntimeError("terra.materialize: EagerTensor.tp_as_buffer is already NULL.")
        _originals = {name: _Base.__dict__[name] for name in _PATCHED}
        _saved_as_buffer = slot.value
        slot.value = None
        _type_modified()

    orig_numpy = _originals["_numpy"]
    orig_dlpack = _originals["__dlpack__"]

    def _numpy(self):
        if self._id in standins:
            value = resolve(self)
            # TF returns a numpy scalar for rank 0 (repr, numpy(), __bool__ depend on it).
            return value[()] if isinstance(value, np.ndarray) and not value.ndim else value
        return orig_numpy(self)

    def __array__(self, dtype=None, copy=None):
        if self._id in standins:
            # A view, so neither the flag below nor the caller can touch the resolver's array.
            a = np.asarray(resolve(self)).view()
        else:
            a = orig_numpy(self)  # a fresh ndarray viewing the tensor buffer (or a numpy scalar)
            if not isinstance(a, np.ndarray):
                a = np.asarray(a)
        if copy:
            return np.array(a, dtype=dtype, copy=True)
        a.flags.writeable = False  # tensors are immutable (the buffer protocol was read-only too)
        if dtype is None:
            return a
        return np.asarray(a, dtype=dtype, copy=copy)  # copy=False: ValueError if a cast is needed

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if self._id in standins:
            # Own copy: the consumer may write through the capsule; the resolver's array must
            # stay intact. Built directly (no op runs), on the stand-in's device.
            value = np.array(resolve(self), dtype=self.dtype.as_numpy_dtype, copy=True)
            context.ensure_initialized()
            self = ops.EagerTensor(value, self.device, self.dtype.as_datatype_enum)
        return orig_dlpack(
            self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy
        )

    _Base._numpy = _numpy
    _Base.__array__ = __array__
    _Base.__dlpack__ = __dlpack__


def uninstall() -> None:
    """Undo everything ``install()`` did (idempotent)."""
    global _originals, _saved_as_buffer
    if _originals is None:
        return
    for name, value in _originals.items():
        setattr(_Base, name, value)
    _as_buffer_slot().value = _saved_as_buffer
    _type_modified()
    _originals = _saved_as_buffer = None


def installed() -> bool:
    return _originals is not None
