"""Where an op was issued: the user's line for people, the executed location for merging.

``Location`` (file, line, function of the first frame of the user's code, as
``terra.boundary`` draws the line) is what error messages, ``explain()`` and TraceGraph
printing show.

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

import dis
import functools
import inspect
import sys
from typing import NamedTuple

from terra.boundary import is_internal as _is_internal
from terra.boundary import is_library as _is_library


class Location(NamedTuple):
    file: str
    line: int
    func: str

    def __str__(self):
        return f"{self.file}:{self.line} ({self.func})"


Site = tuple[int, int]  # (interned call stack, occurrence in the iteration)

# a frame of such code can be suspended, and resumed from another caller
_RESUMABLE = (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
              | inspect.CO_ITERABLE_COROUTINE)


def user_location(frame=None) -> Location | None:
    """The innermost frame on the stack that belongs to user code."""
    f = frame or sys._getframe(1)
    while f is not None and _is_library(f.f_code.co_filename):
        f = f.f_back
    if f is None:
        return None
    return Location(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)


def in_user_loop(frame, entry, over=None) -> bool:
    """Whether ``frame`` or a user frame it was called from is in the body of a Python loop
    (``for``, ``while``, a comprehension) at the line running now. The walk stops at the
    frame the iteration was entered from (``entry``: its ``(id, f_lasti)``, the tape's
    ``with``), where only loops inside the iteration count: the loop around it is the
    training loop. Library frames are passed over (a model's own loop over its layers
    calls each layer once). A ``for`` loop whose variable holds a value ``over`` accepts
    (a loop over layers, each called once) does not count."""
    f = frame
    stop, entered_at = entry if entry is not None else (None, -1)
    while f is not None:
        code = f.f_code
        if id(f) == stop:
            return any(entered_at < start <= f.f_lasti <= end and not _over(f, name, over)
                       for start, end, name in _loops(code))
        if not _is_library(code.co_filename) and \
                any(start <= f.f_lasti <= end and not _over(f, name, over)
                    for start, end, name in _loops(code)):
            return True
        f = f.f_back
    return False


def _over(frame, name, over):
    return name is not None and over is not None and over(frame.f_locals.get(name))


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_PRECALL, _CALL = dis.opmap["PRECALL"], dis.opmap["CALL"]


def entry_point(frame):
    """``(id, f_lasti)`` of the first frame from ``frame`` out that is not Terra's: where
    the user's code entered an iteration (:func:`in_user_loop`)."""
    while frame is not None and _is_internal(frame.f_code.co_filename):
        frame = frame.f_back
    return None if frame is None else (id(frame), frame.f_lasti)


@functools.lru_cache(maxsize=4096)
def _loops(code) -> tuple:
    """The bytecode ranges of ``code``'s loops, from a backward jump's target to the jump (a
    conditional one too: 3.11 closes some ``while`` loops with one), with the name a ``for``
    loop binds each trip (None for another loop, or a loop unpacking into several)."""
    instructions = list(dis.get_instructions(code))
    bound = {ins.offset: after.argval for ins, after in zip(instructions, instructions[1:])
             if ins.opname == "FOR_ITER" and after.opname in ("STORE_FAST", "STORE_NAME",
                                                                "STORE_DEREF")}
    return tuple((ins.argval, ins.offset, bound.get(ins.argval)) for ins in instructions
                 if ins.opcode in _JUMPS and ins.argval <= ins.offset)


def _calls(code) -> dict:
    """A call's offset as a frame may report it -> the offset the call is known by. In
    CPython 3.11 a call is ``PRECALL`` then ``CALL``; once the code is warm (after some
    calls or loop trips), a ``PRECALL`` specialized for a builtin (``next(it)``,
    ``float(x)``) makes the call itself, and a frame suspended in it reports the
    ``PRECALL``'s offset where it reported the ``CALL``'s before: the same op would have
    two stacks, one before the code warmed up and one after. Read from the raw code units
    (an opcode every two bytes, inline caches zeroed): ``dis`` takes twenty times as long,
    once for every code object a first trace meets."""
    calls, pending = {}, None
    raw = code.co_code
    for offset in range(0, len(raw), 2):
        op = raw[offset]
        if op == _PRECALL:
            pending = offset
        elif op == _CALL and pending is not None:
            calls[pending] = offset
            pending = None
    return calls


