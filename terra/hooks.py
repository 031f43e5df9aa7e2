"""The process-wide hook table: every stand-in and traced value Terra hands out, keyed by
``EagerTensor._id``, with what it resolves to.

One table for the process, not one per runtime: stand-ins handed out by a runtime that
``terra.reset()`` dropped must keep resolving. The recorder adds its traced values, the
PythonRunner its stand-ins, the doors swap them for values, and ``materialize`` sends every
way Python reads a tensor here (``resolve``). Its own module so that the doors and the
runtime share it without importing each other.
"""

from tensorflow.python.framework import ops

from terra import materialize

tensors: dict = {}

# ``EagerTensor._numpy`` as TF defines it, taken before materialize patches it: the way to
# read a tensor's own buffer once every ``_numpy`` call comes here.
original_numpy = ops._EagerTensorBase._numpy


def resolve(t):
    """The value of the stand-in or traced value ``t`` (materialize's resolver)."""
    return tensors[t._id].numpy(t)


def install():
    """Route every materialization of a tensor in the table through :func:`resolve`."""
    materialize.install(tensors, resolve)
