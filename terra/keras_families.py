"""The two Kerases a layer region wraps: Keras 3 and tf_keras (legacy Keras 2).

Both call a layer through ``Layer.__call__``, which ``terra.layer_regions`` wraps; what a
guard must read around the call differs between them, and is kept here, one
:class:`Family` per Keras:

- what Keras passes down to a call besides its arguments (the ``training`` of an outer call,
  Keras 3's autocast scope, tf_keras' global learning phase), which the call mark carries;
- where a call's losses go (Keras 3: ``_losses``; tf_keras: the thread-local eager losses);
- the attributes Keras' trainer sets on a model, which a model's ``call`` does not read;
- the layer classes whose Python is the user's or reads data (``Lambda``, preprocessing).

Which layer classes are a library's at all is decided by where they are installed
(``terra.boundary``), not by these names.
"""

import functools
import importlib
import inspect
import re
import sys

from terra import boundary


class Family:
    """One Keras: its ``Layer`` module, trainer modules and never-a-region modules."""

    def __init__(self, name, layer_module, trainer_modules, excluded):
        self.name = name
        self.layer_module = layer_module
        self.trainer_modules = trainer_modules
        self.excluded = excluded

    def layer_class(self):
        """Its ``Layer`` class, if that Keras is imported already (importing one costs
        seconds and is the program's choice)."""
        module = sys.modules.get(self.layer_module)
        return None if module is None else module.Layer

    def scope(self, layer):
        """What Keras passes down to ``layer``'s call besides its arguments, hashable; None
        where its calls are no regions now."""
        raise NotImplementedError

    def losses(self, layer):
        """The losses ``layer``'s calls added (an activity regularizer, ``add_loss``)."""
        raise NotImplementedError

    @functools.cached_property
    def trainer_state(self):
        """The attributes Keras' trainer sets on a model (``self.<name> = ...`` in its
        modules): ``stop_training``, ``history``, the compiled step functions, the
        iterators; ``fit`` changes them every epoch, and a model's ``call`` reads none."""
        names = set()
        for module in self.trainer_modules:
            source = inspect.getsource(importlib.import_module(module))
            names.update(re.findall(r"\bself\.(\w+)\s*=(?!=)", source))
        return frozenset(names)

    def excludes(self, cls) -> bool:
        """Whether ``cls``'s calls are never regions: its Python is the user's (a ``Lambda``
        wraps a function of theirs) or reads data (preprocessing), or it is not a library's
        class at all (the user's own subclass)."""
        if cls.__module__.startswith(self.excluded):
            return True
        try:
            return not boundary.is_library(inspect.getsourcefile(cls) or "")
        except TypeError:  # a class defined in C, or without a source file
            return True


class Keras3(Family):
    def scope(self, layer):
        from keras.src import backend
        from keras.src.backend.common import global_state

        if backend.in_stateless_scope():
            return None  # (its variables are not the layer's)
        ctx = global_state.get_global_attribute("current_call_ctx")
        passed = () if ctx is None else tuple(
            (name, ctx.get_value(name)) for name in sorted(layer._call_context_args))
        autocast = backend.get_autocast_scope()
        return passed, None if autocast is None else str(autocast.dtype)

    def losses(self, layer):
        return layer._losses


class TFKeras(Family):
    def scope(self, layer):
        from tf_keras.src import backend
        from tf_keras.src.engine import base_layer_utils

        ctx = base_layer_utils.call_context()
        passed = tuple((name, ctx.get_call_context_arg(name))
                       for name in sorted(layer._call_context_args))
        phase = backend.learning_phase() if backend.global_learning_phase_is_set() else None
        return passed, ctx.in_call, phase if phase is None or type(phase) in (int, bool) \
            else id(phase)

    def losses(self, layer):
        return layer._eager_losses or layer._losses


FAMILIES = (
    Keras3("Keras 3", "keras.src.layers.layer",
           ("keras.src.trainers.trainer", "keras.src.backend.tensorflow.trainer"),
           ("keras.src.layers.core.lambda_layer", "keras.src.layers.preprocessing",
            "keras.src.export", "keras.src.utils.jax_layer", "keras.src.utils.torch_utils")),
    TFKeras("tf_keras", "tf_keras.src.engine.base_layer", ("tf_keras.src.engine.training",),
            ("tf_keras.src.layers.core.lambda_layer", "tf_keras.src.layers.core.tf_op_layer",
             "tf_keras.src.layers.preprocessing", "tf_keras.src.feature_column",
             "tf_keras.src.saving")),
)
