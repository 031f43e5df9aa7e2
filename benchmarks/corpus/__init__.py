"""The real-program corpus: training code and models of libraries nobody on this project wrote.

Each program drives a real library's model or training API (Sonnet, TensorFlow Probability,
GPflow, tf_keras, Keras 3, TF-Agents) on synthetic data of the shapes the library is used with.
The driver (``python -m benchmarks.corpus``) runs every program twice, each run in a fresh
process: once eagerly and once with ``terra.enable()`` (so the library's own
``tf.GradientTape`` becomes Terra's), and compares per-step losses and every variable.

A program module may only make data, build the library's model, and run its training step; no
library code is copied here. This module does not import TensorFlow or the libraries: the
driver process stays free of both, and a missing library only skips its programs.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple


class Entry(NamedTuple):
    library: str  # for the table
    requires: tuple[str, ...]  # importable modules the program needs (skipped if one is missing)
    quick: bool = False  # part of ``--quick`` (CI): small and quick to run
    env: tuple[tuple[str, str], ...] = ()  # set before TensorFlow is imported in the child
    deterministic: bool = False  # run both modes with TF's op determinism (see worker)


SONNET = ("sonnet", "tree")
TFP = ("tensorflow_probability", "tf_keras")
GPFLOW = ("gpflow", *TFP)
LEGACY_KERAS = (("TF_USE_LEGACY_KERAS", "1"),)

# name -> entry; the program is the module ``benchmarks.corpus.programs.<name>``
REGISTRY = {
    "sonnet_mlp": Entry("dm-sonnet", SONNET, quick=True),
    "sonnet_convnet_bn": Entry("dm-sonnet", SONNET),
    "sonnet_lstm": Entry("dm-sonnet", SONNET, quick=True),
    "tfp_bnn_elbo": Entry("tensorflow-probability", TFP, quick=True),
    "tfp_maf_flow": Entry("tensorflow-probability", TFP),
    "gpflow_gpr": Entry("gpflow", GPFLOW, env=LEGACY_KERAS),
    "gpflow_gpr_compiled": Entry("gpflow", GPFLOW, env=LEGACY_KERAS),
    "gpflow_svgp": Entry("gpflow", GPFLOW, env=LEGACY_KERAS),
    "tfkeras_mobilenet": Entry("tf_keras", ("tf_keras",), env=LEGACY_KERAS),
    "keras3_mobilenetv3": Entry("keras 3", ("keras",)),
    "keras3_fit": Entry("keras 3", ("keras",)),
    "tfagents_dqn": Entry("tf-agents", ("tf_agents", "gin", "gym", *TFP), env=LEGACY_KERAS),
    # the training code of public tutorials, written here in their style (docs/corpus.md)
    "vae": Entry("keras 3", ("keras",)),
    "pix2pix": Entry("keras 3", ("keras",)),
    "wgan_gp": Entry("keras 3", ("keras",)),
    "tfkeras_gru_lm": Entry("tf_keras", ("tf_keras",), env=LEGACY_KERAS),
}


def missing(name: str) -> list[str]:
    """The modules ``name`` needs that are not installed."""
    return [m for m in REGISTRY[name].requires if importlib.util.find_spec(m) is None]
