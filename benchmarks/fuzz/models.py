"""The base of a program: model, data, loss and optimizer, drawn once per program.

Every model maps a batch to a hidden activation ``h`` of shape (batch, H) with ``encode`` and
``h`` to logits (batch, C) with ``head``; the feature snippets only ever transform ``h``, the
loss and the update, so any set of features composes with any model. Models are tiny (a step
takes a few milliseconds eagerly): the fuzzer looks for wrong paths, not for big numbers.
"""

import dataclasses
import random

BACKENDS = ("raw", "keras3", "tfkeras")
INPUTS = ("dense", "tokens", "rnn")
LOSSES = ("mse", "xent", "keras_xent")
OPTIMIZERS = ("sgd", "momentum", "adam", "manual")
LOGGING = ("float", "tensor", "numpy")


@dataclasses.dataclass(frozen=True)
class Base:
    """The choices every program makes once; features are drawn against these."""

    backend: str
    inputs: str
    cell: str  # "simple" | "gru": the RNN cell when inputs == "rnn"
    norm: bool  # BatchNormalization after the encoder (Keras backends)
    dropout: bool  # Dropout (Keras) or tf.nn.dropout (raw) after the encoder
    loss: str
    optimizer: str
    logging: str  # how the per-step loss is kept: float(), the tensor itself, .numpy()
    enable: bool  # terra.enable() and a literal tf.GradientTape instead of the tape argument

    @property
    def legacy(self) -> bool:
        return self.backend == "tfkeras"

    @property
    def keras(self) -> bool:
        return self.backend != "raw"


def draw(rng: random.Random) -> Base:
    backend = rng.choice(BACKENDS)
    return Base(
        backend=backend,
        inputs=rng.choice(INPUTS),
        cell=rng.choice(("simple", "gru")),
        norm=backend != "raw" and rng.random() < 0.3,
        dropout=rng.random() < 0.25,
        loss=rng.choice(LOSSES),
        optimizer=rng.choice(OPTIMIZERS),
        logging=rng.choice(LOGGING),
        enable=rng.random() < 0.25,
    )


def imports(base: Base) -> list[str]:
    head = ['import os', '', 'os.environ["TF_USE_LEGACY_KERAS"] = "1"', ''] if base.legacy else []
    keras = ["K = tf.keras"] if base.legacy else ["import keras as K"]
    return head + ["import io", "import random", "import types", "", "import numpy as np",
                   "import tensorflow as tf", *keras]


def model_class(base: Base) -> str:
    return (_raw if base.backend == "raw" else _keras)(base)


def _raw(base: Base) -> str:
    inputs = {
        "dense": ("        self.w = weight((D, H))",
                  "        return tf.tanh(x @ self.w + self.b)"),
        "tokens": ("        self.w = weight((V, H))",
                   "        return tf.reduce_mean(tf.gather(self.w, x), axis=1) + self.b"),
        "rnn": ("        self.w = weight((D, H))\n        self.u = weight((H, H))",
                "        h = tf.zeros((x.shape[0], H))\n"
                "        for t in range(x.shape[1]):\n"
                "            h = tf.tanh(x[:, t] @ self.w + h @ self.u + self.b)\n"
                "        return h"),
    }[base.inputs]
    drop = ("        h = self.encode_core(x)\n"
            "        return tf.nn.dropout(h, 0.2) if training else h\n\n"
            "    def encode_core(self, x):\n") if base.dropout else ""
    return (
        "def weight(shape):\n"
        "    return tf.Variable(np.random.default_rng(len(shape) + sum(shape))\n"
        "                       .normal(0.0, 0.4, shape).astype(np.float32))\n\n\n"
        "class Model(tf.Module):\n"
        '    """Raw variables in a tf.Module."""\n\n'
        "    def __init__(self):\n"
        "        super().__init__()\n"
        f"{inputs[0]}\n"
        "        self.b = tf.Variable(tf.zeros([H]))\n"
        "        self.out = weight((H, C))\n\n"
        "    def encode(self, x, training):\n"
        f"{drop}{inputs[1]}\n\n"
        "    def head(self, h):\n"
        "        return h @ self.out\n"
    )


