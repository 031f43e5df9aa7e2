"""Function regions (``terra.function_regions``): TF's slicing, ``tf.boolean_mask``,
``tf.nn.sigmoid_cross_entropy_with_logits`` and the softmax cross entropies skipped by the
skeleton, with eager's numbers.

The programs are a raw ``tf.Module`` with a YOLO-style loss: slices of tensors whose row
count depends on data, boolean masks whose rows change every step, a slice bound that
Python changes between steps.
"""

import numpy as np
import tensorflow as tf

from terra import function_regions
from tests.differential import assert_same_as_eager, record_stats


class Detector(tf.Module):
    """A dense head predicting (x, y, w, h, objectness) per cell of a 4x4 grid."""

    def __init__(self):
        super().__init__()
        init = tf.random.stateless_normal((8, 16 * 5), seed=(1, 2)) * 0.1
        self.w = tf.Variable(init)
        self.b = tf.Variable(tf.zeros((16 * 5,)))

    def __call__(self, x):
        return tf.reshape(tf.matmul(x, self.w) + self.b, (-1, 4, 4, 5))


def iou(a, b):
    """IoU of boxes (cx, cy, w, h): eight slices of tensors whose rows depend on data."""
    a_min, a_max = a[..., :2] - a[..., 2:4] / 2, a[..., :2] + a[..., 2:4] / 2
    b_min, b_max = b[..., :2] - b[..., 2:4] / 2, b[..., :2] + b[..., 2:4] / 2
    inter = tf.reduce_prod(tf.maximum(tf.minimum(a_max, b_max) - tf.maximum(a_min, b_min), 0.0),
                           axis=-1)
    union = tf.reduce_prod(a[..., 2:4], -1) + tf.reduce_prod(b[..., 2:4], -1) - inter
    return inter / (union + 1e-9)


def detector_program(tape_cls, steps, bound=lambda step: 4):
    """The loss selects the responsible cells with boolean masks (their count changes every
    step), computes the IoU of the selected boxes and an objectness loss on the rest;
    ``bound(step)`` is a slice bound Python picks per step."""
    rng = np.random.default_rng(0)
    model = Detector()
    optimizer = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    losses, counts = [], []
    for step in range(steps):
        x = tf.constant(rng.normal(size=(2, 8)).astype(np.float32))
        cells = rng.random((2, 4, 4)) < 0.1 + 0.3 * rng.random()
        label = np.concatenate([rng.random((2, 4, 4, 4)) + 0.5, cells[..., None]], -1)
        label = tf.constant(label.astype(np.float32))
        with tape_cls() as tape:
            out = model(x)
            obj = label[..., 4] > 0.5
            pred = tf.boolean_mask(out, obj)
            true = tf.boolean_mask(label, obj)
            box_loss = tf.reduce_sum(1.0 - iou(pred[:, :4], true[:, :4]))
            conf = tf.nn.sigmoid_cross_entropy_with_logits(
                labels=label[..., 4], logits=out[..., 4])
            k = bound(step)
            loss = box_loss + tf.reduce_sum(conf[:, :k]) / 8.0
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(float(loss))
        counts.append(int(pred.shape[0]))
        record_stats(f"step{step}")
    return {"losses": losses, "counts": counts,
            "variables": [v.numpy() for v in model.trainable_variables]}


def test_slices_and_boolean_masks_are_skipped_with_eagers_numbers():
    steps = 24
    outcome = assert_same_as_eager(detector_program, steps, max_traces=3, min_coexecuted=12)
    # the masks' rows changed from step to step: the skipped masks' values were fetched
    assert len(set(outcome.eager["counts"])) > 3
    late = outcome.stats.skipped_function_calls - \
        outcome.stats_at("step15").skipped_function_calls
    # per step at least the two boolean masks, the objectness loss and the slices of `out`
    # and `label` (whose shapes are fixed); the IoU's slices once their row counts are learned
    assert late >= 8 * (steps - 16), outcome.report()


