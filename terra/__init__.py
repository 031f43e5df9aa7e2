"""Terra: imperative-symbolic co-execution for TensorFlow 2 training loops.

Swap ``tf.GradientTape`` for :class:`TerraGradientTape`, or call :func:`enable` to put Terra
behind ``tf.GradientTape`` for code you cannot edit; nothing else in the loop changes.
"""

import tensorflow as tf

from terra.config import configure
from terra.report import explain
from terra.runtime import reset, stats
from terra.tape import TerraGradientTape, disable, enable, enabled
from terra.verify import DivergenceError, DivergenceWarning

tf.TerraGradientTape = TerraGradientTape

__all__ = ["DivergenceError", "DivergenceWarning", "TerraGradientTape", "configure", "disable",
           "enable", "enabled", "explain", "reset", "stats"]
