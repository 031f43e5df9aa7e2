"""The replica threads of an eager ``MirroredStrategy.run`` as turns of the training loop's
thread.

An eager ``strategy.run`` (``mirrored_run._call_for_each_replica``) starts one
``_MirroredReplicaThread`` per local replica, new for every call, and runs them one at a time:
the calling thread sets a replica's ``should_run`` event and waits for its ``has_paused``;
the replica runs until its ``merge_call`` (the optimizer's all-reduce) or the end of the step;
after every replica paused, the calling thread runs the merge function and the replicas
resume, in order. So while a run lasts exactly one of those threads runs Python at a time,
and the ops of an iteration, the loop's and every replica's, come in one order, the same in
every iteration. Terra treats them as one thread of control: the thread that holds the
*turn* is the one its doors, tape marks and recorder serve (``Runtime.owner``,
``interception._owner``, the native door's ``owner``).

A turn passes where a thread returns from waiting on one of those two events: replica threads
of a run started by the loop's thread get :class:`_Turn` events (TF's own ``threading.Event``,
whose ``wait`` then hands the turn to the thread that returns from it). Nothing else changes
in TF: the events are set, cleared and waited on as before. When the run returns (or
raises) the turn is the caller's again.

Only ``MirroredStrategy`` on one worker is followed (``supported``): its cross-device
reductions are issued on the loop's thread during the merge (its collective all-reduce as one
function call: ``terra.collectives``). Replicas of a ``MultiWorkerMirroredStrategy`` meet
other processes' collective ops, which one process's graph cannot order; their tapes stay
plain (``terra.distribute``). A region (a layer's call, a gradient call) must lie within one
turn: :func:`_regions_across` says what happens to one that does not.
"""

import functools
import threading

from tensorflow.python.distribute import mirrored_run, mirrored_strategy

from terra import collectives, interception

_ident = threading.get_ident

_installed = False
_runs = threading.local()  # the loop thread's strategy.run calls under way (depth)


def supported(strategy) -> bool:
    """Whether Terra follows ``strategy``'s replica threads: a ``MirroredStrategy`` over the
    devices of this process (its extended class exactly, not a multi-worker subclass)."""
    return type(strategy.extended) is mirrored_strategy.MirroredExtended


class _Turn(threading.Event):
    """A replica thread's ``should_run`` or ``has_paused``: the thread its ``wait`` returns
    in holds the turn from there on (if its run is the current runtime's loop's: the runtime
    may have been built, or reset, since the run began)."""

    def wait(self, timeout=None):
        got = super().wait(timeout)
        rt = _current()
        if rt is not None and rt.loop_thread == loop_thread_of_current():
            take_turn(rt, _ident())
        return got


def _no_runtime():
    return None


_current = _no_runtime  # the runtime, if one was built since the last reset (install's)


def in_run() -> bool:
    """Whether a followed ``strategy.run`` is under way (called on the loop's thread or in
    its replicas)."""
    return getattr(_runs, "depth", 0) > 0 or _followed(threading.current_thread())


def _followed(thread) -> bool:
    return getattr(thread, "terra_turns", None) is not None


def replica_of(thread):
    """The run a followed replica thread belongs to (its ``Coordinator``, one per call), or
    None for any other thread."""
    return thread.coord if _followed(thread) else None