def _alternating_bound(tape_cls, steps):
    return detector_program(tape_cls, steps, bound=lambda step: 2 + (step // 5) % 2)


def test_a_slice_bound_changed_from_python_keeps_eagers_numbers():
    # the bound is in the call mark by value: a new one is a new path, never a stale skip
    assert_same_as_eager(_alternating_bound, 24, max_traces=4, expect_fallbacks=(0, 3),
                         min_coexecuted=8)


def test_arguments_are_encoded_by_value_and_kind():
    x = tf.zeros((3, 4))
    n = tf.constant(1)
    tensors, leaves, ints = function_regions.encode((x, (Ellipsis, slice(2, n), None)), {})
    assert tensors == [x, n] and ints == (2,)
    assert leaves == (("tuple", ("t", ("tuple", (("...",), ("slice", "i", "t", None), None)))),
                      ())
    # an int and a bool of the same value are different arguments (True == 1 in Python)
    assert function_regions.encode((x, 1), {})[1] != function_regions.encode((x, True), {})[1]
    assert function_regions.encode((x, np.int64(1)), {})[1] != \
        function_regions.encode((x, 1), {})[1]
    # integers are values apart from the structure: ``labels[step]`` is one call mark
    assert function_regions.encode((x, 3), {})[1:] == (((("tuple", ("t", "i"))), ()), (3,))
    # an argument not checkable by value: no region
    assert function_regions.encode((x, np.array([0, 1])), {}) is None
    assert function_regions.encode((x, tf.Variable(1)), {}) is None


def _indexed_by_step(tape_cls, steps):
    """``labels[step]``: an integer argument that is new every step."""
    rng = np.random.default_rng(0)
    data = tf.constant(rng.normal(size=(steps, 4, 8)).astype(np.float32))
    labels = tf.constant(rng.normal(size=(steps, 4)).astype(np.float32))
    w = tf.Variable(tf.random.stateless_normal((8, 1), seed=(3, 4)))
    losses = []
    for step in range(steps):
        with tape_cls() as tape:
            pred = tf.squeeze(tf.matmul(data[step], w), -1)
            loss = tf.reduce_mean((pred - labels[step]) ** 2)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        losses.append(float(loss))
    return {"losses": losses, "w": w.numpy()}


def test_an_index_new_every_step_is_fed_not_a_new_path():
    assert_same_as_eager(_indexed_by_step, 16, max_traces=3, expect_fallbacks=(0, 1),
                         min_coexecuted=10)


def _bound_is_a_tensor(tape_cls, steps):
    """``x[:, :k]`` with ``k`` a tensor whose value changes, the input shapes alike: the
    slice's output shape follows a value, not a shape."""
    rng = np.random.default_rng(0)
    w = tf.Variable(tf.random.stateless_normal((6, 1), seed=(5, 6)))
    losses, widths = [], []
    for step in range(steps):
        x = tf.constant(rng.normal(size=(4, 6)).astype(np.float32))
        # the traces see 7 and 8, clipped alike to the 6 columns (the same shapes): the
        # value varies, the shapes do not, until it drops to 2 and 3
        k = tf.constant(7 + step % 2 if step < 10 else 2 + step % 2)
        with tape_cls() as tape:
            part = x[:, :k]
            widths.append(int(part.shape[1]))
            loss = tf.reduce_sum(tf.matmul(part, w[:k])) / tf.cast(part.shape[1], tf.float32)
        w.assign_sub(0.01 * tape.gradient(loss, w))
        losses.append(float(loss))
    return {"losses": losses, "widths": widths, "w": w.numpy()}


def test_a_slice_bound_given_as_a_tensor_keeps_eagers_shapes():
    # the bound's value is data to the region: what the slice returned is fetched, never a
    # stand-in of a shape learned for another value
    assert_same_as_eager(_bound_is_a_tensor, 18, max_traces=4, expect_fallbacks=(0, 3),
                         min_coexecuted=6)



def sequence_program(tape_cls, steps):
    """A language-model-style loss on rank-3 logits whose sequence length alternates: the
    sparse softmax cross entropy (reshaped to rank 2 and back inside TF's function) and the
    dense one, as Keras 3's losses call them."""
    rng = np.random.default_rng(1)
    w = tf.Variable(tf.random.stateless_normal((6, 5), seed=(3, 4)) * 0.3)
    losses = []
    for step in range(steps):
        length = 3 + step % 2
        x = tf.constant(rng.normal(size=(2, length, 6)).astype(np.float32))
        labels = tf.constant(rng.integers(0, 5, size=(2, length)).astype(np.int32))
        with tape_cls() as tape:
            logits = tf.einsum("btf,fc->btc", x, w)
            sparse = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels, logits=logits)
            dense = tf.nn.softmax_cross_entropy_with_logits(
                labels=tf.one_hot(labels, 5), logits=logits)
            loss = tf.reduce_mean(sparse) + 0.5 * tf.reduce_mean(dense)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        losses.append(float(loss))
        record_stats(f"step{step}")
    return {"losses": losses, "w": w.numpy()}


def test_softmax_cross_entropies_are_skipped_with_eagers_numbers():
    steps = 16
    outcome = assert_same_as_eager(sequence_program, steps, max_traces=3, min_coexecuted=8)
    late = outcome.stats.skipped_function_calls - \
        outcome.stats_at("step11").skipped_function_calls
    # both losses in each of the last four steps (both sequence lengths learned by then)
    assert late >= 2 * (steps - 12), outcome.report()
