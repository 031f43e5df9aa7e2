"""Terra+XLA: the graph's XLA functions are compiled before it co-executes
(``terra.precompile``), its writes wait for the commit point as without XLA, and its numbers
are eager's up to XLA's rounding."""

import numpy as np
import pytest
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tensorflow.python.eager import context
from tiny_models import batch, classification_data, mlp, sparse_xent, state

import terra
from terra import graph_ops, precompile, runtime, xla

STEPS, CHANGED_STEP = 12, 7  # warm-up 1 + 2-3 traces: CHANGED_STEP is co-executed
_compiled = []  # the Terra run's lifecycle.compiled, read by the test


@pytest.fixture
def xla_mode():
    terra.configure(xla=True)
    yield
    terra.configure(xla=False)


def mlp_adam_fed_program(tape_cls, steps, change_at=None):
    """An MLP with Adam on a new batch each step, the loss read once at the end: its
    segments (the forward and backward pass, every variable's update) are compiled. At step
    ``change_at`` the loss has an L2 term no trace had: a fallback inside the tape."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 32, 64, 10)
    model = mlp(64, (64, 64), 10)
    return _train(tape_cls, steps, model, tf.keras.optimizers.Adam(1e-3), data, 32, change_at)


def conv_program(tape_cls, steps):
    """Convolutions with Adam: their gradients' compiled functions take a
    ``Conv2DBackpropFilter``'s filter sizes as an argument, which XLA compiles for its value."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, None, 3, image=(8, 8, 2))
    model = tf.keras.Sequential([
        tf.keras.Input((8, 8, 2)),
        tf.keras.layers.Conv2D(4, 3, padding="same", activation="relu"),
        tf.keras.layers.Conv2D(4, 3, strides=2, activation="relu"),
        tf.keras.layers.GlobalAveragePooling2D(),
        tf.keras.layers.Dense(3),
    ])
    return _train(tape_cls, steps, model, tf.keras.optimizers.Adam(1e-2), data, 16)


def _train(tape_cls, steps, model, optimizer, data, size, change_at=None):
    """The training loop of both programs, the losses read once at the end; at step
    ``change_at`` the loss has an L2 term no trace had. Keeps the Terra run's compiled
    functions for the test (``_compiled``)."""
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        record_stats(f"step{step}")
        x, y = batch(data, step, size)
        with tape_cls() as tape:
            loss = loss_fn(y, model(x, training=True))
            if step == change_at:
                loss += 1e-2 * tf.add_n([tf.nn.l2_loss(w) for w in model.trainable_variables])
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        losses.append(loss)
    losses = [float(loss) for loss in losses]
    if tape_cls is not tf.GradientTape:
        _compiled[:] = runtime.current().lifecycle.compiled
        record_stats("end")
    return {"losses": losses, **state(model, optimizer)}


def fallback_program(tape_cls, steps):
    return mlp_adam_fed_program(tape_cls, steps, change_at=CHANGED_STEP)


def test_xla_functions_compile_before_the_first_coexecuted_iteration(xla_mode):
    """Every compiled function of the graph is compiled when the graph is generated, so no
    co-executed iteration compiles: all of them together spend less time in the graph than
    the compilation took (compiling at the first call, the first one alone spent about as
    long as that). The numbers are eager's at the benchmark's XLA tolerance."""
    outcome = assert_same_as_eager(mlp_adam_fed_program, STEPS, rtol=1e-3, atol=1e-6,
                                   min_coexecuted=STEPS - 4)
    [(compiled, functions, seconds)] = _compiled
    assert functions >= 2 and compiled == functions, (_compiled, outcome.report())
    end = outcome.stats_at("end")
    assert end.graph_exec < 0.5 * seconds, (end.graph_exec, _compiled, outcome.report())
    assert "graph compiled" in outcome.explain, outcome.report()
    # the updates wait for the commit point: no iteration reads the variables first
    assert end.snapshots == 0, outcome.report()


