"""The floor mode: the training step with every TF op answered from a recorded step.

What is left is the Python the user's code imposes (Keras layer bookkeeping, the generated op
wrappers' Python, the loop) at zero kernel time: the speed no system that still runs the
user's Python, as Terra's co-executed skeleton does, can beat. Each Terra ratio is read
against it.

The last warm-up step runs eagerly while every op it executes is recorded in order (op type,
which door it came through, what it returned); every later step answers its k-th op with the
k-th recorded outputs instead of executing it. Ops are heard at the two Python-visible doors
every eager op passes through, as Terra hears them (``terra/interception.py``):
``pywrap_tfe.TFE_Py_FastPathExecute`` (the generated op wrappers) and ``execute.execute``
(their slow-path fallbacks and ``tf.function`` calls). They are patched here rather than
through Terra so that the floor, like the other baselines, runs on a TensorFlow Terra never
touched. Variable reads and assigns are ops like any other: assigns are skipped, so every
replayed step sees the recorded step's values.

Two calls are answered as a whole, with what they returned in the recorded step: a
``tape.gradient`` (:class:`FloorTape`), whose backward ops and TF's Python gradient functions
are TensorFlow's work, and the update of a library's own optimizer (``LIBRARY_UPDATES``: Keras'
``apply`` loops over the variables in Python, a dozen ops each), whose Python looks at no
value. A graph runs both without Python, and so does Terra's co-executed step (a gradient
region; a library region, ``terra/library_regions.py``, whose list of optimizers this is), so
a floor that ran their Python would not be one: Terra beat such a floor 2x on the MLP. A
user's subclass of an optimizer is the user's code: its update is answered op by op. The
replayed forward ops are not recorded on the tape; the C++ op dispatch is left out with the
kernels. Keras layers' own Python (``Layer.__call__``) does run here: Terra's layer regions
(``terra/layer_regions.py``) skip the calls of built-in layers too, so on a model made of
them Terra's step can be faster than this floor (a ``% floor`` over 100).

An op whose type differs from the recorded one at its position (Python control flow that
depends on data or on a counter) makes its step *diverged*: that op and the rest of the step
run for real, and are counted. A step whose ops (or whole calls) run out before the
record's does too.
"""

from __future__ import annotations

import functools
import sys
import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import core, execute

_ORIGINAL_FAST = pywrap_tfe.TFE_Py_FastPathExecute
_REAL = object()  # "run this op for real"
_active = None  # the Floor whose step is running (its doors are in TF's way)

# (module, class, method, family, excluded): the optimizer updates answered whole, for
# instances of classes defined under ``family`` but not under ``excluded`` (Keras' loss scale
# optimizer wraps a user's choice); the Keras entries of ``terra.library_regions.REGIONS``.
LIBRARY_UPDATES = (
    ("keras.src.optimizers.base_optimizer", "BaseOptimizer", "apply", "keras.src.optimizers.",
     ("keras.src.optimizers.loss_scale_optimizer",)),
    ("tf_keras.src.optimizers.optimizer", "Optimizer", "apply_gradients",
     "tf_keras.src.optimizers.", ("tf_keras.src.optimizers.legacy",
                                   "tf_keras.src.mixed_precision")),
)


class FloorUnavailable(RuntimeError):
    """A step that left the recorded op path failed: the program's ops change from step to
    step (an architecture drawn at random), and no recorded step answers another."""


