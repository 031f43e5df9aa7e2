"""Fallback: at one step the op path changes; Terra must notice, give eager's numbers, and
co-execute again afterwards.

The change comes at different depths of the iteration: before the forward pass (the graph has
barely started) and in the loss (mid-way): the graph's work is rolled back and the iteration
replayed eagerly. After ``apply_gradients`` but before the step's recorded metric op, the
graph has only computed that metric ahead (no variable written, nothing Python must feed), so
the iteration ends there instead and the extra op runs eagerly, as does an extra op *between*
iterations (after the last recorded op, before the next tape): neither needs a fallback.
"""

import pytest
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tiny_models import batch, classification_data, mlp_task, sparse_xent, state

STEPS, CHANGED_STEP = 12, 6  # warm-up 1 + ~2 traces, so CHANGED_STEP is co-executed


def path_change_program(where):
    def program(tape_cls, steps):
        data, model, optimizer, loss_fn = mlp_task(steps)
        losses, extras = [], []
        for step in range(steps):
            record_stats(f"step{step}")
            x, y = batch(data, step, 16)
            changed = step == CHANGED_STEP
            if changed and where == "between_iterations":
                x = tf.clip_by_value(x, -1.0, 1.0)
            with tape_cls() as tape:
                if changed and where == "before_forward":
                    x = tf.clip_by_value(x, -1.0, 1.0)
                loss = loss_fn(y, model(x, training=True))
                if changed and where == "in_loss":
                    loss += 1e-2 * tf.add_n([tf.nn.l2_loss(w) for w in model.trainable_variables])
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            if changed and where == "after_update":
                kernel = model.trainable_variables[0]
                extras.append(float(tf.reduce_mean(tf.square(kernel))))  # an extra metric op
            losses.append(float(loss))
            extras.append(float(tf.reduce_max(loss)))  # recorded every step, after the update
        return {"losses": losses, "extras": extras, **state(model, optimizer)}

    return program


@pytest.mark.parametrize("where", ["before_forward", "in_loss"])
def test_path_change_at_one_step_falls_back_then_coexecutes(where):
    outcome = assert_same_as_eager(
        path_change_program(where), STEPS, expect_fallbacks=(1, 2), max_traces=4
    )
    before, after = (
        outcome.stats_at(f"step{CHANGED_STEP}"),
        outcome.stats_at(f"step{CHANGED_STEP + 1}"),
    )
    assert before.coexecuted >= 1, f"the changed step was not co-executed\n{outcome.report()}"
    assert after.fallbacks >= 1, f"no fallback during the changed step\n{outcome.report()}"
    assert outcome.stats.coexecuted > after.coexecuted, (
        f"co-execution did not resume after the fallback\n{outcome.report()}"
    )


def test_extra_op_after_the_update_ends_the_iteration_without_fallback():
    # what the graph ran ahead of the extra op (the recorded metric: a Max, fetched) changes
    # nothing, so the iteration ends where Python left its path; the next one co-executes
    outcome = assert_same_as_eager(path_change_program("after_update"), STEPS)
    assert outcome.stats.coexecuted >= STEPS - 4, outcome.report()
    changed = outcome.stats_at(f"step{CHANGED_STEP + 1}")
    assert changed.coexecuted > outcome.stats_at(f"step{CHANGED_STEP}").coexecuted


def test_extra_op_between_iterations_runs_eagerly_without_fallback():
    outcome = assert_same_as_eager(path_change_program("between_iterations"), STEPS)
    assert outcome.stats.coexecuted >= STEPS - 4, outcome.report()