def install(current):
    """Wrap the replica thread's constructor and the run, once per process: they act only
    while a runtime's loop thread calls ``strategy.run`` with a supported strategy.
    ``current()``: the runtime, or None (``terra.runtime.current``)."""
    global _installed, _current
    _current = current
    if _installed:
        return
    _installed = True
    init = mirrored_run._MirroredReplicaThread.__init__
    call = mirrored_run._call_for_each_replica

    @functools.wraps(init)
    def __init__(self, dist, *args, **kwargs):
        init(self, dist, *args, **kwargs)
        self.terra_turns = None
        rt = _current()
        parent = _ident()
        if getattr(_runs, "depth", 0) and supported(dist) and (
                rt is None or parent == rt.loop_thread):
            # (with no runtime yet, it may be built in this very thread, at its first tape)
            self.terra_turns = (parent,)
            self.should_run, self.has_paused = _Turn(), _Turn()
            _runs.threads.append(self)

    @functools.wraps(call)
    def _call_for_each_replica(distribution, fn, args, kwargs):
        rt = _current()
        me = _ident()
        if not supported(distribution) or rt is not None and rt.loop_thread != me:
            return call(distribution, fn, args, kwargs)
        _runs.depth = getattr(_runs, "depth", 0) + 1
        outer, _runs.threads = getattr(_runs, "threads", None), []
        if rt is not None:
            take_turn(rt, me)  # optimizer regions are off while the run lasts
        try:
            return call(distribution, fn, args, kwargs)
        finally:
            _runs.depth -= 1
            _let_go(_runs.threads)
            _runs.threads = outer
            rt = _current()
            if rt is not None and rt.loop_thread == me:
                take_turn(rt, me)  # the run is over (or raised): the loop's thread again

    mirrored_run._MirroredReplicaThread.__init__ = __init__
    mirrored_run._call_for_each_replica = _call_for_each_replica
    collectives.install(in_run)


# what a finished replica thread holds of its step: its arguments, result and merge values
_HELD = ("main_fn", "main_args", "main_kwargs", "main_result", "merge_fn", "merge_args",
         "merge_kwargs", "merge_result")


def take_turn(rt, ident):
    """The thread ``ident`` runs now, while the others of its strategy.run wait: the
    runtime ``rt``'s doors and tape marks serve it from here on (called in that thread)."""
    rt.owner = ident
    running = in_run()
    rt.update_owner = None if running else ident
    _regions_across(rt)
    rt.layer_owner = ident if not running or rt.layers_in_runs else None
    interception.take_turn(ident)
    door = rt.coexec_door.fast_entry
    if hasattr(door, "owner"):  # the native door
        door.owner = ident


def _regions_across(rt):
    """The turn passed inside a call the trace records as one region (a merge_call in a
    layer's call or in a gradient's backward pass): the other threads' ops would be
    recorded inside it. A layer region: its trace is dropped, and layers run op by op in
    runs from here on. A gradient region, which a replica's step cannot run otherwise: the
    loop runs eagerly (at the trace's merge, ``GraphLifecycle.merge``). In co-execution a
    skipped region runs no Python, and a region that spanned a turn was never merged. A tape
    open across a turn (``apply_gradients`` inside its ``with``) keeps the loop eager too: a
    fallback's replay re-enters the real tapes on the thread that replays, and the replica
    whose tape it is would record on without it."""
    rec = rt.recorder
    if rt.layers.depth and rt.layers_in_runs:
        rt.layers_in_runs = False
        rt.events.note("layer region off", "a layer call in a replica's step passed the turn "
                       "to another thread (a merge_call): layer regions run op by op in a "
                       "MirroredStrategy.run from here on")
        if rec is not None:
            rec.aborted = True
    if rec is None or rec.unservable is not None:
        return
    if rec.region_site is not None:
        rec.unservable = ("a gradient call in a replica's step passed the turn to another "
                          "thread (a merge_call in its backward pass, at "
                          f"{rec.region_location}): its region would hold their ops")
    elif rt.open_tapes:
        rec.unservable = ("a tape was open while a replica's step passed the turn to another "
                          "thread (a merge_call inside the tape's with block): a replay could "
                          "not enter that tape in its own thread")


def _let_go(threads):
    """Drop what the run's finished replica threads hold of the step's values. A thread and
    its ``Coordinator`` refer to each other, so they live until the garbage collector finds
    them, and with them the step's tensors: whether a stand-in outlived its iteration
    (``terra.escapes``) would depend on when the collector last ran."""
    for t in threads:
        if not t.is_alive():
            for name in _HELD:
                setattr(t, name, None)


def loop_thread_of_current():
    """The thread that started the run of the followed replica thread running this, or this
    thread itself."""
    turns = getattr(threading.current_thread(), "terra_turns", None)
    return _ident() if turns is None else turns[0]