class Sites:
    """The executed locations of one runtime: the interned call stacks (shared by all its
    traces, so sites compare across iterations) and this iteration's occurrence counts.

    A call stack is interned frame by frame, outermost first, as a path in a trie: (the
    stack above, code object, instruction offset) -> a small integer. An op is located (its
    user's line and its stack) by walking up only to the deepest frame of the last stack
    walked that is still running: a plain function's frame that was on the stack then and
    is now has run all along, so the frames above it are suspended in the same calls and
    their part of the stack and of the user's line is the one found then. (A generator's
    frame can be resumed from elsewhere: it is walked past.) A deep library stack
    (GPflow's, 30 to 60 frames an op) costs a frame or two an op instead of all of them.
    The last stack's frames are held until the next walk, and let go between iterations
    (:meth:`release`), so that no tensor outlives its iteration because of them."""

    _ROOT = -1

    def __init__(self):
        self._nodes: dict[tuple, int] = {}  # (node above, id(code), offset) -> node
        # id(code) -> (code, internal, library, resumable, _calls(code)): the code is kept
        # alive, so its id stays its own (a code object's own hash digests its bytecode: slow)
        self._codes: dict[int, tuple] = {}
        self._anchor = frozenset()  # ids of the frames running the loop: a stack stops there
        self._anchor_frames = ()  # those frames, held: see begin_iteration
        self._counts: dict[int, int] = {}
        # the last stack walked, outermost first: (frame, node above it, user's location
        # above it), and id(frame) -> its index (the frames are held: the ids are theirs)
        self._chain: list[tuple] = []
        self._at: dict[int, int] = {}

    def begin_iteration(self):
        """Called from the outermost tape's ``__enter__``: the frames above the one entering
        it run the training loop, so a stack stops at the first of them. They are held until
        the iteration ends (:meth:`release`): one that returns meanwhile (the loop's helper
        around a step, called again to draw the next batch before the next tape) keeps its
        id, so a new frame CPython puts in its place is not taken for it. A stack walked
        from that new frame goes on to the frames still running the loop, the same in every
        iteration; known by ids alone, the walk stopped there in some iterations only."""
        self.release()
        f = sys._getframe(1)
        while f is not None and _is_internal(f.f_code.co_filename):
            f = f.f_back
        anchor = []
        f = f.f_back if f is not None else None
        while f is not None:
            anchor.append(f)
            f = f.f_back
        self._anchor_frames = tuple(anchor)
        self._anchor = frozenset(map(id, anchor))
        self._counts = {}

    def release(self):
        """Let go of the frames of the last stack walked and of the frames that ran the
        loop (and the locals they hold): the iteration is over. Its stand-ins are swept
        next, and a frame held here would keep one alive."""
        self._forget_chain()
        self._anchor_frames = ()
        self._anchor = frozenset()

    def _forget_chain(self):
        self._chain.clear()
        self._at.clear()

    def _code(self, code) -> tuple:
        info = self._codes.get(id(code))
        if info is None:
            name = code.co_filename
            info = self._codes[id(code)] = (code, _is_internal(name), _is_library(name),
                                            bool(code.co_flags & _RESUMABLE), _calls(code))
        return info

    def locate(self, frame=None) -> tuple[Location | None, int]:
        """(the user's location, the interned call stack) of the op being issued now."""
        f = frame or sys._getframe(1)
        codes, code_info = self._codes, self._code
        while f is not None:  # TF's and Terra's own frames above the op's issuer
            info = codes.get(id(f.f_code)) or code_info(f.f_code)
            if not info[1]:
                break
            f = f.f_back
        chain, at, anchor = self._chain, self._at, self._anchor
        new = []  # the frames not known to be as they were, innermost first
        while f is not None:
            i = at.get(id(f))
            if i is not None and not (codes.get(id(f.f_code)) or code_info(f.f_code))[3]:
                break  # running since the last walk: the frames above are as they were
            new.append(f)
            if id(f) in anchor:
                f = None
                break
            f = f.f_back
        if f is None:  # nothing of the last stack is still running
            self._forget_chain()
            node, loc = self._ROOT, None
            top = new[-1].f_back if new else None
            if top is not None:  # the user's line may be above the loop (Keras' fit)
                loc = user_location(top)
        else:  # the frame at i is walked again: its offset may have moved on
            for g, *_ in chain[i + 1:]:
                del at[id(g)]
            del chain[i + 1:]
            _, node, loc = chain.pop()
            new.append(f)
        nodes = self._nodes
        for g in reversed(new):
            at[id(g)] = len(chain)
            chain.append((g, node, loc))
            code = g.f_code
            info = codes.get(id(code)) or code_info(code)
            offset = g.f_lasti
            key = (node, id(code), info[4].get(offset, offset))
            node = nodes.get(key)
            if node is None:
                node = nodes[key] = len(nodes)
            if not info[2]:
                loc = Location(code.co_filename, g.f_lineno, code.co_name)
        return loc, node

    def stack(self, frame=None) -> int:
        """The interned call stack of the op being issued now."""
        return self.locate(frame or sys._getframe(1))[1]

    def here(self) -> tuple[Location | None, Site]:
        """The user's location and the site of the op being issued now; counts it."""
        loc, sid = self.locate(sys._getframe(1))
        n = self._counts.get(sid, 0)
        self._counts[sid] = n + 1
        return loc, (sid, n)

    def note(self, site: Site):
        """An op of this iteration recorded with a known site (a replayed one): count it."""
        sid, n = site
        if self._counts.get(sid, 0) <= n:
            self._counts[sid] = n + 1
