"""Terra: imperative-symbolic co-execution for TensorFlow 2 training loops.

Swap ``tf.GradientTape`` for :class:`TerraGradientTape`; nothing else in the loop changes.
"""

import tensorflow as tf

from terra.runtime import configure, explain, reset, stats
from terra.tape import TerraGradientTape

tf.TerraGradientTape = TerraGradientTape

__all__ = ["TerraGradientTape", "configure", "explain", "reset", "stats"]