def _keras(base: Base) -> str:
    cell = "K.layers.GRUCell(H)" if base.cell == "gru" else "K.layers.SimpleRNNCell(H)"
    first, shape, call = {
        "dense": ('K.layers.Dense(H, activation="tanh")', "(None, D)",
                  "        h = self.first(x)"),
        "tokens": ("K.layers.Embedding(V, H)", "(None, 4)",
                   "        h = tf.reduce_mean(self.first(x), axis=1)"),
        "rnn": (cell, "(None, D)",
                "        h = [tf.zeros((x.shape[0], H))]\n"
                "        for t in range(x.shape[1]):\n"
                "            out, h = self.first(x[:, t], h, training=training)\n"
                "        h = out"),
    }[base.inputs]
    lines = [
        "class Model:",
        '    """Keras layers held by a plain object, called one by one."""',
        "",
        "    def __init__(self):",
        f"        self.first = {first}",
        f"        self.first.build({shape})",
        "        self.last = K.layers.Dense(C)",
        "        self.last.build((None, H))",
        "        self.layers = [self.first, self.last]",
    ]
    if base.norm:
        lines += ["        self.norm = K.layers.BatchNormalization()",
                  "        self.norm.build((None, H))",
                  "        self.layers.append(self.norm)"]
    if base.dropout:
        lines += ["        self.drop = K.layers.Dropout(0.2, seed=3)"]
    lines += [
        "",
        "    @property",
        "    def trainable_variables(self):",
        "        return [v for layer in self.layers for v in layer.trainable_weights]",
        "",
        "    @property",
        "    def variables(self):",
        "        return [v for layer in self.layers for v in layer.weights]",
        "",
        "    def encode(self, x, training):",
        call,
    ]
    if base.norm:
        lines.append("        h = self.norm(h, training=training)")
    if base.dropout:
        lines.append("        h = self.drop(h, training=training)")
    lines += ["        return h", "", "    def head(self, h):", "        return self.last(h)"]
    return "\n".join(lines) + "\n"


def make_batch(base: Base) -> str:
    x = {
        "dense": "rng.standard_normal((batch, D)).astype(np.float32)",
        "tokens": "rng.integers(0, V, (batch, seq)).astype(np.int32)",
        "rnn": "rng.standard_normal((batch, seq, D)).astype(np.float32)",
    }[base.inputs]
    y = ("rng.standard_normal((batch, C)).astype(np.float32)" if base.loss == "mse"
         else "rng.integers(0, C, batch).astype(np.int32)")
    return (
        "def make_batch(rng, batch, seq):\n"
        '    """A fresh batch from the program\'s own numpy generator (same in every run)."""\n'
        f"    return tf.constant({x}), tf.constant({y})\n"
    )


def loss_expression(base: Base) -> str:
    return {
        "mse": "tf.reduce_mean(tf.square(logits - y))",
        "xent": "tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))",
        "keras_xent": "K.losses.SparseCategoricalCrossentropy(from_logits=True)(y, logits)",
    }["xent" if base.loss == "keras_xent" and base.backend == "raw" else base.loss]


def optimizer_lines(base: Base) -> list[str]:
    if base.optimizer == "manual":
        return ["optimizer = None"]
    make = {"sgd": "SGD(0.05)", "momentum": "SGD(0.05, momentum=0.9)", "adam": "Adam(0.01)"}
    return [f"optimizer = K.optimizers.{make[base.optimizer]}",
            "optimizer.build(params)",
            "optimizers.append(optimizer)"]


def update_line(base: Base) -> str:
    if base.optimizer == "manual":
        return "sgd(zip(grads, params), lr)"
    return "optimizer.apply_gradients([(g, v) for g, v in zip(grads, params) if g is not None])"


def log_line(base: Base) -> str:
    value = {"float": "float(loss)", "tensor": "loss", "numpy": "loss.numpy()"}[base.logging]
    return f"losses.append((step, {value}))"
