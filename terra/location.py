"""The user's line that issued an op: the first frame outside TF, Keras, Terra and stdlib.

Used in error messages, ``explain()`` and TraceGraph printing. Matching does not use it yet:
on a single path the position in the trace identifies an op (the call-id/loop-id stacks of
the paper's §3.2.2 arrive with dynamic control flow).
"""

import functools
import os
import sys
import sysconfig
from typing import NamedTuple


class Location(NamedTuple):
    file: str
    line: int
    func: str

    def __str__(self):
        return f"{self.file}:{self.line} ({self.func})"


def _library_dirs():
    import keras
    import numpy
    import tensorflow

    dirs = [os.path.dirname(os.path.dirname(tensorflow.__file__)) + os.sep + "tensorflow",
            os.path.dirname(keras.__file__), os.path.dirname(numpy.__file__),
            os.path.dirname(os.path.abspath(__file__)), sysconfig.get_paths()["stdlib"]]
    try:
        import tf_keras  # noqa: F401  (only to locate it)

        dirs.append(os.path.dirname(sys.modules["tf_keras"].__file__))
    except ImportError:
        pass
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


_LIBS = None


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str) -> bool:
    global _LIBS
    if _LIBS is None:
        _LIBS = _library_dirs()
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    real = os.path.realpath(filename)
    return real.startswith(_LIBS)


def user_location(frame=None) -> Location | None:
    """The innermost frame on the stack that belongs to user code."""
    f = frame or sys._getframe(1)
    while f is not None and _is_library(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return None
    return Location(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