def skipped_resize_program(tape_cls, steps):
    """Dense layers on image-shaped tensors with a resize between them, skipped at one step:
    the fallback comes right after the first layer, whose output the second layer reshapes.
    Keras reaches that Reshape through TF's slow path, where the op wrapper records the
    gradient itself, with the inputs it was given (a stand-in, unless swapped in place): the
    replayed first layer then got no gradient at all."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, 4 * 4 * 3, 5)
    first, second, head = (tf.keras.layers.Dense(n) for n in (8, 8, 5))
    first.build((None, 4, 4, 3))
    second.build((None, 2, 2, 8))
    head.build((None, 8))
    variables = first.trainable_variables + second.trainable_variables + head.trainable_variables
    optimizer = tf.keras.optimizers.SGD(0.1)
    loss_fn = sparse_xent()
    losses, grads_per_step = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            h = first(tf.reshape(x, (16, 4, 4, 3)))
            if step != CHANGED_STEP:
                h = tf.image.resize(h, (2, 2), method="bilinear", antialias=False)
            loss = loss_fn(y, head(tf.reduce_mean(second(h), axis=[1, 2])))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        losses.append(float(loss))
        grads_per_step.append([None if g is None else g.numpy() for g in grads])
    return {"losses": losses, "grads": grads_per_step, "vars": [v.numpy() for v in variables]}


def test_fallback_before_a_slow_path_op_keeps_the_replayed_gradients():
    outcome = assert_same_as_eager(skipped_resize_program, STEPS, expect_fallbacks=(1, 1),
                                   max_traces=4)
    assert outcome.stats.coexecuted >= 4, outcome.report()


def stop_gradient_program(tape_cls, steps):
    """``tf.stop_gradient`` runs its op with the tape paused, so eager's tape never sees it.
    A fallback's replay must pause the same way: a replayed trace whose backward pass also
    differentiates into the stopped value is a different gradient region, the TraceGraph
    branches inside it and Terra can no longer build a graph."""
    data, model, optimizer, loss_fn = mlp_task(steps, tf.keras.optimizers.SGD(0.1))
    losses, kept = [], []

    def forward(x, y, step):
        logits = model(x, training=True)
        centered = logits - tf.stop_gradient(tf.reduce_mean(logits, axis=0))
        if step == CHANGED_STEP:  # the same ops, but a value that now outlives its iteration:
            kept.append(centered)  # the fallback replays the iteration on the recorded path
        return loss_fn(y, centered)

    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = forward(x, y, step)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
    return {"losses": losses, "kept": [float(tf.reduce_sum(t)) for t in kept],
            **state(model, optimizer)}


def test_replay_pauses_the_tape_where_eager_did():
    outcome = assert_same_as_eager(stop_gradient_program, STEPS + 4, expect_fallbacks=(1, 1),
                                   max_traces=4)
    assert outcome.stats.phase == "coexecution", outcome.report()
    assert outcome.stats.coexecuted >= 8, outcome.report()


def test_ops_issued_with_recording_paused_are_replayed_paused():
    """Ops under ``tf.init_scope`` inside the tape (gradient recording paused: the loss's
    scale is a constant to the gradient) pass along lanes, which note the pause per op, and
    a slice there along its region's lane; a path change later in the same iteration
    replays them, paused again, or the gradient would flow through the scale and the
    slice."""
    def program(tape_cls, steps):
        data, model, optimizer, loss_fn = mlp_task(steps)
        losses = []
        for step in range(steps):
            record_stats(f"step{step}")
            x, y = batch(data, step, 16)
            with tape_cls() as tape:
                logits = model(x, training=True)
                with tf.init_scope():
                    scale = 1.0 + tf.reduce_mean(tf.square(logits))
                    part = logits[:, 1:]  # a skipped region: not on the tape either
                loss = loss_fn(y, logits) * scale + 1e-2 * tf.reduce_sum(part)
                if step == CHANGED_STEP:
                    loss += 1e-2 * tf.reduce_sum(tf.square(logits))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            losses.append(float(loss))
        return {"losses": losses, **state(model, optimizer)}

    outcome = assert_same_as_eager(program, STEPS, expect_fallbacks=(1, 2), max_traces=4)
    assert outcome.stats_at(f"step{CHANGED_STEP + 1}").fallbacks >= 1, outcome.report()
