"""Keras' own training loop, ``model.fit(run_eagerly=True)``, under ``terra.enable()``: Keras 3
and tf_keras open the ``tf.GradientTape`` in their ``train_step``, which the user cannot edit,
so Terra must sit behind TF's class. Eager and Terra runs must agree on every batch's logs,
the epochs' logs, the progress bar's last line per epoch, the history, and every model and
optimizer variable; and the Terra run must co-execute, or the test compared eager with eager.

The point of ``run_eagerly=True`` under Terra over ``fit`` in graph mode is a ``train_step``
that needs Python values: one here reads its predictions with ``.numpy()`` and scores them
with scikit-learn at every step, which a ``tf.function`` cannot run.

Programs are module-level so that the tf_keras runs (``TF_USE_LEGACY_KERAS=1``, read when
TensorFlow is imported) can run them in a child process (``differential``'s ``env=``).
"""

import contextlib
import io
import re

import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import classification_data, mlp, mlp_task, sparse_xent, state

import terra


@pytest.fixture(autouse=True)
def _first_covered_trace_builds(monkeypatch):
    """Keras' progress bar (``verbose=1``) prints on wall-clock time, and a print issues ops
    (the means it shows): which iterations take that path depends on how fast the machine
    runs. These tests are about ``fit``'s protocol (epoch ends, callbacks, logs), so the graph
    is built at the first covered trace, as they were written for; the path census would
    trace on over the timing-dependent paths (architecture.md 3.22), more on a loaded
    machine. Set for this process and for the child processes of ``env=``."""
    monkeypatch.setenv("TERRA_NEW_PATH_RISK", "1.0")
    risk = terra.config.config.new_path_risk
    terra.configure(new_path_risk=1.0)
    yield
    terra.configure(new_path_risk=risk)

FEATURES, CLASSES, BATCH = 20, 5, 16
LEGACY = {"TF_USE_LEGACY_KERAS": "1"}
_METRIC = re.compile(r"(\w+): ([-+]?\d+\.\d+(?:e[-+]?\d+)?)")


def _terra_behind_tf_tape(tape_cls):
    """Keras names only ``tf.GradientTape``: the Terra run puts Terra behind it."""
    if tape_cls is terra.TerraGradientTape:
        terra.enable()
        return terra.disable
    return lambda: None


def _optimizer_variables(optimizer):
    found = optimizer.variables  # a method on tf_keras optimizers, a property on Keras 3's
    return list(found() if callable(found) else found)


def _last_progress(text, epochs, batches):
    """The metrics of the progress bar's last update in each epoch (its final line): the
    bar updates at times that differ between runs, its last line does not."""
    chunks = re.split(r"Epoch \d+/\d+", text)[1:]
    assert len(chunks) == epochs, text[-2000:]
    last = []
    for chunk in chunks:
        tail = chunk.rsplit(f"{batches}/{batches}", 1)
        assert len(tail) == 2, chunk[-2000:]  # the bar reached the epoch's last batch
        last.append({name: float(value) for name, value in _METRIC.findall(tail[1])})
    return last


def _fit(model, x, y, tape_cls, epochs, **fit_kwargs):
    """``model.fit`` with a per-batch logging callback, a ``LambdaCallback`` on the epochs and
    the ``verbose=1`` progress bar, under Terra when ``tape_cls`` is Terra's. Returns the
    per-batch logs, the epoch logs, the callback calls, the history and the bar's last lines."""
    batches, epoch_logs, calls = [], [], []

    class BatchLog(tf.keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            batches.append({key: float(value) for key, value in logs.items()})

    callbacks = [
        BatchLog(),
        tf.keras.callbacks.LambdaCallback(
            on_train_begin=lambda logs: calls.append("train_begin"),
            on_epoch_begin=lambda epoch, logs: calls.append(f"epoch_begin {epoch}"),
            on_epoch_end=lambda epoch, logs: epoch_logs.append(
                {key: float(value) for key, value in logs.items()}),
            on_train_end=lambda logs: calls.append("train_end")),
    ]
    out = io.StringIO()
    stop = _terra_behind_tf_tape(tape_cls)
    try:
        with contextlib.redirect_stdout(out):
            history = model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=1,
                                callbacks=callbacks, **fit_kwargs)
    finally:
        stop()
    per_epoch = len(x) // BATCH
    return {"batches": batches, "epochs": epoch_logs, "calls": calls,
            "history": {key: [float(v) for v in values]
                        for key, values in history.history.items()},
            "progress": _last_progress(out.getvalue(), epochs, per_epoch)}


