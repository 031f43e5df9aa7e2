"""``TerraGradientTape``: the one line a user changes, and :func:`enable` for code they cannot.

A ``TerraGradientTape`` *is* a ``tf.GradientTape`` (a subclass, so ``isinstance`` checks in
Keras and other libraries hold), but its recording is done by a private real tape that Terra
drives: during tracing it is entered and its events recorded; during co-execution it is not
entered at all (no op reaches TF) and ``gradient`` returns stand-ins for the recorded backward
pass; after a fallback it is re-entered and the replayed ops are recorded on it.

Terra keeps its own reference to TensorFlow's class (``RealGradientTape``), so putting Terra
behind ``tf.GradientTape`` (:func:`enable`) never makes Terra construct itself.

A tape steps aside and acts as a plain ``tf.GradientTape`` where co-execution cannot serve it:
inside a ``tf.function`` being traced, in a thread other than the one Terra serves (the
training loop's, or a ``MirroredStrategy`` replica's in its turn: ``terra.replicas``), and
under a ``tf.distribute`` strategy whose replica threads Terra does not follow
(``terra.distribute``).
"""

import contextlib
import sys
import threading

from tensorflow.python.eager import backprop, context
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest

from terra import distribute, events, marks, runtime
from terra.config import config

RealGradientTape = backprop.GradientTape


def _why_plain():
    """Why a tape entered now must act as a plain GradientTape, or None."""
    if not context.executing_eagerly():
        return "a tape inside a tf.function being traced"
    why = distribute.why_plain()
    if why is not None:
        return why
    owner = runtime.owner_thread()
    if owner is not None and owner != threading.get_ident():
        return "a tape in another thread than the training loop's"
    return None


