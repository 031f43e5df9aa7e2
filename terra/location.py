"""Where an op was issued: the user's line for people, the executed location for merging.

``Location`` (file, line, function of the first frame outside TF, Keras, numpy, stdlib and
Terra) is what error messages, ``explain()`` and TraceGraph printing show.

A ``Site`` is the executed location the TraceGraph matches on (paper §3.2.2, Figure 3.3):

- the *call stack*, the code object and instruction offset of every frame from the op's
  issuer (the first frame outside TF and Terra, so Keras' own frames count) up to the frame
  that runs the training loop, interned to a small integer. Two calls of one helper from two
  lines differ here; so do recursion depths and the layers of a Keras ``Sequential``;
- the *occurrence*: how many ops this iteration has already issued from the very same stack.
  A Python loop is the only way one stack issues ops twice in an iteration, so the occurrence
  counts loop trips (for nested loops, the trips of all of them together).

The paper keeps these stacks with a gast rewrite of every user function. That cannot work for
the loop users write inline in a function that is already running when the first tape opens,
nor for code without source; reading the live frames works for both, for generators and
comprehensions (each its own frame) and for library code, and costs nothing outside tracing.
What it gives up is the loop *identity*: the occurrence counts trips of the innermost loops
around the stack taken together. docs/architecture.md §3.10 has the measurements.
"""

import functools
import importlib.util
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


Site = tuple[int, int]  # (interned call stack, occurrence in the iteration)


def _package_dirs(*names):
    """The folders of the installed top-level packages ``names``, found without importing
    them (importing Keras 3 into a tf_keras program costs seconds and pulls in scikit-learn)."""
    dirs = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            dirs.append(os.path.realpath(os.path.dirname(spec.origin)) + os.sep)
    return tuple(dirs)


@functools.lru_cache(maxsize=1)
def _library_dirs():
    return _internal_dirs() + _package_dirs("keras", "numpy", "tf_keras") + (
        os.path.realpath(sysconfig.get_paths()["stdlib"]) + os.sep,)


@functools.lru_cache(maxsize=1)
def _internal_dirs():
    """TF's and Terra's own code: the frames between an op's issuer and the op differ between
    tracing (op callbacks) and co-execution (Terra's doors), so sites never include them."""
    import tensorflow

    tf_dir = os.path.dirname(os.path.dirname(tensorflow.__file__)) + os.sep + "tensorflow"
    return (os.path.realpath(tf_dir) + os.sep,
            os.path.realpath(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def _under(filename, dirs):
    if filename.startswith("<"):
        return filename.startswith("<frozen")
    return os.path.realpath(filename).startswith(dirs)


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str) -> bool:
    return _under(filename, _library_dirs())


@functools.lru_cache(maxsize=4096)
def _is_internal(filename: str) -> bool:
    return not filename.startswith("<") and _under(filename, _internal_dirs())


def user_location(frame=None) -> Location | None:
    """The innermost frame on the stack that belongs to user code."""
    f = frame or sys._getframe(1)
    while f is not None and _is_library(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return None
    return Location(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)


class Sites:
    """The executed locations of one runtime: the interned call stacks (shared by all its
    traces, so sites compare across iterations) and this iteration's occurrence counts."""

    def __init__(self):
        self._stacks: dict[tuple, int] = {}
        self._codes = set()
        self._anchor = frozenset()
        self._counts: dict[int, int] = {}

    def begin_iteration(self):
        """Called from the outermost tape's ``__enter__``: the frames above the one entering
        it run the training loop, so a stack stops at the first of them."""
        f = sys._getframe(1)
        while f is not None and _is_internal(f.f_code.co_filename):
            f = f.f_back
        anchor = set()
        f = f.f_back if f is not None else None
        while f is not None:
            anchor.add(id(f))  # ids only: holding frames would keep their locals alive
            f = f.f_back
        self._anchor = frozenset(anchor)
        self._counts = {}

    def stack(self, frame=None) -> int:
        """The interned call stack of the op being issued now."""
        f = frame or sys._getframe(1)
        while f is not None and _is_internal(f.f_code.co_filename):
            f = f.f_back
        anchor = self._anchor
        parts = []
        append = parts.append
        while f is not None:
            code = f.f_code
            append(id(code))  # a code object's own hash digests its bytecode: slow
            append(f.f_lasti)
            if id(f) in anchor:
                break
            f = f.f_back
        key = tuple(parts)
        sid = self._stacks.get(key)
        if sid is None:
            sid = self._stacks[key] = len(self._stacks)
            g = frame or sys._getframe(1)
            while g is not f:  # keep the code objects alive, so their ids stay theirs
                self._codes.add(g.f_code)
                g = g.f_back
            self._codes.add(code)
        return sid

    def here(self) -> Site:
        """The site of the op being issued now; counts it."""
        sid = self.stack(sys._getframe(1))
        n = self._counts.get(sid, 0)
        self._counts[sid] = n + 1
        return (sid, n)

    def note(self, site: Site):
        """An op of this iteration recorded with a known site (a replayed one): count it."""
        sid, n = site
        if self._counts.get(sid, 0) <= n:
            self._counts[sid] = n + 1
