"""``python -m benchmarks.keras_fit``: Keras' ``model.fit`` three ways, Keras 3 and tf_keras.

``fit(run_eagerly=True)`` is what a user needs when a ``train_step`` reads values in Python
(``.numpy()``, scikit-learn): ``fit`` in graph mode cannot run it. Under ``terra.enable()``
that eager ``fit`` co-executes. This script times, for each Keras and model, in a fresh
process per run (``benchmarks.worker.serve``):

- ``eager``: ``compile(run_eagerly=True)``, TensorFlow alone;
- ``terra``: the same after ``terra.enable()`` (Terra's defaults: its cost budget included);
- ``graph``: ``compile(run_eagerly=False, jit_compile=False)``, Keras' ``tf.function`` steps.

Models: ``convnet``, the convnet of Keras' MNIST example with Adam (the corpus' ``keras3_fit``),
and ``scored``, a small MLP whose ``train_step`` fetches its predictions and scores them with
scikit-learn's macro F1 at every step, which graph mode cannot run (its row says so).

Each run is ``--epochs`` epochs of ``--batches`` batches (``verbose=0``; each epoch's end makes
a new iterator, as a user's ``fit`` does). Reported: steps/s over the whole ``fit`` (Terra's
tracing and graph generation, graph mode's tracing, included) and over the second half of the
steps (medians over ``--repeats`` rounds; a ratio is taken within its round, then the median),
Terra's stats, and whether Terra's per-batch losses and final variables equal eager's
(bit for bit, and within 1e-4 relative); graph mode's largest loss difference from eager is
given for comparison (its kernels may round differently).

    python -m benchmarks.keras_fit                       # both Keras, both models, 3 repeats
    python -m benchmarks.keras_fit --keras 3 --models convnet --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from benchmarks.harness import compare_losses, run_worker
from benchmarks.worker import keras_env, serve

MODES = ("eager", "terra", "graph")
MODELS = ("convnet", "scored")
RTOL, ATOL = 1e-4, 1e-6
TIMEOUT = 900.0


# -- one run, in the worker process ------------------------------------------------------------


def _convnet(tf):
    model = tf.keras.Sequential([
        tf.keras.Input(shape=(28, 28, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Conv2D(32, 3, activation="relu"),
        tf.keras.layers.MaxPooling2D(2),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ])
    return model, dict(loss="sparse_categorical_crossentropy"), (28, 28, 1), 10


def _scored(tf):
    return scored_model(tf, features=64, hidden=(128, 128), classes=10), {}, (64,), 10


def scored_model(tf, features: int, hidden: tuple, classes: int):
    """A Sequential MLP whose ``train_step`` fetches its predictions (``.numpy()``) and scores
    them with scikit-learn's macro F1 and NumPy, reported in the step's logs and kept in
    ``model.scores`` as ``(f1, hits, predictions)``: Python a graph-mode ``fit`` cannot run.
    ``tf``: the caller's module, whose ``tf.keras`` is Keras 3 or tf_keras by environment."""
    from sklearn.metrics import f1_score

    class Scored(tf.keras.Sequential):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                logits = self(x, training=True)
                loss = tf.reduce_mean(self.loss_fn(y, logits))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
            predicted = np.argmax(logits.numpy(), axis=1)  # graph mode cannot run this
            labels = np.asarray(y)
            f1 = float(f1_score(labels, predicted, average="macro", labels=range(classes),
                                zero_division=0))
            hits = float(np.mean(predicted == labels))
            self.scores.append((f1, hits, predicted))
            return {"loss": loss, "f1": f1, "hits": hits}

    model = Scored([tf.keras.Input((features,)),
                    *[tf.keras.layers.Dense(n, activation="relu") for n in hidden],
                    tf.keras.layers.Dense(classes)])
    model.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                                  reduction="none")
    model.scores = []
    return model


def run(model: str, mode: str, epochs: int, batches: int, batch: int, seed: int,
        variables_path: str) -> dict:
    """One ``fit``; never raises (an error, e.g. graph mode on ``scored``, is the result)."""
    import random

    import tensorflow as tf

    result = dict(model=model, mode=mode, epochs=epochs, batches=batches, batch=batch)
    random.seed(seed)
    np.random.seed(seed)
    tf.keras.utils.set_random_seed(seed)
    if mode == "terra":
        import terra

        terra.enable()
    try:
        net, compile_args, shape, classes = (_convnet if model == "convnet" else _scored)(tf)
        result["keras"] = type(net).__mro__[1].__module__.split(".")[0]  # keras or tf_keras
        rng = np.random.default_rng(seed)
        x = rng.uniform(size=(batches * batch, *shape)).astype(np.float32)
        y = rng.integers(0, classes, batches * batch)
        net.compile(optimizer=tf.keras.optimizers.Adam(1e-3), run_eagerly=mode != "graph",
                    jit_compile=False, **compile_args)
        losses, ticks = [], []

        class Tick(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, step, logs=None):
                losses.append(float(logs["loss"]))
                ticks.append(time.perf_counter())

        start = time.perf_counter()
        net.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                callbacks=[Tick()])
        end = time.perf_counter()
        half = len(ticks) // 2
        result.update(losses=losses, total_s=end - start, steps=len(ticks),
                      second_half_s=end - ticks[half - 1], second_half_steps=len(ticks) - half)
        optimizer = net.optimizer.variables
        values = [*net.variables, *(optimizer() if callable(optimizer) else optimizer)]
        np.savez(variables_path, *[np.asarray(v.numpy()) for v in values])
    except Exception as error:  # reported, not handled: a failing mode is a result
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        # AutoGraph's "in user code: File ...": the message is the last line
        message = lines[-1] if lines and lines[0] == "in user code:" else (lines or [""])[0]
        result["error"] = f"{type(error).__name__}: {message[:200]}"
    if mode == "terra":
        import terra

        stats = terra.stats()
        result["stats"] = {name: getattr(stats, name) for name in
                           ("traces", "fallbacks", "graph_generations", "coexecuted", "phase")}
    return result