def test_a_convolution_programs_xla_functions_all_compile_before_use(xla_mode):
    """Convolutions, their gradients and Adam: every compiled function is compiled ahead
    (their integer arguments passed with the values the traced graph gives, not zeros)."""
    outcome = assert_same_as_eager(conv_program, STEPS, rtol=1e-3, atol=1e-6)
    [(compiled, functions, _)] = _compiled
    assert functions >= 2 and compiled == functions, (_compiled, outcome.report())


def test_a_piece_reading_a_value_of_unknown_shape_stays_tf_ops():
    """Two chains of marked ops in two segments: one reads a captured tensor of known shape
    and becomes a compiled function; the other reads a boolean mask's rows, whose shape the
    graph does not know (XLA would compile it again at every new row count): its ops stay
    TF ops, unmarked."""
    x = tf.constant(np.linspace(-1.0, 1.0, 12).reshape(4, 3), tf.float32)
    unary = ("abs", "tanh", "square", "sin", "cos", "sigmoid", "softplus", "exp", "negative")

    def body():
        graph = tf.compat.v1.get_default_graph()
        outs = []
        for scope, source in ((b"known", lambda: x), (b"varying", lambda: tf.boolean_mask(
                x, x > 0))):
            y = source()
            n_ops = len(graph.get_operations())
            for name in unary:
                y = getattr(tf.math, name)(y)
            graph_ops.mark_for_xla(graph.get_operations()[n_ops:], scope)
            outs.append(y)
        return outs

    function = tf.function(body, autograph=False).get_concrete_function()
    name, segments = xla.compile_segments(function, precompile.argument_spec(function))
    [(compiled, specs)] = segments
    assert [(list(a.shape), a.variable) for a in specs] == [([4, 3], False)], specs
    ctx = context.context()
    assert sorted(n.op for n in ctx.get_function_def(compiled).node_def).count("Tanh") == 1
    outside = [n for n in ctx.get_function_def(name).node_def if n.op == "Tanh"]
    assert len(outside) == 1 and "_XlaScope" not in outside[0].attr, outside


def test_constant_arguments_get_the_values_static_shapes_give():
    """XLA compiles for the value of some arguments (a ``Conv2DBackpropFilter``'s filter
    sizes): where a convolution gradient's ``ShapeN``, or a ``Tile`` gradient's ``Reshape``
    of a ``Transpose``, is outside the compiled function, ahead-of-use compilation passes
    the value the traced graph's static shapes give (``tensor_util.constant_value`` knows
    neither op)."""

    @tf.function
    def grads(x, w):
        with tf.GradientTape() as tape:
            tape.watch([x, w])
            y = tf.reduce_sum(tf.tile(tf.nn.conv2d(x, w, 1, "SAME"), [1, 2, 1, 1]))
        return tape.gradient(y, [x, w])

    graph = grads.get_concrete_function(tf.TensorSpec((2, 5, 5, 3)),
                                        tf.TensorSpec((3, 3, 3, 4))).graph
    shape_n = [op for op in graph.get_operations() if op.type == "ShapeN"]
    assert shape_n, [op.type for op in graph.get_operations()]
    assert [precompile._static_value(t).tolist() for t in shape_n[0].outputs] == \
        [[2, 5, 5, 3], [3, 3, 3, 4]]
    tile_grad = [op for op in graph.get_operations()
                 if op.type == "Reshape" and op.inputs[0].op.type == "Transpose"]
    assert tile_grad, [op.type for op in graph.get_operations()]
    assert precompile._static_value(tile_grad[0].outputs[0]).tolist() == \
        [1, 2, 2, 5, 1, 5, 1, 4]


def test_a_fallback_under_xla_restores_nothing_written_before_the_commit_point(xla_mode):
    """A new op in the tape of a co-executed step falls back: the compiled updates had not
    run (they wait for the commit point), the replay computes the step eagerly, and every
    number is eager's."""
    outcome = assert_same_as_eager(fallback_program, STEPS, rtol=1e-3, atol=1e-6,
                                   expect_fallbacks=(1, 2), max_traces=4)
    before, after = outcome.stats_at(f"step{CHANGED_STEP}"), outcome.stats_at("end")
    assert before.coexecuted >= 1 and after.fallbacks >= 1, outcome.report()
    assert after.snapshots == 0, outcome.report()
