"""Spare stand-ins (``StandIns.sources``, ``escapes.sweep``): a stand-in Python dropped is handed
out again by a later op of its spec. That must never be visible: a tensor a program set an
attribute on, or holds a weak reference to, is never handed out again, and a value kept
across iterations keeps its own."""

import gc
import weakref

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager

import terra
from terra import escapes, runtime, standins

STEPS = 12


def _step(w, x, tape_cls, look=None):
    """One training step, its loss returned. ``look`` is shown every tensor the forward pass
    makes, which are then dropped within the iteration (by clearing the one list that holds
    them: the frames running the loop are held to the iteration's end, with their locals)."""
    with tape_cls() as tape:
        made = [tf.add(x, 1.0)]
        made.append(made[-1] * w)
        made.append(tf.transpose(made[-1]))
        made.append(made[-1] * 2.0)
        made.append(made[-1] * made[-1])
        loss = tf.reduce_sum(made[-1])
        if look is not None:
            look(made)
        made.clear()
    grad = tape.gradient(loss, w)
    w.assign_sub(1e-3 * grad)
    return loss


def _data():
    return tf.Variable(tf.fill((4, 4), 0.5)), tf.constant(
        np.arange(16, dtype=np.float32).reshape(4, 4) / 16)


def test_dropped_stand_ins_are_handed_out_again():
    """The premise of the tests below: under Terra a later iteration's tensors are stand-ins an
    earlier one handed out (TF numbers its tensors in creation order, so eagerly the ids of
    each step's tensors only grow)."""
    terra.reset()
    w, x = _data()
    ids = []
    try:
        for _ in range(STEPS):
            _step(w, x, terra.TerraGradientTape, lambda made: ids.append([t._id for t in made]))
        coexecuted = terra.stats().coexecuted
    finally:
        terra.reset()
    assert coexecuted >= 4
    assert min(ids[-1]) <= max(ids[-2]), ids


def attribute_program(tape_cls, steps):
    """Each step tags the tensors its forward pass makes with an attribute, then drops them:
    no later tensor may come with a tag (eagerly each is a new one)."""
    w, x = _data()
    tagged, losses = [], []

    def look(made):
        tagged.append([getattr(t, "tag", None) for t in made])
        for t in made:
            t.tag = len(tagged)

    for _ in range(steps):
        losses.append(float(_step(w, x, tape_cls, look)))
    return {"losses": losses, "tagged": tagged, "w": w.numpy()}


def test_a_tensor_given_an_attribute_is_not_handed_out_again():
    assert_same_as_eager(attribute_program, STEPS, min_coexecuted=4)


def weakref_program(tape_cls, steps):
    """Each step keeps weak references to the tensors its forward pass makes, which it drops:
    once the next step has run they must be dead (a tensor handed out again would bring its
    reference back to life as another value). Under Terra a dropped stand-in may live until
    its iteration is swept, when the next one begins."""
    w, x = _data()
    refs, dead, losses = [], [], []

    def look(made):
        refs.append([weakref.ref(t) for t in made])

    for _ in range(steps):
        losses.append(float(_step(w, x, tape_cls, look)))
        if len(refs) > 1:
            dead.append([r() is None for r in refs[-2]])
    return {"losses": losses, "dead": dead, "w": w.numpy()}


def test_a_tensor_weakly_referenced_is_not_handed_out_again():
    assert_same_as_eager(weakref_program, STEPS, min_coexecuted=4)


def kept_program(tape_cls, steps):
    """Every other step keeps one tensor of its forward pass to the end and drops the others:
    the kept ones keep their own values while the stand-ins around them are handed out
    again."""
    w, x = _data()
    kept, losses = [], []

    def look(made):
        if len(losses) % 2:
            kept.append(made[1])

    for _ in range(steps):
        losses.append(float(_step(w, x, tape_cls, look)))
    return {"losses": losses, "kept": [k.numpy() for k in kept], "w": w.numpy()}