class Floor:
    """``step`` as a step function: eager for the first ``record_at - 1`` calls, recorded at
    call ``record_at`` (the last warm-up step), answered from that record at every later call.
    """

    def __init__(self, step, record_at: int):
        if record_at < 1:
            raise ValueError("the floor records the last warm-up step: warmup must be >= 1")
        self.step = step
        self.record_at = record_at
        self.calls = 0
        # (op_type, door, outputs) of the recorded step, in order; door "fallback" is a fast
        # path call that raised ``_FallbackException`` (its op then came through "slow")
        self.ops = []
        # what each call answered whole (tape.gradient, optimizer update) returned when
        # recorded, in order, as (kind, value)
        self.whole_calls = []
        self.replayed_steps = 0
        self.diverged_steps = 0
        self.real_ops = 0  # ops of replayed steps executed for real (after a divergence)
        self._recording = False
        self._paused = False  # inside a call recorded whole: its ops are not the step's
        self._cursor = self._call_cursor = 0
        self._diverged = False
        self._owner = None
        self._slow = None  # ``execute.execute`` as it was when the step started
        # (class, method, original, wrapper) of each library update of a loaded library
        self._updates = [_wrapped_update(*u) for u in LIBRARY_UPDATES if u[0] in sys.modules]

    def __call__(self, *batch):
        global _active
        self.calls += 1
        if self.calls < self.record_at:
            return self.step(*batch)
        self._recording = self.calls == self.record_at
        self._cursor = self._call_cursor = 0
        self._diverged = False
        self._owner = threading.get_ident()
        self._slow = execute.execute
        _active = self
        pywrap_tfe.TFE_Py_FastPathExecute = _fast_door
        execute.execute = _slow_door
        for cls, method, _, wrapper in self._updates:
            setattr(cls, method, wrapper)
        try:
            out = self.step(*batch)
        except Exception as error:
            if not self._diverged:
                raise
            raise FloorUnavailable(
                f"no floor: step {self.calls} left the recorded op path and failed on the "
                f"recorded values ({type(error).__name__}); its ops differ from step to step"
            ) from error
        finally:
            pywrap_tfe.TFE_Py_FastPathExecute = _ORIGINAL_FAST
            execute.execute = self._slow
            for cls, method, original, _ in self._updates:
                setattr(cls, method, original)
            _active = None
        if not self._recording:
            self.replayed_steps += 1
            if not self._diverged and (self._cursor < len(self.ops)
                                       or self._call_cursor < len(self.whole_calls)):
                self.diverged_steps += 1  # fewer ops or whole calls than recorded
        return out

    def stats(self) -> dict:
        return dict(ops_per_step=len(self.ops), whole_calls_per_step=len(self.whole_calls),
                    replayed_steps=self.replayed_steps, diverged_steps=self.diverged_steps,
                    real_ops=self.real_ops)

    def _passes(self) -> bool:
        return self._paused or threading.get_ident() != self._owner

    def _fast(self, ctx, op_type, name, args):
        if self._passes():
            return _ORIGINAL_FAST(ctx, op_type, name, *args)
        if self._recording:
            try:
                out = _ORIGINAL_FAST(ctx, op_type, name, *args)
            except core._FallbackException:  # the wrapper goes on to its slow path
                self.ops.append((op_type, "fallback", None))
                raise
            self.ops.append((op_type, "fast", out))
            return out
        out = self._answer(op_type, "fast")
        return _ORIGINAL_FAST(ctx, op_type, name, *args) if out is _REAL else out

    def _slow_execute(self, op_type, num_outputs, inputs, attrs, ctx, name):
        if self._passes():
            return self._slow(op_type, num_outputs, inputs, attrs, ctx, name)
        if self._recording:
            out = self._slow(op_type, num_outputs, inputs, attrs, ctx, name)
            self.ops.append((op_type, "slow", out))
            return out
        out = self._answer(op_type, "slow")
        if out is _REAL:
            return self._slow(op_type, num_outputs, inputs, attrs, ctx, name)
        return out

    def _answer(self, op_type, door):
        """The recorded outputs of the step's next op, or ``_REAL`` once the step diverged."""
        if not self._diverged:
            k = self._cursor
            if k < len(self.ops) and self.ops[k][0] == op_type:
                recorded_door = self.ops[k][1]
                if recorded_door == door:
                    self._cursor = k + 1
                    return self.ops[k][2]
                if recorded_door == "fallback" and door == "fast":  # as the recorded step did
                    self._cursor = k + 1
                    raise core._FallbackException(op_type)
            self._diverged = True
            self.diverged_steps += 1
        self.real_ops += 1
        return _REAL

    def _whole(self, kind, call):
        """``call()``'s result, recorded (its ops are not the step's) or answered from the
        record, also in a diverged step: run for real there, a gradient would miss the
        answered forward ops on its tape. A call the record lacks diverges the step and runs
        for real."""
        if self._recording:
            self._paused = True
            try:
                out = call()
            finally:
                self._paused = False
            self.whole_calls.append((kind, out))
            return out
        k = self._call_cursor
        if k < len(self.whole_calls) and self.whole_calls[k][0] == kind:
            self._call_cursor = k + 1
            return self.whole_calls[k][1]
        if not self._diverged:
            self._diverged = True
            self.diverged_steps += 1
        return call()


def _wrapped_update(module, cls_name, method, family, excluded):
    """(class, method name, original, wrapper) of one library optimizer update."""
    cls = getattr(sys.modules[module], cls_name)
    original = getattr(cls, method)

    @functools.wraps(original)
    def update(opt, *args, **kwargs):
        where = type(opt).__module__
        if (_active is None or _active._passes() or not where.startswith(family)
                or where.startswith(excluded)):
            return original(opt, *args, **kwargs)
        return _active._whole("update", lambda: original(opt, *args, **kwargs))

    return cls, method, original, update


def _fast_door(ctx, op_type, name, *args):
    return _active._fast(ctx, op_type, name, args)


def _slow_door(op_type, num_outputs, inputs, attrs, ctx, name=None):
    return _active._slow_execute(op_type, num_outputs, inputs, attrs, ctx, name)


class FloorTape(tf.GradientTape):
    """The tape the floor's programs are built with: ``gradient`` is recorded with the step,
    and answered from the record in replayed steps (outside a floor step it is TF's)."""

    def gradient(self, *args, **kwargs):
        if _active is None or _active._passes():
            return super().gradient(*args, **kwargs)
        return _active._whole("gradient", lambda: super(FloorTape, self).gradient(*args,
                                                                                   **kwargs))
