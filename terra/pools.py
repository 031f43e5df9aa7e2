"""The two runners on few cores: TensorFlow's thread pools told not to spin.

A thread of TF's pools that runs out of work spins a while before it sleeps, so that work
arriving soon starts without a wake-up. In co-execution the graph runs out of work every
time it waits for the next feed from Python, and its pool threads then spin on the cores
the Python runner needs: on two cores, measured on GPT-2, the process spent 23-28 ms of CPU
a step with spinning and 19-21 ms without, and the step took 15.4-19.8 ms against 14.1-15.5.
A ``tf.function`` step, which never waits for Python, ran as fast either way.

TF reads the switch (``ConfigProto.experimental.disable_thread_spinning``) once, when the
eager context initializes (the first op, or the first device query), and has no public API
for it: Terra puts it into the context's ConfigProto when it is imported before that, on a
machine of at most ``_FEW_CORES`` cores (``TERRA_QUIET_POOLS`` decides instead, if set).
Imported later, the pools spin, and ``explain()`` says how to change that.
"""

import os

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context

from terra.config import _env_flag

_FEW_CORES = 4

# Why the pools spin though Terra would have them quiet (for explain), decided at import.
_state = {"why": None}


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _wanted() -> bool:
    return _env_flag("TERRA_QUIET_POOLS", default=_cores() <= _FEW_CORES)


def quiet() -> None:
    """Turn thread spinning off in the eager context's config, if wanted and still possible."""
    if not _wanted():
        return
    ctx = context.context()
    if ctx._initialized:  # TF has no public accessor
        _state["why"] = (
            "TensorFlow had run ops before Terra was imported, so its thread pools spin when "
            "they run out of work and take CPU from the loop's thread while the graph waits "
            "for feeds: import terra before the first TensorFlow op")
        return
    proto = config_pb2.ConfigProto()
    if ctx._config is not None:  # a config given to enable_eager_execution
        proto.CopyFrom(ctx._config)
    proto.experimental.disable_thread_spinning = True
    ctx._config = proto


def status() -> str | None:
    """A line for ``explain()`` when the pools spin though Terra wanted them quiet."""
    return _state["why"]


def is_quiet() -> bool:
    """Whether the eager context's config has spinning off."""
    ctx = context.context_safe()
    return ctx is not None and ctx._config is not None and \
        ctx._config.experimental.disable_thread_spinning
