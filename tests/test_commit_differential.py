"""The commit point (terra/commit.py): a gated graph writes no variable until the iteration
ends, so it needs no snapshot; where a fallback can still come after the point the graph could
first have written (the optimizer update), the numbers must still be eager's.

Each program falls back once, at ``CHANGED_STEP``, after ``apply_gradients``: Python reads a
value the graph does not return, keeps one past the iteration, or issues a new op while the
tape is still open; or, every step, reads a value computed after the update (a metric the
graph fills only after the gate, so Python lets it write with a snapshot first) and then
falls back. Before the commit point existed every job was snapshotted; these programs check
that deferring the writes, or snapshotting late, still restores eager's state.
"""

import pytest
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, mlp_loop, mlp_task, state

import terra

STEPS, CHANGED_STEP = 12, 7  # warm-up 1 + ~2 traces, so CHANGED_STEP is co-executed


def late_divergence_program(where):
    def program(tape_cls, steps):
        data, model, optimizer, loss_fn = mlp_task(steps)
        total = tf.Variable(0.0)
        losses, extras, kept = [], [], []
        for step in range(steps):
            x, y = batch(data, step, 16)
            changed = step == CHANGED_STEP
            with tape_cls() as tape:
                logits = model(x, training=True)
                loss = loss_fn(y, logits)
                mean_logit = tf.reduce_mean(logits)  # dropped unread, but at CHANGED_STEP
                if where == "op_in_open_tape":  # the update inside the tape's block
                    grads = tape.gradient(loss, model.trainable_variables)
                    optimizer.apply_gradients(zip(grads, model.trainable_variables,
                                                  strict=True))
                    if changed:
                        extras.append(float(tf.reduce_sum(logits)))  # a new op, tape open
            if where != "op_in_open_tape":
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            if where == "metric_read_late":  # read after its update: a fetch after the gate
                total.assign_add(loss)
                extras.append(float(total.numpy()))
            if changed and where in ("new_fetch", "metric_read_late"):
                extras.append(float(mean_logit))  # never read before
            if changed and where == "kept":
                kept.append(mean_logit)  # outlives the iteration; the graph does not return it
            del mean_logit
            losses.append(float(loss))
        return {"losses": losses, "extras": extras, "kept": kept, "total": total,
                **state(model, optimizer)}

    return program


@pytest.mark.parametrize("where", ["new_fetch", "kept", "op_in_open_tape", "metric_read_late"])
def test_a_fallback_after_the_update_gives_eagers_numbers(where):
    outcome = assert_same_as_eager(late_divergence_program(where), STEPS,
                                   expect_fallbacks=(1, 2), max_traces=4, min_coexecuted=3)
    if where == "metric_read_late":  # every co-executed iteration read a value written first
        assert outcome.stats.snapshots >= outcome.stats.coexecuted, outcome.report()


def test_no_snapshot_where_no_fallback_can_come():
    outcome = assert_same_as_eager(mlp_loop, STEPS, min_coexecuted=5)
    assert outcome.stats.snapshots == 0, outcome.report()


def test_without_the_commit_point_every_job_snapshots():
    terra.configure(commit=False)
    try:
        outcome = assert_same_as_eager(mlp_loop, STEPS, min_coexecuted=5)
    finally:
        terra.configure(commit=True)
    assert outcome.stats.snapshots >= outcome.stats.coexecuted, outcome.report()


def test_verify_mode_snapshots_only_the_iterations_it_checks():
    terra.configure(verify=3)
    try:
        outcome = assert_same_as_eager(mlp_loop, STEPS, min_coexecuted=5)
    finally:
        terra.configure(verify=0)
    stats = outcome.stats
    assert stats.verified >= 1 and stats.verify_differences == 0, outcome.report()
    assert stats.snapshots == stats.verified, outcome.report()


def dropout_program(tape_cls, steps):
    """Keras 3's dropout draws its seed from a variable it writes at each call and reads again
    at the next: that variable is written before the gate (and snapshotted before every job,
    two numbers), the model's and the optimizer's after it. A late fallback must put both
    back: with the seed not restored, the replay's dropout masks would be other ones."""
    data, _, optimizer, loss_fn = mlp_task(steps)
    drop = tf.keras.layers.Dropout(0.3)  # one layer, called twice: its seed is read again
    inputs = tf.keras.Input((20,))
    hidden = drop(tf.keras.layers.Dense(16, "relu")(inputs))
    hidden = drop(tf.keras.layers.Dense(16, "relu")(hidden))
    model = tf.keras.Model(inputs, tf.keras.layers.Dense(5)(hidden))
    losses, extras = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
            scale = tf.reduce_max(tf.abs(loss))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        if step == CHANGED_STEP:
            extras.append(float(scale))  # never read before: a fallback after the update
        del scale
        losses.append(float(loss))
    return {"losses": losses, "extras": extras, **state(model, optimizer),
            "seeds": [v for v in model.variables if "seed" in v.name]}


def test_variables_written_before_the_gate_are_restored_too():
    outcome = assert_same_as_eager(dropout_program, STEPS, expect_fallbacks=1, max_traces=4,
                                   min_coexecuted=3)
    assert outcome.stats.snapshots == 0, outcome.report()  # the small one is not counted


def read_after_update_program(kept):
    """Every step reads a value the graph computes after its gate (the learning rate a
    schedule set after the update, and a running total), once the whole path was matched and
    with nothing held that the graph does not return: the iteration ends there, its writes
    let through without a snapshot. ``kept``: Python also keeps the losses past their
    iterations (returned by the graph), and reads them at the end."""

    def program(tape_cls, steps):
        data, model, optimizer, loss_fn = mlp_task(steps)
        total = tf.Variable(0.0)
        losses, extras = [], []
        for step in range(steps):
            x, y = batch(data, step, 16)
            with tape_cls() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            total.assign_add(loss)
            optimizer.learning_rate.assign(1e-3 / (1.0 + 0.1 * tf.sqrt(total)))
            extras.append(float(optimizer.learning_rate.numpy()))  # after the gate
            losses.append(loss if kept else float(loss))
        losses = [float(loss) for loss in losses]
        return {"losses": losses, "extras": extras, "total": total, **state(model, optimizer)}

    return program


@pytest.mark.parametrize("kept", [False, True])
def test_a_read_after_the_update_at_the_paths_end_ends_the_iteration(kept):
    outcome = assert_same_as_eager(read_after_update_program(kept), STEPS, min_coexecuted=5)
    assert outcome.stats.snapshots == 0, outcome.report()
