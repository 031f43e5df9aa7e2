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

``tape.gradient`` is answered as a whole (:class:`FloorTape`): its backward ops and TF's
Python gradient functions are TensorFlow's work, not the user's code, and a graph runs them
without Python (so does Terra's co-executed step). The replayed forward ops are not recorded
on the tape either; the C++ op dispatch is left out with the kernels.

An op whose type differs from the recorded one at its position (Python control flow that
depends on data or on a counter) makes its step *diverged*: that op and the rest of the step
run for real, and are counted. A step whose ops run out before the record's does too.
"""

from __future__ import annotations

import threading

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import core, execute

_ORIGINAL_FAST = pywrap_tfe.TFE_Py_FastPathExecute
_REAL = object()  # "run this op for real"
_active = None  # the Floor whose step is running (its doors are in TF's way)


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
        self.gradients = []  # what each tape.gradient call of the recorded step returned
        self.replayed_steps = 0
        self.diverged_steps = 0
        self.real_ops = 0  # ops of replayed steps executed for real (after a divergence)
        self._recording = False
        self._paused = False  # inside a recorded tape.gradient: its ops are not the step's
        self._cursor = self._gradient_cursor = 0
        self._diverged = False
        self._owner = None
        self._slow = None  # ``execute.execute`` as it was when the step started

    def __call__(self, *batch):
        global _active
        self.calls += 1
        if self.calls < self.record_at:
            return self.step(*batch)
        self._recording = self.calls == self.record_at
        self._cursor = self._gradient_cursor = 0
        self._diverged = False
        self._owner = threading.get_ident()
        self._slow = execute.execute
        _active = self
        pywrap_tfe.TFE_Py_FastPathExecute = _fast_door
        execute.execute = _slow_door
        try:
            out = self.step(*batch)
        finally:
            pywrap_tfe.TFE_Py_FastPathExecute = _ORIGINAL_FAST
            execute.execute = self._slow
            _active = None
        if not self._recording:
            self.replayed_steps += 1
            if not self._diverged and self._cursor < len(self.ops):
                self.diverged_steps += 1  # fewer ops than recorded
        return out

    def stats(self) -> dict:
        return dict(ops_per_step=len(self.ops), gradients_per_step=len(self.gradients),
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

    def _gradient(self, tape, args, kwargs):
        if self._recording:
            self._paused = True
            try:
                grads = tf.GradientTape.gradient(tape, *args, **kwargs)
            finally:
                self._paused = False
            self.gradients.append(grads)
            return grads
        k = self._gradient_cursor
        if k < len(self.gradients):
            self._gradient_cursor = k + 1
            return self.gradients[k]
        if not self._diverged:
            self._diverged = True
            self.diverged_steps += 1
        return tf.GradientTape.gradient(tape, *args, **kwargs)


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
        return _active._gradient(self, args, kwargs)