def _data(steps, epochs):
    tf.keras.utils.set_random_seed(0)
    return classification_data(steps // epochs * BATCH, FEATURES, CLASSES)


# -- (a), (b): Keras' own train_step ---------------------------------------------------------


def keras_fit(tape_cls, steps, epochs=2, validation=False):
    """A compiled MLP trained by ``fit(run_eagerly=True)`` for two epochs of ``steps / 2``
    batches, with an accuracy metric; with ``validation``, ``validation_data`` too (Keras
    evaluates at each epoch's end, with no tape open: between two of Terra's iterations)."""
    x, y = _data(steps, epochs)
    model = mlp(FEATURES, (16,), CLASSES)
    optimizer = tf.keras.optimizers.Adam(1e-2)
    model.compile(optimizer=optimizer, loss=sparse_xent(), metrics=["accuracy"],
                  run_eagerly=True)
    extra = {"validation_data": (x[: 2 * BATCH] + 0.5, y[: 2 * BATCH])} if validation else {}
    results = _fit(model, x, y, tape_cls, epochs, **extra)
    return {**results, "model": model.variables, "optimizer": _optimizer_variables(optimizer)}


def keras_fit_validation(tape_cls, steps):
    return keras_fit(tape_cls, steps, validation=True)


def keras_fit_three_epochs(tape_cls, steps):
    return keras_fit(tape_cls, steps, epochs=3)


def keras_fit_dataset_of_unknown_length(tape_cls, steps):
    """``fit`` on a ``tf.data.Dataset`` whose length Keras cannot know (a ``filter``): each
    epoch ends when the iterator's ``get_next``, which Terra runs in Python, raises
    ``OutOfRangeError``, which Keras catches."""
    x, y = _data(steps, 2)
    model = mlp(FEATURES, (16,), CLASSES)
    optimizer = tf.keras.optimizers.Adam(1e-2)
    model.compile(optimizer=optimizer, loss=sparse_xent(), run_eagerly=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(BATCH)
    stop, losses = _terra_behind_tf_tape(tape_cls), []
    try:
        history = model.fit(dataset, epochs=2, shuffle=False, verbose=0, callbacks=[
            tf.keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: losses.append(float(logs["loss"])))])
    finally:
        stop()
    return {"losses": losses, "history": history.history["loss"], "model": model.variables,
            "optimizer": _optimizer_variables(optimizer)}


KERAS_PROGRAMS = [keras_fit, keras_fit_validation, keras_fit_three_epochs,
                  keras_fit_dataset_of_unknown_length]


@pytest.mark.parametrize("program", KERAS_PROGRAMS)
def test_keras3_fit_run_eagerly_coexecutes(program):
    # 12 steps: one warm-up step, two traced, the rest co-executed, across the epochs' ends
    # (each epoch end, where Keras makes a new iterator, ends an iteration early: no fallback)
    outcome = assert_same_as_eager(program, 12, min_coexecuted=8)
    assert "keras" in outcome.keras and "tf_keras" not in outcome.keras


@pytest.mark.parametrize("program", [keras_fit, keras_fit_validation,
                                     keras_fit_dataset_of_unknown_length])
def test_tf_keras_fit_run_eagerly_coexecutes(program):
    # a third trace where tf_keras' next batch gets a second site (a new frame with a
    # returned one's id: architecture.md, "Executed locations of a caller's new activation")
    outcome = assert_same_as_eager(program, 12, env=LEGACY, min_coexecuted=7, max_traces=3)
    assert outcome.keras.startswith("tf_keras"), outcome.keras


# -- (c): a train_step that reads its predictions in Python ---------------------------------


def _scored_model():
    """``benchmarks.keras_fit.scored_model``: a ``train_step`` that fetches its predictions
    (``.numpy()``) and scores them with scikit-learn and NumPy, Python a graph-mode ``fit``
    cannot run. Built per call: ``tf.keras`` is Keras 3 or tf_keras by environment."""
    from benchmarks.keras_fit import scored_model

    return scored_model(tf, features=FEATURES, hidden=(16,), classes=CLASSES)


def fit_with_sklearn_in_train_step(tape_cls, steps, epochs=2):
    x, y = _data(steps, epochs)
    model = _scored_model()
    optimizer = tf.keras.optimizers.Adam(1e-2)
    model.compile(optimizer=optimizer, run_eagerly=True)
    results = _fit(model, x, y, tape_cls, epochs)
    return {**results, "scores": model.scores, "model": model.variables,
            "optimizer": _optimizer_variables(optimizer)}


# The scores enter the logs as Python floats, which TF converts to constants: a score both
# traces saw alike is taken as a constant of the graph, and the first step that scores
# otherwise falls back once (a "value change"), after which it is fed. One per score at most.
SCORE_FALLBACKS = {"expect_fallbacks": (0, 2), "max_traces": 4, "min_coexecuted": 5}


def test_keras3_train_step_reading_predictions_with_numpy_and_sklearn_coexecutes():
    outcome = assert_same_as_eager(fit_with_sklearn_in_train_step, 12, **SCORE_FALLBACKS)
    assert outcome.eager["progress"][0].keys() >= {"loss", "f1", "hits"}
    assert "predicted = np.argmax(logits.numpy()" in outcome.explain  # Python waited there


def test_tf_keras_train_step_reading_predictions_with_numpy_and_sklearn_coexecutes():
    outcome = assert_same_as_eager(fit_with_sklearn_in_train_step, 12, env=LEGACY,
                                   **SCORE_FALLBACKS)
    assert outcome.eager["progress"][0].keys() >= {"loss", "f1", "hits"}


# -- an epoch's end in a loop of one's own --------------------------------------------------


def _epochs(tape_cls, steps, before_next_batch):
    """Three epochs of ``steps / 3`` batches of a dataset, each epoch with a new iterator;
    within an epoch, after the update, ``before_next_batch(counter)`` then the next batch.
    At an epoch's end Python skips both where the graph, built from steps within an epoch,
    goes on with them: it has run them ahead of Python."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(16).take(steps // 3)
    counter = tf.Variable(0, dtype=tf.int64)
    losses, seen = [], []
    for _ in range(3):
        iterator = iter(dataset)  # AnonymousIteratorV3 and MakeIterator, run in Python
        x, y = next(iterator)
        for i in range(steps // 3):
            with tape_cls() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            counter.assign_add(1)
            losses.append(loss)
            if i + 1 < steps // 3:
                seen.append(before_next_batch(counter))
                x, y = next(iterator)  # IteratorGetNext, run in Python
    return {"losses": losses, "seen": seen, "counter": counter, **state(model, optimizer)}


def epochs_reading_a_counter(tape_cls, steps):
    """What the graph ran ahead at an epoch's end is a variable read for Python (tf_keras'
    ``fit`` reads its ``steps_per_execution`` there) and the iterator's ``get_next``: the
    iteration ends early, and the value read ahead is dropped, not handed to the next
    epoch's first read."""
    return _epochs(tape_cls, steps, lambda counter: int(counter))