# -- the schedule and the table, in the driver process ----------------------------------------


def _same_variables(eager_path: str, terra_path: str) -> tuple[bool, bool]:
    """(bit for bit, within RTOL/ATOL) over every variable."""
    with np.load(eager_path) as eager, np.load(terra_path) as terra:
        pairs = [(eager[k], terra[k]) for k in eager.files]
        if sorted(eager.files) != sorted(terra.files):
            return False, False
    exact = all(a.dtype == b.dtype and a.tobytes() == b.tobytes() for a, b in pairs)
    close = all(a.shape == b.shape and np.allclose(b, a, rtol=RTOL, atol=ATOL)
                for a, b in pairs)
    return exact, close


def measure(keras: int, model: str, args, log) -> dict:
    """``args.repeats`` rounds of the three modes (the order rotated per round), one row."""
    runs = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            order = MODES[repeat % 3:] + MODES[:repeat % 3]
            for mode in order:
                path = os.path.join(scratch, f"{model}-{mode}-{repeat}.npz")
                spec = dict(model=model, mode=mode, epochs=args.epochs, batches=args.batches,
                            batch=args.batch, seed=args.seed, variables_path=path)
                result = run_worker("benchmarks.keras_fit", spec, TIMEOUT, keras_env(keras))
                result["variables_path"] = path
                runs[mode].append(result)
                log(f"  keras {keras} {model} {mode} (repeat {repeat + 1}): " + (
                    result.get("error") or f"{result['steps'] / result['total_s']:.2f} steps/s"))
        row = dict(keras=keras, model=model, steps=args.epochs * args.batches,
                   module=runs["eager"][-1].get("keras"))
        for mode in MODES:
            ok = [r for r in runs[mode] if "error" not in r]
            row[mode] = None if len(ok) < len(runs[mode]) else (
                statistics.median(r["steps"] / r["total_s"] for r in ok),
                statistics.median(r["second_half_steps"] / r["second_half_s"] for r in ok))
            if len(ok) < len(runs[mode]):
                row[f"{mode}_error"] = next(r["error"] for r in runs[mode] if "error" in r)
        for base in ("eager", "graph"):  # within each round, then the median over rounds
            ratios = [(t["steps"] / t["total_s"]) / (b["steps"] / b["total_s"])
                      for t, b in zip(runs["terra"], runs[base], strict=True)
                      if "error" not in t and "error" not in b]
            row[f"terra_over_{base}"] = statistics.median(ratios) if ratios else None
        row["stats"] = runs["terra"][-1].get("stats")
        checks = []
        for eager, terra in zip(runs["eager"], runs["terra"], strict=True):
            if "error" in eager or "error" in terra:
                checks.append((False, False))
                continue
            mismatch, _ = compare_losses(terra["losses"], eager["losses"], RTOL, ATOL)
            exact_losses = terra["losses"] == eager["losses"]
            exact, close = _same_variables(eager["variables_path"], terra["variables_path"])
            checks.append((exact and exact_losses, close and mismatch is None))
        row["exact"] = all(exact for exact, _ in checks)
        row["match"] = all(close for _, close in checks)
        graph_rel = [compare_losses(g["losses"], e["losses"], RTOL, ATOL)[1]
                     for g, e in zip(runs["graph"], runs["eager"], strict=True)
                     if "error" not in g and "error" not in e]
        row["graph_rel"] = max(graph_rel) if graph_rel else None
    return row


def table(rows: list[dict]) -> str:
    lines = ["| Keras | model | eager steps/s | Terra steps/s | graph-mode steps/s "
             "| Terra / eager | Terra / graph | 2nd half: eager, Terra, graph "
             "| Terra = eager | traces, fallbacks, co-executed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        def whole(mode, row=row):
            return "fails" if row[mode] is None else f"{row[mode][0]:.1f}"

        def half(mode, row=row):
            return "-" if row[mode] is None else f"{row[mode][1]:.1f}"

        def ratio(mode, row=row):
            value = row[f"terra_over_{mode}"]
            return "-" if value is None else f"x{value:.2f}"

        stats = row["stats"] or {}
        same = ("bit for bit" if row["exact"] else "yes" if row["match"] else "**no**")
        lines.append(
            f"| {row['keras']} ({row['module']}) | {row['model']} | {whole('eager')} "
            f"| {whole('terra')} | {whole('graph')} | {ratio('eager')} | {ratio('graph')} "
            f"| {half('eager')}, {half('terra')}, {half('graph')} | {same} "
            f"| {stats.get('traces', '-')}, {stats.get('fallbacks', '-')}, "
            f"{stats.get('coexecuted', '-')}/{row['steps']} |")
    notes = [f"- Keras {row['keras']} {row['model']}: graph mode "
             + (f"fails: {row['graph_error']}" if row.get("graph_error") else
                f"losses within {row['graph_rel']:.1e} (relative) of eager's")
             for row in rows]
    return "\n".join(lines + [""] + notes)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.keras_fit",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--keras", default="3,2", help="Keras versions: 3, 2 (tf_keras) or both")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=30, help="batches per epoch")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    def log(message):
        print(message, file=sys.stderr, flush=True)

    rows = [measure(int(keras), model, args, log)
            for keras in args.keras.split(",") for model in args.models.split(",")]
    print(table(rows))
    return 0 if all(row["match"] for row in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # a worker: one run's JSON spec
        serve(run)
    else:
        sys.exit(main(sys.argv[1:]))