def test_stand_ins_kept_across_iterations_keep_their_values():
    assert_same_as_eager(kept_program, STEPS, min_coexecuted=4)


def _scalar_spares_after_sweeps(monkeypatch):
    """The number of spares of the float32 scalars' spec after each sweep that pools them, as
    a list filled while the test runs."""
    spares, spec, original = [], ((), tf.float32.as_datatype_enum), escapes.sweep

    def sweep(it, tensors, pool=False):
        held = original(it, tensors, pool)
        if pool:
            spares.append(len(runtime.get().runner.standins.sources[spec][1]))
        return held

    monkeypatch.setattr(escapes, "sweep", sweep)
    return spares


def test_a_spec_python_keeps_gets_its_spare_at_the_iterations_end(monkeypatch):
    """Python keeps every step's loss, so its spec's spares run dry each iteration; the sweep
    copies one then (the graph's waits have just run TF's eager code), not the loss's lane in
    the next iteration (a copy there costs ~30 us: TF's code out of the caches). After each
    co-executed iteration's sweep the loss's spec has a spare; the kept losses keep their
    values (``kept_program`` above) and match eager's."""
    terra.reset()
    w, x = _data()
    kept, spares = [], _scalar_spares_after_sweeps(monkeypatch)
    try:
        for _ in range(STEPS):
            kept.append(_step(w, x, terra.TerraGradientTape))
        coexecuted = terra.stats().coexecuted
        losses = [float(t) for t in kept]
    finally:
        terra.reset()
    assert coexecuted >= 4
    assert len(spares) >= 3 and min(spares) >= 1, spares
    assert len(set(losses)) == len(losses), losses  # each kept loss its own value


def test_a_spec_python_keeps_gets_back_every_spare_it_lost(monkeypatch):
    """Three scalars an iteration, of which Python keeps one: the sweep gets two back and
    copies the third, so each co-executed iteration finds as many spares as it takes (with
    one copied only where none was left, the third scalar's lane would copy one in every
    iteration). The kept losses keep their values and match eager's."""
    def step(w, x, tape_cls):
        with tape_cls() as tape:
            h = tf.add(x, 1.0) * w
            loss = tf.reduce_sum(h) + tf.reduce_mean(h)  # three float32 scalars
        w.assign_sub(1e-3 * tape.gradient(loss, w))
        return loss

    def program(tape_cls, steps):
        w, x = _data()
        kept = [step(w, x, tape_cls) for _ in range(steps)]
        return {"losses": [float(t) for t in kept], "w": w}

    spares = _scalar_spares_after_sweeps(monkeypatch)
    outcome = assert_same_as_eager(program, STEPS, min_coexecuted=4)
    assert len(spares) >= 3 and min(spares) >= 3, (spares, outcome.report())
    assert max(spares) == 3, spares  # no more: the pool does not grow
    assert len(set(outcome.terra["losses"])) == STEPS


def test_a_kept_loss_keeps_its_entry_and_not_the_step_that_made_it():
    """Each co-executed iteration's loss is kept to the end (an escape): its entry outlives
    the iteration, the rest of the iteration's entries must not. An entry that was its op's
    log record holds the op's inputs, the producers' entries, and theirs in turn, so the
    iteration's release lets go of a kept entry's inputs, or every kept loss would keep its
    whole forward pass."""
    terra.reset()
    w, x = _data()
    kept = []
    try:
        for _ in range(3 * STEPS):
            kept.append(_step(w, x, terra.TerraGradientTape))
        coexecuted = terra.stats().coexecuted
        entries = sum(type(o) is standins.Entry for o in gc.get_objects())
    finally:
        terra.reset()
    assert coexecuted >= 3 * STEPS - 8
    # one per kept loss, and the last iteration's own (released at the next one's start)
    assert entries <= len(kept) + 8, (entries, len(kept))