class TerraGradientTape(RealGradientTape):
    """Drop-in replacement for ``tf.GradientTape``: same constructor and API. With
    ``TERRA_DISABLE=1`` the constructor returns a plain GradientTape."""

    def __new__(cls, persistent=False, watch_accessed_variables=True):
        if config.disable:
            return RealGradientTape(persistent, watch_accessed_variables)
        return super().__new__(cls)

    def __init__(self, persistent=False, watch_accessed_variables=True):
        # The base state stays unused (every method below is Terra's); it is initialised so
        # that code poking at GradientTape internals finds a consistent, empty tape.
        super().__init__(persistent, watch_accessed_variables)
        self.mark_attrs = (bool(persistent), bool(watch_accessed_variables))
        # TF's tape object, kept across ``with`` blocks as TF keeps its own: a tape entered
        # again records on, until a gradient consumes it (non-persistent) or ``reset``. None
        # while Terra serves the tape (co-execution) and before the first real enter.
        self.real = None
        self.plain = False  # acting as a plain tape for the current ``with``
        self.recording = False  # as TF's ``_recording``: inside ``with``, not stopped or used
        # entered and not yet consumed: entering it again continues its iteration's
        # recording rather than starting the next iteration (``marks.TapeMarks.enter``)
        self.live = False
        self.entered = False  # entered at least once: its queries are Terra's to answer

    def __enter__(self):
        if self.recording:  # TF's own error, before any state changes
            raise ValueError("Tape is still recording, This can happen if you try to "
                             "re-enter an already-active tape.")
        why = _why_plain()
        self.plain = why is not None
        if self.plain:
            events.note_plain_tape(why)
            self.enter_real()
        else:
            runtime.get().marks.enter(self)
        self.recording = self.live = self.entered = True
        return self

    def __exit__(self, typ, value, tb):
        self.recording = False
        if self.plain:
            self.exit_real()
        else:
            runtime.get().marks.exit(self, typ is not None)
        return False

    def watch(self, tensor):
        # TF's validation and its errors (a NumPy array, a Python number), in every phase
        flat = list(backprop._extract_tensors_and_variables(tensor))
        if self.plain or not self.live:
            return self._real_or_unentered().watch(flat)
        runtime.get().marks.watch(self, flat)

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        if self.plain or not self.live:
            with self._synced() as real:
                return real.gradient(target, sources, output_gradients, unconnected_gradients)
        if target is None:  # TF's argument errors, which leave the tape unused
            if not self.persistent:
                self.recording = False
            raise TypeError("Argument `target` should be a list or nested structure of "
                            "Tensors, Variables or CompositeTensors to be differentiated, "
                            "but received None.")
        try:
            UnconnectedGradients(unconnected_gradients)
        except ValueError:
            raise ValueError(
                f"Unknown value for unconnected_gradients: {unconnected_gradients!r}") from None
        if not self.persistent:
            self.recording = self.live = False
        return runtime.get().marks.gradient(self, target, sources, output_gradients,
                                            unconnected_gradients)

    def watched_variables(self):
        """A read-only query: served in every phase without leaving co-execution or spoiling
        a trace (tf_keras' ``Lambda`` layers ask it at every call)."""
        if self.plain or not self.entered:
            return self._real_or_unentered().watched_variables()
        return runtime.get().marks.watched_variables(self)

    # -- the rest of the GradientTape API: on the real tape, leaving co-execution first -----
    def _real_or_unentered(self):
        """The real tape, or for a tape never entered an unentered real one: TF's own answers
        and errors (``watch`` before ``with``: TF's AttributeError)."""
        return self.real if self.real is not None else RealGradientTape(
            self.persistent, self.watch_accessed_variables)

    @contextlib.contextmanager
    def _on_real(self, what):
        """The real tape, for a method the graph cannot serve: in co-execution the iteration
        falls back first (the replay re-enters the real tape), and the trace of an iteration
        that used it is not merged (its ops are not one gradient region). Terra's view of the
        tape follows the real one's after the call (a jacobian uses a non-persistent tape)."""
        if self.live and not self.plain:
            runtime.get().marks.step_aside(self, what)
        with self._synced() as real:
            yield real

    @contextlib.contextmanager
    def _synced(self):
        """The real tape (:meth:`_real_or_unentered`) for a call on it; after the call Terra's
        view of the tape follows the real one's (a gradient or jacobian consumed it)."""
        real = self._real_or_unentered()
        try:
            yield real
        finally:
            if real is self.real:
                self.recording, self.live = real._recording, real._tape is not None

    def jacobian(self, target, sources, unconnected_gradients=UnconnectedGradients.NONE,
                 parallel_iterations=None, experimental_use_pfor=True):
        with self._on_real("jacobian") as real:
            return real.jacobian(target, sources, unconnected_gradients, parallel_iterations,
                                 experimental_use_pfor)

    def batch_jacobian(self, target, source, unconnected_gradients=UnconnectedGradients.NONE,
                       parallel_iterations=None, experimental_use_pfor=True):
        with self._on_real("batch_jacobian") as real:
            return real.batch_jacobian(target, source, unconnected_gradients,
                                       parallel_iterations, experimental_use_pfor)

    @contextlib.contextmanager
    def stop_recording(self):
        with self._on_real("stop_recording") as real, real.stop_recording():
            self.recording = False
            yield

    def reset(self):
        with self._on_real("reset") as real:
            real.reset()

    # -- used by the tape marks and the fallback's replay ---------------------------------
    def enter_real(self):
        """Enter the real tape; entered again, it records on (TF's tape object is kept)."""
        if self.real is None:
            self.real = RealGradientTape(self.persistent, self.watch_accessed_variables)
        self.real.__enter__()

    def exit_real(self):
        if self.real is not None and self.real._recording:
            self.real.__exit__(None, None, None)

    @property
    def persistent(self):
        return self._persistent

    @property
    def watch_accessed_variables(self):
        return self._watch_accessed_variables

    def traced_gradient(self, target, sources, output_gradients, unconnected, attrs=None):
        """Run the real backward pass as one recorded gradient region."""
        rt = runtime.get()
        recorder = rt.recorder
        flat_sources = nest.flatten(sources)
        if attrs is None:
            attrs = (self.mark_attrs, len(nest.flatten(target)), len(flat_sources),
                     output_gradients is None, str(unconnected))
        tensors = marks.grad_tensors(target, sources, output_gradients)
        # what the tape watched as variables were read (not ``tape.watch``'s: a watch mark)
        watched = tuple(marks.handle_or_self(v) for v in self.real.watched_variables()
                        if v.trainable) if self.watch_accessed_variables else ()
        index = recorder.begin_grad(attrs, tensors, watched)
        result = self.real.gradient(target, sources, output_gradients, unconnected)
        recorder.end_grad(index, nest.flatten(result))
        return result


# -- global enablement ------------------------------------------------------------------
_patched = []  # (module, previous value) while enabled
_lock = threading.Lock()


def enable():
    """Put Terra behind ``tf.GradientTape`` for code you cannot edit (Keras' ``train_step``,
    tf_keras, third-party trainers, ``optimizer.minimize``).

    Every public module attribute ``GradientTape`` that is TensorFlow's class (``tf``,
    ``tf.compat.v2``, ``tf.autodiff``, and user modules that imported the name) becomes
    :class:`TerraGradientTape`. TensorFlow's own internals keep the real class. Idempotent;
    undone by :func:`disable`."""
    with _lock:
        if _patched:
            return
        for name, module in list(sys.modules.items()):
            if module is None or name.startswith(("tensorflow.python.", "terra")):
                continue
            try:
                found = vars(module).get("GradientTape")
            except TypeError:
                continue
            if found is RealGradientTape:
                module.GradientTape = TerraGradientTape
                _patched.append((module, found))


def disable():
    """Give ``tf.GradientTape`` back to TensorFlow (tapes already created keep working)."""
    with _lock:
        while _patched:
            module, previous = _patched.pop()
            module.GradientTape = previous


def is_enabled() -> bool:
    return bool(_patched)


@contextlib.contextmanager
def enabled():
    """``with terra.enabled():`` Terra behind ``tf.GradientTape`` inside the block only."""
    was = is_enabled()
    enable()
    try:
        yield
    finally:
        if not was:
            disable()
