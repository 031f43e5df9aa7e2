"""Sites: the interned call stack of an op is the whole stack's, whatever part of it the walk
reuses from the last one; the user's location is the innermost frame outside the libraries."""

import gc
import sys
import weakref

from terra import location
from terra.location import Sites


def full_stack(anchor_frame):
    """The reference: every frame from the caller's caller up to and including
    ``anchor_frame``, as (code, instruction offset), a call's ``PRECALL`` read as its
    ``CALL`` (``location._calls``: warm code reports the one, cold code the other)."""
    f, parts = sys._getframe(2), []
    while f is not None:
        parts.append((f.f_code, location._calls(f.f_code).get(f.f_lasti, f.f_lasti)))
        if f is anchor_frame:
            break
        f = f.f_back
    return tuple(parts)


class Probe:
    """Locates from the function that calls :meth:`here`, and keeps the reference beside."""

    def __init__(self):
        self.sites = Sites()
        self.seen = []  # (location, sid, reference stack)
        self.anchor = None

    def begin(self):
        self.anchor = sys._getframe(2)  # what Sites.begin_iteration anchors on
        self.sites.begin_iteration()

    def here(self):
        loc, sid = self.sites.locate(sys._getframe(1))
        self.seen.append((loc, sid, full_stack(self.anchor)))
        return loc


def assert_interned_alike(seen):
    """Two ops share a sid exactly when their whole stacks are the same."""
    by_sid, by_stack = {}, {}
    for _, sid, stack in seen:
        assert by_sid.setdefault(sid, stack) == stack
        assert by_stack.setdefault(stack, sid) == sid


def test_helpers_loops_generators_and_recursion_intern_like_the_whole_stack():
    probe = Probe()

    def helper():
        probe.here()
        probe.here()

    def gen():
        while True:
            probe.here()
            yield

    def recurse(n):
        probe.here()
        if n:
            recurse(n - 1)

    def step(g):
        probe.begin()
        helper()
        helper()  # another line: another stack
        for _ in range(3):
            probe.here()  # one line, one stack, however many trips
        next(g)  # the generator resumed from two lines of two frames
        inner_next(g)
        next(g)
        recurse(3)

    def inner_next(g):
        next(g)

    g = gen()
    for _ in range(3):
        step(g)
    assert_interned_alike(probe.seen)
    sids = {sid for _, sid, _ in probe.seen}
    stacks = {stack for _, _, stack in probe.seen}
    assert len(sids) == len(stacks) >= 12


def test_the_users_line_is_the_innermost_frame_outside_the_libraries():
    probe = Probe()

    def step():
        probe.begin()
        first = probe.here()
        return first, [probe.here() for _ in range(2)]

    first, (second, third) = step()
    assert first.file == __file__ and first.func == "step"
    assert second.func == "<listcomp>" and second.line == third.line != first.line


def test_release_lets_go_of_the_last_stacks_locals():
    probe = Probe()

    class Big:
        pass

    def issue():
        big = Big()
        probe.here()
        return weakref.ref(big)

    def step():
        probe.begin()
        return issue()

    ref = step()
    gc.collect()
    assert ref() is not None  # the frame of the last op is held until the next walk
    probe.sites.release()
    gc.collect()
    assert ref() is None


def _frames_in(fn, *args):
    """``fn(*args, here)`` where ``here()`` returns the frame that called it."""
    return fn(*args, lambda: sys._getframe(1))


def test_a_call_in_a_loops_body_is_told_from_one_after_it():
    def loops(here):
        found = []
        for _ in range(2):
            found.append(location.in_user_loop(here(), None))
        trips = 0
        while trips < 1:
            found.append(location.in_user_loop(here(), None))
            trips += 1
        found += [location.in_user_loop(here(), None) for _ in range(1)]
        found.append(location.in_user_loop(here(), None))
        return found

    assert _frames_in(loops) == [True, True, True, True, False]


def test_a_loop_over_what_the_caller_accepts_does_not_count():
    def over(items, here):
        return [location.in_user_loop(here(), None, lambda v, item=item: v is item)
                for item in items]

    assert _frames_in(over, ["a", "b"]) == [False, False]
    assert location.in_user_loop(sys._getframe(), None) is False  # pytest's loops: library


def test_the_loop_around_the_iterations_entry_does_not_count():
    def training(here):
        found = []
        for _ in range(2):  # the training loop
            entry = (id(sys._getframe()), sys._getframe().f_lasti)  # the tape's ``with``
            found.append(location.in_user_loop(here(), entry))
            for _ in range(1):  # a loop inside the iteration
                found.append(location.in_user_loop(here(), entry))
        return found

    assert _frames_in(training) == [False, True, False, True]


def test_a_new_call_of_a_function_around_the_last_tape_is_not_taken_for_it():
    """The loop's own helper (``run(program, 1)``: draw a batch, step) returns after each
    step, and its next call draws the next batch before the next tape opens: an op of the
    last iteration, from a new frame of a function that ran it. Wherever CPython puts the
    new frame (often where the last one was), its stack is the same: once the anchor was
    known by frame ids, a reused id cut the stack short in some iterations and not in
    others, and the TraceGraph got two nodes for one op (a branch point, more traces, and a
    node whose shapes were never relaxed)."""
    sites = Sites()
    kept = []

    def draw():
        while True:
            yield sites.stack(sys._getframe(0))

    def step():
        sites.begin_iteration()  # the tape's enter: the frames above run the loop

    def one_step(g, keep):
        if keep:
            kept.append(sys._getframe())  # a frame kept alive: its id is no other's
        sid = next(g)
        step()
        return sid

    def iterations(g, keep):
        return [one_step(g, keep) for _ in range(4)]

    g = draw()
    held = iterations(g, True)[1:]  # the first: from a new comprehension's frame, another stack
    kept.clear()
    freed = iterations(g, False)[1:]
    assert len(set(held)) == 1 and set(freed) == set(held), (held, freed)
