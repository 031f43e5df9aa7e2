"""``TerraGradientTape``: the one line a user changes.

During tracing it drives a real ``tf.GradientTape`` and records its events; during
co-execution the real tape is not entered at all (no op reaches TF), and ``gradient`` returns
stand-ins for the recorded backward pass. After a fallback the real tape is re-entered and
the replayed ops are recorded on it.
"""

import tensorflow as tf
from tensorflow.python.ops.unconnected_gradients import UnconnectedGradients
from tensorflow.python.util import nest

from terra import runtime
from terra.config import config


class TerraGradientTape:
    """Drop-in replacement for ``tf.GradientTape`` (same constructor, ``watch``,
    ``gradient``). With ``TERRA_DISABLE=1`` the constructor returns a plain GradientTape."""

    def __new__(cls, persistent=False, watch_accessed_variables=True):
        if config.disable:
            return tf.GradientTape(persistent, watch_accessed_variables)
        return super().__new__(cls)

    def __init__(self, persistent=False, watch_accessed_variables=True):
        self.persistent = persistent
        self.watch_accessed_variables = watch_accessed_variables
        self.mark_attrs = (bool(persistent), bool(watch_accessed_variables))
        self.real = None

    def __enter__(self):
        runtime.get().tape_enter(self)
        return self

    def __exit__(self, typ, value, tb):
        runtime.get().tape_exit(self, typ is not None)
        return False

    def watch(self, tensor):
        runtime.get().tape_watch(self, nest.flatten(tensor))

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=UnconnectedGradients.NONE):
        return runtime.get().tape_gradient(self, target, sources, output_gradients,
                                           unconnected_gradients)

    # -- used by the runtime ----------------------------------------------------------------
    def enter_real(self):
        self.real = tf.GradientTape(self.persistent, self.watch_accessed_variables)
        self.real.__enter__()

    def exit_real(self):
        if self.real is not None and self.real._recording:
            self.real.__exit__(None, None, None)

    def traced_gradient(self, target, sources, output_gradients, unconnected, attrs=None):
        """Run the real backward pass as one recorded gradient region."""
        rt = runtime.get()
        recorder = rt.recorder
        flat_sources = nest.flatten(sources)
        if attrs is None:
            attrs = (self.mark_attrs, len(nest.flatten(target)), len(flat_sources),
                     output_gradients is None, str(unconnected))
        tensors = runtime.grad_tensors(target, sources, output_gradients)
        index = recorder.begin_grad(attrs, tensors)
        result = self.real.gradient(target, sources, output_gradients, unconnected)
        recorder.end_grad(index, nest.flatten(result))
        return result

    def __getattr__(self, name):
        # Less common GradientTape methods (jacobian, stop_recording, ...) act on the real
        # tape; in co-execution there is none, so they are not available there yet.
        real = self.__dict__.get("real")
        if real is None:
            raise AttributeError(f"TerraGradientTape.{name} is only available while tracing")
        return getattr(real, name)
