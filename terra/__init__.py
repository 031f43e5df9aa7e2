"""Terra: imperative-symbolic co-execution for TensorFlow 2 training loops.

Swap ``tf.GradientTape`` for :class:`TerraGradientTape`, or call :func:`enable` to put Terra
behind ``tf.GradientTape`` for code you cannot edit; nothing else in the loop changes.
"""

import tensorflow as tf

from terra import pools

pools.quiet()  # before anything of Terra's runs an op: TF reads it when its context starts

from terra import replicas  # noqa: E402
from terra.config import configure  # noqa: E402
from terra.report import explain  # noqa: E402
from terra.runtime import current as _current_runtime  # noqa: E402
from terra.runtime import reset, stats  # noqa: E402
from terra.tape import TerraGradientTape, disable, enable, enabled  # noqa: E402
from terra.verify import DivergenceError, DivergenceWarning  # noqa: E402

tf.TerraGradientTape = TerraGradientTape
# a MirroredStrategy.run called before the first tape already starts threads Terra follows
replicas.install(_current_runtime)

__all__ = ["DivergenceError", "DivergenceWarning", "TerraGradientTape", "configure", "disable",
           "enable", "enabled", "explain", "reset", "stats"]
