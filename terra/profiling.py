"""Terra's phases as TensorBoard profiler annotations, and what they cost when nobody profiles.

With ``tf.profiler.experimental.start(logdir)`` ... ``stop()`` (or the Keras TensorBoard
callback's ``profile_batch``) running, the trace viewer shows, on the training loop's thread,
where Terra spent the iteration (``terra_trace``: an iteration being recorded,
``terra_merge``, ``terra_generate``, ``terra_coexecute``: a co-executed iteration,
``terra_fetch_wait`` and ``terra_job_wait``: Python waiting for a value of the graph or for
its iteration to finish, ``terra_fallback``, ``terra_replay``), and on the GraphRunner's thread
each graph call as ``terra_graph_step`` with ``step_num`` the iteration number (a root event,
``_r=1``, so the profiler's step view counts the graph's iterations). Without these, a
co-executed loop's timeline is one long function call on an unnamed thread and a loop thread
that seems to idle.

The annotations are TF's own TraceMe (``_pywrap_traceme``, what
``tf.profiler.experimental.Trace`` wraps). With no profiler running, ``Trace`` costs an object,
a call into C++ that asks whether tracing is on, and two method calls: ~0.2 us. That is
nothing per iteration, but the fetch wait is on the PythonRunner's hot path, so the callers
there ask :func:`enabled` (one C++ call, ~15 ns) themselves and build nothing when it says no.
A span is stopped on the thread that started it, as TraceMe requires; one started while no
profiler ran is never recorded, even if a profiler starts before it ends.
"""

import contextlib
import functools

from tensorflow.python.profiler.internal import _pywrap_traceme

enabled = _pywrap_traceme.traceme_enabled  # whether a profiler records now (C++, cheap)
TraceMe = _pywrap_traceme.TraceMe  # TraceMe(name, **metadata) starts the clock; .Stop()

_OFF = contextlib.nullcontext()  # reused: entering it allocates nothing


class _Span:
    """A TraceMe as a context manager (``tf.profiler.experimental.Trace`` without its own
    check, made only once :func:`enabled` said yes)."""

    __slots__ = ("_me",)

    def __init__(self, name, metadata):
        self._me = TraceMe(name, **metadata)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._me.Stop()


def trace(name, **metadata):
    """A context manager that annotates its block as ``name`` while a profiler records; a
    shared no-op otherwise."""
    return _Span(name, metadata) if enabled() else _OFF


def traced(name):
    """Decorator: every call of the function is annotated as ``name`` (for phases that are
    one call: merge, generate, fallback)."""
    def wrap(fn):
        @functools.wraps(fn)
        def annotated(*args, **kwargs):
            if not enabled():
                return fn(*args, **kwargs)
            with _Span(name, {}):
                return fn(*args, **kwargs)
        return annotated
    return wrap


class Phase:
    """The span of the phase the loop's iteration is in (``terra_trace``,
    ``terra_coexecute``), which starts and ends in different calls of the runtime: at most one
    is open; starting one ends the one before."""

    __slots__ = ("_me",)

    def __init__(self):
        self._me = None

    def begin(self, name, **metadata):
        self.end()
        if enabled():
            self._me = TraceMe(name, **metadata)

    def end(self):
        me, self._me = self._me, None
        if me is not None:
            me.Stop()