def epochs_bumping_a_counter(tape_cls, steps):
    """What the graph ran ahead at an epoch's end writes a variable: ending the iteration
    there would keep a write eager never made, so Terra falls back (the snapshot undoes it)."""
    def bump(counter):
        counter.assign_add(10)
        return None
    return _epochs(tape_cls, steps, bump)


def dataset_loop_to_its_end(tape_cls, steps):
    """``for x, y in dataset`` three times: each pass ends when ``get_next`` (run in Python)
    raises ``OutOfRangeError``, which the iterator turns into ``StopIteration``; the error is
    the program's, raised once, and the graph's work before it is kept."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(16).take(steps // 3)
    losses = []
    for _ in range(3):
        for x, y in dataset:
            with tape_cls() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(loss)
    return {"losses": losses, **state(model, optimizer)}


@pytest.mark.parametrize("program", [epochs_reading_a_counter, dataset_loop_to_its_end])
def test_an_epoch_end_after_only_reads_ends_the_iteration_without_fallback(program):
    assert_same_as_eager(program, 12, min_coexecuted=8)


def test_an_epoch_end_after_a_write_falls_back():
    # the first epoch end falls back and is traced; the second follows the traced branch;
    # the reads after the loop fall back once more: the path branches there, and neither
    # branch (the write or the next epoch's iterator) is one the graph may end without
    outcome = assert_same_as_eager(epochs_bumping_a_counter, 12, expect_fallbacks=2,
                                   max_traces=4, min_coexecuted=6)
    assert "expected AssignAddVariableOp, got AnonymousIteratorV3" in outcome.explain
