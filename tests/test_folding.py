"""Static values (``terra.folding``): what Python reads of static shapes is handed out at once
in co-execution instead of being fetched from the graph, and stays eager's number."""

import inspect

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, mlp_task

from terra import folding


def _static_values(build):
    """``folding.static_value`` of each tensor ``build`` returns, inside a graph."""
    found = []

    @tf.function(autograph=False)
    def f(x):
        memo = {}
        found.extend(folding.static_value(t, memo) for t in build(x))
        return x

    f.get_concrete_function(tf.TensorSpec([4, 6, 3], tf.float32))
    return found


def test_shape_arithmetic_on_a_fully_defined_shape_is_folded():
    index, sliced, product, packed = _static_values(lambda x: (
        tf.shape(x)[1], tf.shape(x)[1:], tf.reduce_prod(tf.shape(x)),
        tf.stack([tf.shape(x)[0], 2 * tf.shape(x)[2]])))
    assert index == 6 and sliced.tolist() == [6, 3] and product == 72
    assert packed.tolist() == [4, 6]


def test_values_that_depend_on_data_or_round_are_not_folded():
    data, rounding = _static_values(lambda x: (
        tf.cast(tf.reduce_sum(x), tf.int32),  # reads the data
        tf.cast(tf.shape(x)[1], tf.float32) / 3.0))  # a float op: the graph's rounding
    assert data is None and rounding is None


def test_a_value_too_large_to_hold_is_not_folded():
    (big,) = _static_values(lambda x: (tf.range(folding.MAX_ELEMENTS + 1),))
    small = _static_values(lambda x: (tf.range(folding.MAX_ELEMENTS),))[0]
    assert big is None and np.array_equal(small, np.arange(folding.MAX_ELEMENTS))


def _noise_shape_loop(tape_cls, steps):
    """Dropout-like masking whose noise shape Python reads element by element from
    ``tf.shape`` (what Keras' dropout makes TF do), every step."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    gen = tf.random.Generator.from_seed(1)
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            h = model.layers[0](x)
            noise_shape = [int(d) for d in tf.shape(h)]  # read: shape
            h = h * tf.cast(gen.uniform(noise_shape) > 0.2, h.dtype)
            loss = loss_fn(y, model.layers[1](h))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(loss)
    return {"losses": losses, "variables": model.trainable_variables}


def test_a_shape_read_in_co_execution_waits_for_no_graph_and_keeps_eagers_numbers():
    outcome = assert_same_as_eager(_noise_shape_loop, steps=10, min_coexecuted=4)
    source, first = inspect.getsourcelines(_noise_shape_loop)
    (offset,) = [i for i, s in enumerate(source) if s.rstrip().endswith("# read: shape")]
    read_at = f"{inspect.getsourcefile(_noise_shape_loop)}:{first + offset} "
    waits = [row for row in outcome.explain.splitlines() if " waits, " in row]
    assert waits and not [row for row in waits if read_at in row], outcome.report()


SIZES = (16, 12, 8, 12, 16, 8, 4, 16, 12, 4, 8, 16)  # a batch size per step: shapes vary


def _varying_loop(tape_cls, steps):
    """The batch size changes every step (sizes no trace had among them), and Python reads
    values that depend on it: the batch size as an int, a ``tf.range`` over it, a noise
    shape for a stateless random mask; the gradient of every variable goes to Adam."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    losses, reads = [], []
    offset = 0
    for step in range(steps):
        n = SIZES[step % len(SIZES)]
        x, y = (a[offset:offset + n] for a in data)
        offset += n
        with tape_cls() as tape:
            h = model.layers[0](x)
            rows = tf.range(tf.shape(h)[0])  # read: range
            keep = tf.random.stateless_uniform(tf.shape(h), seed=(step, 7)) > 0.2
            h = h * tf.cast(keep, h.dtype)
            h = tf.gather(h, tf.reverse(rows, [0]))
            loss = loss_fn(tf.reverse(y, [0]), model.layers[1](h))
        reads.append(int(tf.shape(h)[0]) + int(tf.size(rows)))  # read: size
        grads = tape.gradient(loss, model.trainable_variables)  # read: gradient
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(loss)
    return {"losses": losses, "reads": reads, "variables": model.trainable_variables,
            "optimizer": optimizer.variables}


def _waits_at(outcome, program, marks):
    """The explain() rows of host syncs at the lines of ``program`` ending with ``marks``."""
    source, first = inspect.getsourcelines(program)
    lines = [f"{inspect.getsourcefile(program)}:{first + i} "
             for i, s in enumerate(source) if s.rstrip().endswith(marks)]
    assert len(lines) == len(marks)
    return [row for row in outcome.explain.splitlines() if " waits, " in row and
            any(line in row for line in lines)]


def test_values_that_follow_varying_shapes_are_computed_by_python_and_keep_eagers_numbers():
    """Python computes the shape reads itself (local steps), infers the random mask's shape
    from the noise shape it computed, and stands in for each variable's gradient with the
    variable's shape: no wait at those lines, in any iteration co-executed."""
    outcome = assert_same_as_eager(_varying_loop, steps=24, min_coexecuted=12)
    assert outcome.stats.fallbacks == 0, outcome.report()
    waits = _waits_at(outcome, _varying_loop, ("# read: range", "# read: size",
                                               "# read: gradient"))
    assert not waits, outcome.report()


def test_python_runs_shape_reads_and_integer_shape_arithmetic_itself_and_nothing_else():
    ops_found = {}

    @tf.function(autograph=False)
    def f(x, n):
        shape = tf.shape(x)
        for name, t in (("shape", shape), ("index", shape[1]), ("range", tf.range(n)),
                        ("float", x * 2.0), ("cast", tf.cast(shape, tf.float32)),
                        ("data", tf.cast(tf.reduce_sum(x), tf.int32))):
            ops_found[name] = t.op
        return x

    f.get_concrete_function(tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([], tf.int32))
    local = {name: folding.local_op(op) is not None for name, op in ops_found.items()}
    # the data read's last op is a Cast of a float sum: a float input, not Python's to run
    assert local == {"shape": True, "index": True, "range": True, "float": False,
                     "cast": False, "data": False}
    assert dict(zip(*[iter(folding.local_op(ops_found["shape"]))] * 2))["out_type"] == tf.int32
