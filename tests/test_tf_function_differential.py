"""``tf.function`` helpers called inside the tape (``terra.functions``): the graph calls the
traced forward and backward functions, the user's call in co-execution arrives as the
function's inference twin, and a fallback after such a call puts its gradient back on the
tapes. Every test compares with eager bit for bit."""

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager, record_stats
from tiny_models import batch, classification_data, sparse_xent

import terra

STEPS = 12


def _program(detour_at=None, random_inside=False, persistent=False, skip_at=None,
             stopped_target=False):
    """A two-layer classifier whose hidden layer is a ``tf.function`` of raw variables (a
    hard-swish: Grappler rewrites its ``/ 6`` inside the function); at ``detour_at`` the loss
    takes one more op after the call (a new path, so a fallback after it); at ``skip_at`` the
    input is not centred, so the call itself is where the path is new. ``stopped_target``:
    the loss adds a term computed by the same function under ``tape.stop_recording()``."""

    def program(tape_cls, steps):
        tf.keras.utils.set_random_seed(0)
        data = classification_data(steps * 16, 12, 4)
        rng = np.random.default_rng(0)
        w1 = tf.Variable(rng.normal(size=(12, 16)).astype(np.float32) * 0.3)
        b1 = tf.Variable(np.zeros(16, np.float32))
        head = tf.Variable(rng.normal(size=(16, 4)).astype(np.float32) * 0.3)

        @tf.function
        def hidden(x):
            h = tf.matmul(x, w1) + b1
            if random_inside:
                h += tf.random.normal(tf.shape(h), stddev=0.01)
            return h * tf.nn.relu6(h + 3.0) / 6.0

        variables = [w1, b1, head]
        optimizer = tf.keras.optimizers.Adam(1e-2)
        loss_fn = sparse_xent()
        losses = []
        for step in range(steps):
            record_stats(f"step{step}")
            x, y = batch(data, step, 16)
            with tape_cls(persistent=persistent) as tape:
                centred = x if step == skip_at else x - tf.reduce_mean(x, axis=0)
                logits = tf.matmul(hidden(centred), head)
                del centred  # a tensor of the iteration left alive after the loop escapes
                if stopped_target:
                    with tape.stop_recording():
                        target = hidden(x * 0.5)
                    logits = logits + 0.1 * tf.reduce_mean(target)
                if step == detour_at:
                    logits = logits * 1.0
                loss = loss_fn(y, logits)
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables))
            losses.append(float(loss))
        return {"losses": losses, "variables": [v.numpy() for v in variables],
                "slots": [v.numpy() for v in optimizer.variables]}

    return program


EXACT = ("losses", "variables", "slots")


def test_a_tf_function_helper_coexecutes_with_eagers_numbers():
    outcome = assert_same_as_eager(_program(), STEPS, exact=EXACT)
    assert outcome.stats.coexecuted >= STEPS - 4, outcome.report()
    assert "__forward_hidden" in outcome.explain, outcome.report()


def test_a_persistent_tape_calls_the_higher_order_functions():
    outcome = assert_same_as_eager(_program(persistent=True), STEPS, exact=EXACT)
    assert outcome.stats.coexecuted >= STEPS - 4, outcome.report()


def test_a_fallback_after_the_call_puts_its_gradient_back_on_the_tape():
    """The call was co-executed (as its inference twin) before the path changed: the replay
    runs the forward call again and records its backward function as TF does."""
    detour = 8
    outcome = assert_same_as_eager(_program(detour_at=detour), STEPS, exact=EXACT,
                                   expect_fallbacks=1, max_traces=4)
    assert outcome.stats_at(f"step{detour}").coexecuted >= 1, outcome.report()


def test_a_fallback_at_the_call_runs_it_as_its_forward_function():
    """The call is the first op of a new path: the fallback comes at the inference call TF
    chose in co-execution (no real tape recorded), which then runs eagerly under the user's
    tape; run as issued, the tape would get no gradient for it (found by the fuzzer, seed 4)."""
    skip = 8
    outcome = assert_same_as_eager(_program(skip_at=skip), STEPS, exact=EXACT,
                                   expect_fallbacks=1, max_traces=4)
    assert outcome.stats_at(f"step{skip}").coexecuted >= 1, outcome.report()
    assert "got __inference_hidden" in outcome.explain, outcome.report()


def test_a_call_under_stop_recording_stays_an_inference_call():
    """``tape.stop_recording()`` takes the tape off the tape set (each time a fallback, as
    the method is served eagerly): the call made there is an inference call in eager too,
    and nothing puts its gradient on the tape."""
    outcome = assert_same_as_eager(_program(stopped_target=True), STEPS, exact=EXACT,
                                   expect_fallbacks=(0, None), max_traces=STEPS,
                                   min_coexecuted=0)
    assert "stop_recording" in outcome.explain, outcome.report()


def test_a_function_drawing_stateful_random_numbers_stays_in_python():
    outcome = assert_same_as_eager(_program(random_inside=True), STEPS, exact=EXACT,
                                   min_coexecuted=0, max_traces=STEPS)
    assert outcome.stats.coexecuted == 0, outcome.report()


def test_the_graph_calls_a_copy_that_is_not_inlined():
    """Inlined into the exact graph the body would lose the rewrites Grappler made to the
    function eager called; the call keeps them."""
    terra.reset()
    try:
        _program()(terra.TerraGradientTape, 8)
        from terra import runtime

        ops = runtime.get().graph.function.graph.get_operations()
        calls = [op for op in ops if op.type == "StatefulPartitionedCall"]
        names = {op.get_attr("f").name for op in calls}
        assert any(n.startswith("__forward_hidden") for n in names), names
        assert any("backward_hidden" in n for n in names), names
        from tensorflow.python.eager import context

        for n in names:
            assert context.context().get_function_def(n).attr["_noinline"].b, n
    finally:
        terra.reset()


def keras_model_in_a_tf_function(tape_cls, steps):
    """A Keras 3 model with BatchNorm and Dropout called through ``tf.function``: the forward
    call updates the moving statistics and the dropout seed inside the function."""
    tf.keras.utils.set_random_seed(0)
    model = tf.keras.Sequential([
        tf.keras.Input((12,)), tf.keras.layers.Dense(16), tf.keras.layers.BatchNormalization(),
        tf.keras.layers.Dropout(0.3), tf.keras.layers.Dense(4)])
    forward = tf.function(lambda x: model(x, training=True))
    optimizer = tf.keras.optimizers.Adam(1e-2)
    data = classification_data(steps * 16, 12, 4)
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, forward(x))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        losses.append(float(loss))
    return {"losses": losses, "variables": [v.numpy() for v in model.variables],
            "slots": [v.numpy() for v in optimizer.variables]}


def test_a_keras_model_with_batchnorm_called_through_tf_function():
    outcome = assert_same_as_eager(keras_model_in_a_tf_function, STEPS, exact=EXACT)
    assert outcome.stats.coexecuted >= STEPS - 4, outcome.report()


def test_a_graphs_cost_counts_the_bodies_of_the_tf_functions_it_calls():
    """TF instantiates a called function's body at the generated graph's first call that
    reaches it: the first graph's estimated cost counts those nodes, once per function."""
    from terra import functions

    @tf.function
    def f(x):
        return tf.sin(x) * 2.0 + tf.cos(x)

    x = tf.constant(1.0)
    f(x)
    name = f.get_concrete_function(x).name.decode()
    body = functions.called([name])
    assert body >= 4, body  # sin, mul, cos, add (and the arguments)
    assert functions.called(["MatMul", name, name, "AddV2"]) == body
    assert functions.called(["MatMul"]) == 0
