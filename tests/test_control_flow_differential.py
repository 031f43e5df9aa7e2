"""Differential tests of training steps whose op path changes from step to step.

Each program is an ordinary eager loop whose Python picks different TF ops per step: a branch on
a counter, on a fetched loss, on ``random``, on an exception; loops driven by generators,
recursion, a Python schedule and an RNN's sequence length (its input shape varies too). Run
eagerly and under Terra, every loss, gradient and variable must agree, and after the paths
have been traced Terra must co-execute them: one graph holds every path seen, with a
``tf.switch_case`` where they part.

Paths merge back where their ops meet again (same op, attributes and executed location), so
the optimizer step after an if/else exists once, reading phi inputs; a Python loop is still
unrolled (one node per trip). A trace covers only once each node of its path has been seen
twice. The paper needed at most four traces for its programs; only a path that first appears
after co-execution began may cost a fallback.
"""

import inspect
import os
import random
import re

import numpy as np
import tensorflow as tf
from differential import assert_same_as_eager
from tiny_models import batch, classification_data, sparse_xent, state

import terra.config

STEPS = 16


class Net:
    """Dense layers the programs combine in different ways (a plain object, as users write)."""

    def __init__(self):
        self.inp = tf.keras.layers.Dense(32, activation="relu")
        self.shared = tf.keras.layers.Dense(32, activation="tanh")
        self.alt = tf.keras.layers.Dense(32, activation="relu")
        self.out = tf.keras.layers.Dense(10)
        self.layers = [self.inp, self.shared, self.alt, self.out]
        for layer, width in zip(self.layers, (20, 32, 32, 32), strict=True):
            layer.build((None, width))

    @property
    def trainable_variables(self):
        return [v for layer in self.layers for v in layer.trainable_variables]

    variables = trainable_variables


def train(tape_cls, steps, forward, seed=0, after=None):
    """The common loop: ``forward(net, x, step)`` builds the logits; everything else is fixed.
    ``after(step, loss)`` runs after the optimizer step (logging, reading values)."""
    tf.keras.utils.set_random_seed(seed)
    random.seed(seed)
    data = classification_data(steps * 16, 20, 10)
    net = Net()
    optimizer = tf.keras.optimizers.Adam(1e-2)
    optimizer.build(net.trainable_variables)  # some steps leave layers without gradients
    loss_fn = sparse_xent()
    losses, grads_per_step = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        with tape_cls() as tape:
            loss = loss_fn(y, forward(net, x, step))
        grads = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(
            (g, v) for g, v in zip(grads, net.trainable_variables, strict=True) if g is not None)
        losses.append(float(loss))
        grads_per_step.append([None if g is None else g.numpy() for g in grads])
        if after is not None:
            after(step, loss)
    return {"losses": losses, "grads": grads_per_step, **state(net, optimizer)}


def counter_branch(tape_cls, steps):
    def forward(net, x, step):
        h = net.inp(x)
        if step % 2:
            h = net.shared(h)
        else:
            h = net.alt(h) * 0.5
        return net.out(h)

    return train(tape_cls, steps, forward)


def test_if_else_on_a_python_counter():
    outcome = assert_same_as_eager(counter_branch, STEPS, max_traces=4, expect_fallbacks=(0, 0),
                                   min_coexecuted=8)
    assert re.search(r"\b[1-9]\d* switch-cases", outcome.explain), outcome.report()
    # the two paths merge back after the if/else: the output layer reads either branch's h
    assert re.search(r"MatMul\[[^]]*\]\(phi\(%\d+\|%\d+\), %\d+\)", outcome.explain), \
        outcome.report()


def small_tensor_read_in_both_branches(tape_cls, steps):
    """Both branches of a counter's if/else read one eager tensor of 100 values, the same
    tensor every step (too large to be a constant of the graph, small enough that TF captures
    it as one). TF makes that ``Const`` in the graph being built at the time: the first
    branch's. The second branch then read the first branch's constant and generation failed
    ("accessed from branch 1"), so the program never co-executed."""
    scale = tf.constant(np.linspace(0.5, 1.5, 100).reshape(20, 5), dtype=tf.float32)

    def forward(net, x, step):
        if step % 2:
            h = net.inp(x) * tf.reduce_mean(scale)
        else:
            h = net.inp(x) + tf.reduce_max(scale)
        return net.out(net.shared(h))

    return train(tape_cls, steps, forward)


def test_a_small_eager_tensor_read_in_two_branches():
    outcome = assert_same_as_eager(small_tensor_read_in_both_branches, STEPS, max_traces=4,
                                   expect_fallbacks=(0, 0), min_coexecuted=8)
    assert "generation failed" not in outcome.explain, outcome.report()


def loss_branch(tape_cls, steps):
    """A regularizer switched on whenever the last loss was high: the branch depends on a value
    fetched from the graph mid-iteration."""
    def forward(net, x, step):
        logits = net.out(net.shared(net.inp(x)))
        if float(tf.reduce_mean(tf.square(logits))) > 0.6:
            logits = logits * 0.9
        return logits

    return train(tape_cls, steps, forward)


def test_branch_on_a_materialized_value():
    assert_same_as_eager(loss_branch, STEPS, max_traces=4, expect_fallbacks=(0, 0),
                         min_coexecuted=6)


def sdpoint_like(tape_cls, steps):
    """Each step picks one of three down-sampling paths with Python's ``random``."""
    def forward(net, x, step):
        h = net.inp(x)
        kind = random.choice(["none", "avg", "max"])
        if kind != "none":
            pool = tf.nn.avg_pool1d if kind == "avg" else tf.nn.max_pool1d
            h = tf.reshape(pool(h[:, :, None], 2, 2, "VALID"), (-1, 16))
            h = tf.concat([h, h], axis=1)
        return net.out(net.shared(h))

    return train(tape_cls, steps, forward)


def test_random_choice_among_three_paths():
    # traced until each path was taken twice (terra.census), then no fallback
    assert_same_as_eager(sdpoint_like, 24, max_traces=10, expect_fallbacks=(0, 0),
                         min_coexecuted=10)


def try_except(tape_cls, steps):
    """The ops depend on whether a Python lookup raises."""
    table = {0: 0.5, 1: 2.0}

    def forward(net, x, step):
        h = net.inp(x)
        try:
            h = h * table[step % 3]
        except KeyError:
            h = net.alt(h)
        return net.out(h)

    return train(tape_cls, steps, forward)


def test_try_except_chooses_the_ops():
    assert_same_as_eager(try_except, STEPS, max_traces=6, expect_fallbacks=(0, 0),
                         min_coexecuted=6)


def generator_loop(tape_cls, steps):
    """A generator decides how often the shared layer runs (1 to 3 times)."""
    def repeats(step):
        yield from range(1 + step % 3)

    def forward(net, x, step):
        h = net.inp(x)
        for _ in repeats(step):
            h = net.shared(h)
        return net.out(h)

    return train(tape_cls, steps, forward)


def test_generator_driving_an_inner_loop():
    assert_same_as_eager(generator_loop, STEPS, max_traces=4, expect_fallbacks=(0, 0),
                         min_coexecuted=6)


def helper_two_sites(tape_cls, steps):
    """One helper, called from two places: its ops read different variables at each site."""
    def block(layer, h):
        return tf.nn.relu(layer(h)) + 0.1 * h

    def forward(net, x, step):
        h = block(net.shared, net.inp(x))
        if step % 2:
            h = block(net.alt, h)
        return net.out(h)

    return train(tape_cls, steps, forward)


def test_the_same_helper_called_from_two_sites():
    assert_same_as_eager(helper_two_sites, STEPS, max_traces=4, expect_fallbacks=(0, 0),
                         min_coexecuted=8)


def recursion(tape_cls, steps):
    """A recursive helper whose depth varies per step."""
    def deep(net, h, depth):
        if depth == 0:
            return h
        return deep(net, net.shared(h) + h, depth - 1)

    def forward(net, x, step):
        return net.out(deep(net, net.inp(x), (step * 7) % 3))

    return train(tape_cls, steps, forward)


def test_recursive_helper_of_varying_depth():
    assert_same_as_eager(recursion, STEPS, max_traces=7, expect_fallbacks=(0, 0),
                         min_coexecuted=6)


def late_path(tape_cls, steps):
    """A path first taken after many co-executed steps: falls back, then co-executed. Its
    first step reads a variable the graph never read: eager tapes only get that gradient if the
    fallback announces the read."""
    def forward(net, x, step):
        h = tf.squeeze(tf.expand_dims(net.inp(x), 1))  # an attr left unset (squeeze_dims)
        if step >= 12 and step % 2 == 0:
            h = net.alt(h)
        return net.out(h)

    return train(tape_cls, steps, forward)


def test_a_path_first_seen_late_falls_back_then_coexecutes():
    outcome = assert_same_as_eager(late_path, 20, max_traces=4, expect_fallbacks=(1, 1),
                                   min_coexecuted=12)
    assert outcome.stats.phase == "coexecution", outcome.report()
    # explain() names the fallback's reason category and the user's line of the first op of
    # the new path (the layer call), and shows the branch point as a switch-case
    where = source_line(late_path, "h = net.alt(h)")
    assert re.search(rf"fallback \[new producer\] at \S*{re.escape(where)}: ",
                     outcome.explain), outcome.report()
    assert re.search(r"\d+: \[tf.switch_case\] \{%\d+[^}]*\} via %\d+->%\d+ \| \{",
                     outcome.explain), outcome.report()
    # the replayed prefix matched the nodes it replays, the Squeeze with its unset attr too
    assert len(re.findall(r"^%\d+ = Squeeze", outcome.explain, re.M)) == 1, outcome.report()


def shared_layer_looped(trips):
    """A program whose forward pass applies the shared layer ``trips(step)`` times."""
    def program(tape_cls, steps):
        def forward(net, x, step):
            h = net.inp(x)
            for _ in range(trips(step)):
                h = net.shared(h) + h
            return net.out(h)

        return train(tape_cls, steps, forward)

    return program


# The shared layer runs 1 to 4 times, as many as a Python schedule says for this step: the
# same variables are read by a different number of ops each time.
shared_layer_repeated = shared_layer_looped(lambda step: [1, 3, 2, 4][step % 4])


def test_a_shared_layer_applied_a_varying_number_of_times():
    assert_same_as_eager(shared_layer_repeated, 24, max_traces=5, expect_fallbacks=(0, 0),
                         min_coexecuted=8)


def rnn(length):
    """A recurrent cell unrolled by a Python loop over the time axis, batch ``step`` of
    sequence length ``length(step)``: the trip count and the fed input's shape change."""
    def rnn_program(tape_cls, steps):
        tf.keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        cell, head = tf.keras.layers.SimpleRNNCell(16), tf.keras.layers.Dense(4)
        cell.build((None, 8))
        head.build((None, 16))
        variables = cell.trainable_variables + head.trainable_variables
        optimizer = tf.keras.optimizers.Adam(1e-2)
        loss_fn = sparse_xent()
        losses, grads_per_step = [], []
        for step in range(steps):
            x = tf.constant(rng.normal(size=(16, length(step), 8)).astype(np.float32))
            y = tf.constant(rng.integers(0, 4, 16).astype(np.int32))
            with tape_cls() as tape:
                h = tf.zeros((16, 16))
                for t in range(x.shape[1]):
                    h, _ = cell(x[:, t, :], [h])
                loss = loss_fn(y, head(h))
            grads = tape.gradient(loss, variables)
            optimizer.apply_gradients(zip(grads, variables, strict=True))
            losses.append(float(loss))
            grads_per_step.append([g.numpy() for g in grads])
        return {"losses": losses, "grads": grads_per_step, "vars": [v.numpy() for v in variables]}

    return rnn_program


rnn_varying_length = rnn(lambda step: 3 + (step * 5) % 3)  # 3, 5, 4, 3, 5, 4, ...

# The While sums a variable's gradient over the trips one trip at a time, eager's tape sums
# every trip's at once: the same numbers up to float rounding (about 2e-7 relative on the
# first steps in a While), which training then amplifies.
WHILE_TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}


def source_line(fn, text):
    """``file:line`` of the line of ``fn`` containing ``text``."""
    lines, first = inspect.getsourcelines(fn)
    [offset] = [i for i, line in enumerate(lines) if text in line]
    return f"{os.path.basename(inspect.getsourcefile(fn))}:{first + offset}"


def test_rnn_unrolled_by_python_with_varying_trip_count_and_input_shape():
    outcome = assert_same_as_eager(rnn_varying_length, 24, max_traces=4,
                                   expect_fallbacks=(0, 0), min_coexecuted=10)
    # explain() names the loop body's line and the trip counts the traces took
    where = re.escape(source_line(rnn_varying_length, "h, _ = cell("))
    assert re.search(rf"loop at \S*{where} \(rnn_program\): ran 3\|4\|5 times",
                     outcome.explain), outcome.report()
    # and rolls the trips after the third into one While, whose body starts at that line
    assert re.search(rf"loop node %\d+ at \S*{where} \(rnn_program\): 9 ops a trip, "
                     r"3 trips unrolled, then a tf.while_loop \(traced 3\|4\|5 trips\)",
                     outcome.explain), outcome.report()


# Lengths 3 and 4 while tracing, then 5 to 9: sequences longer than any trace had
rnn_longer_later = rnn(lambda step: 3 + step % 2 if step < 8 else 5 + step % 5)


def test_an_rnn_over_longer_sequences_than_any_trace_co_executes_in_the_while():
    outcome = assert_same_as_eager(rnn_longer_later, 20, max_traces=4, expect_fallbacks=(0, 0),
                                   min_coexecuted=14, **WHILE_TOLERANCE)
    assert "1 while loops" in outcome.explain, outcome.report()


def test_where_the_gradient_through_the_while_fails_the_loop_stays_unrolled(monkeypatch):
    """If TF's symbolic gradient through the While cannot be built, generation starts over with
    the loop unrolled: every trip count traced still co-executes."""
    def no_gradient(*args, **kwargs):
        raise LookupError("no gradient registered (simulated)")

    monkeypatch.setattr("terra.region_emission.gradients_impl.gradients", no_gradient)
    outcome = assert_same_as_eager(shared_layer_repeated, 24, max_traces=5,
                                   expect_fallbacks=(0, 0), min_coexecuted=8)
    assert "0 while loops" in outcome.explain, outcome.report()


# Three trips until step 10, two from then on: the recorded path goes on with a third trip
# where the iteration has left the loop.
shrinking_loop = shared_layer_looped(lambda step: 3 if step < 10 else 2)


def test_a_loop_with_fewer_trips_falls_back_as_a_new_loop_count_then_coexecutes():
    outcome = assert_same_as_eager(shrinking_loop, 16, max_traces=4, expect_fallbacks=(1, 1),
                                   min_coexecuted=8)
    assert outcome.stats.phase == "coexecution", outcome.report()
    assert re.search(r"fallback \[new loop count\] at \S*: a loop ran fewer trips",
                     outcome.explain), outcome.report()
    where = re.escape(source_line(shared_layer_looped, "h = net.shared(h) + h"))
    assert re.search(rf"loop at \S*{where} \(forward\): ran 2\|3 times", outcome.explain), \
        outcome.report()


# A loop one trip longer every other step: once two trip counts were traced, the loop is a
# While that runs any number of trips; every longer loop co-executes.
growing_loop = shared_layer_looped(lambda step: step // 2 + 1)


def test_a_loop_longer_than_any_trace_co_executes_in_a_while_loop():
    # 16 steps: up to 8 trips; 1 and 2 were traced
    outcome = assert_same_as_eager(growing_loop, 16, max_traces=4, expect_fallbacks=(0, 0),
                                   min_coexecuted=10, **WHILE_TOLERANCE)
    where = re.escape(source_line(shared_layer_looped, "h = net.shared(h) + h"))
    assert re.search(rf"loop node %\d+ at \S*{where} \(forward\): 6 ops a trip, 1 trips "
                     r"unrolled, then a tf.while_loop \(traced 1\|2 trips\)",
                     outcome.explain), outcome.report()


def until_the_norm_grows(tape_cls, steps):
    """A ``while`` loop whose condition reads a value computed in the loop's body: the shared
    layer runs until the activations' norm has grown by a factor (1.2 to 3, per step), at most
    8 times. Python fetches the norm in every trip and decides from it whether the While goes
    on."""
    def forward(net, x, step):
        h = net.inp(x)
        start = float(tf.norm(h))
        trips = 0
        while trips < 8 and float(tf.norm(h)) < (1.2 + 0.6 * (step % 4)) * start:
            h = net.shared(h) + h
            trips += 1
        return net.out(h)

    return train(tape_cls, steps, forward)


def test_a_while_loop_on_a_value_fetched_in_its_body():
    outcome = assert_same_as_eager(until_the_norm_grows, 24, max_traces=6,
                                   expect_fallbacks=(0, 2), min_coexecuted=12, **WHILE_TOLERANCE)
    assert "1 while loops" in outcome.explain, outcome.report()


def older_trip_from(step):
    """A loop of 2 to 5 trips, each adding the value of the previous trip; from ``step`` on,
    the fifth trip adds the value of two trips back instead. In the While that is the same
    body op's output of an earlier trip, a value no trace read: told apart, not computed
    from the carried value."""
    def program(tape_cls, steps):
        def forward(net, x, step_now):
            hs = [net.inp(x)]
            for _ in range(2 + step_now % 4):
                older = hs[-2] if step_now >= step and len(hs) > 4 else hs[-1]
                hs.append(net.shared(hs[-1]) + older)
            return net.out(hs[-1])

        return train(tape_cls, steps, forward)

    return program


def test_a_value_of_an_older_trip_is_told_from_the_carried_one():
    outcome = assert_same_as_eager(older_trip_from(12), 20, max_traces=10,
                                   expect_fallbacks=(1, 3), min_coexecuted=6, **WHILE_TOLERANCE)
    assert re.search(r"fallback \[new producer\] at \S*: input 1 of AddV2 %\d+ is a value of an "
                     "earlier trip of its loop", outcome.explain), outcome.report()


def alternating_layers_looped(trips):
    """Like :func:`shared_layer_looped`, but the trips alternate between two layers: they read
    different variables, so the loop cannot be one While and stays unrolled."""
    def program(tape_cls, steps):
        def forward(net, x, step):
            h = net.inp(x)
            for i in range(trips(step)):
                h = (net.shared if i % 2 == 0 else net.alt)(h) + h
            return net.out(h)

        return train(tape_cls, steps, forward)

    return program


# One trip longer every other step, and not a While: each new trip count arrives in
# co-execution, falls back, is traced once more, and the graph is regenerated; no iteration
# ever completes in a graph.
growing_alternating = alternating_layers_looped(lambda step: step // 2 + 1)


def test_falling_back_at_every_graph_gives_up_and_runs_eagerly():
    limit = terra.config.config.max_fallbacks_in_a_row
    # (the first layer is called with a NumPy batch: that call runs its Python, and the
    # census traces on until the paths look settled before the first graph)
    outcome = assert_same_as_eager(growing_alternating, 2 * limit + 10,
                                   max_traces=2 * limit + 10, expect_fallbacks=(limit, limit),
                                   min_coexecuted=0)
    assert outcome.stats.phase == "eager", outcome.report()
    assert f"{limit} fallbacks in a row" in outcome.explain, outcome.report()
    # each fallback is told apart from other new paths: the loop ran one trip more
    assert outcome.explain.count("fallback [new loop count]") == limit, outcome.report()


def three_choices(tape_cls, steps, plan, pick_variables=False, stop=None):
    """Three branch points per step, with common ops between them where the paths merge back
    (``plan``: per step, the side each point takes, e.g. "aba"); the gradient call after them
    meets a new forward path for each combination. ``pick_variables``: the first two points'
    sides read their own variable (a path may leave ``b`` unused: eager's gradient for it is
    None; the common ops read ``a``); else both sides read the same one. ``stop`` (a function
    no gradient flows through): the second point's "b" side reads ``b`` through it, its "a"
    side reads ``b``."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, 8, 4)
    a = tf.Variable(tf.random.normal((8, 8), seed=1) * 0.3, name="a")
    b = tf.Variable(tf.random.normal((8, 8), seed=2) * 0.3, name="b")
    head = tf.Variable(tf.random.normal((8, 4), seed=3) * 0.3, name="head")
    variables = [a, b, head]
    optimizer = tf.keras.optimizers.Adam(1e-2)
    optimizer.build(variables)
    loss_fn = sparse_xent()
    losses, grads_per_step = [], []
    for step in range(steps):
        x, y = batch(data, step, 16)
        first, second, third = plan[step]
        with tape_cls() as tape:
            if first == "a":
                h = tf.nn.relu(x @ a)
            else:
                h = tf.tanh(x @ (b if pick_variables else a))
            h = (h @ a if pick_variables else h) + 0.1
            if second == "a":
                h = tf.nn.sigmoid(h @ (a if pick_variables and stop is None else b))
            elif stop is not None:
                h = stop(h @ b) * h
            else:
                h = h @ b * 0.5
            h = h + 0.2
            if third == "a":
                h = h * 1.5
            else:
                h = tf.nn.softplus(h)
            loss = loss_fn(y, h @ head)
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients((g, v) for g, v in zip(grads, variables, strict=True)
                                  if g is not None)
        losses.append(float(loss))
        grads_per_step.append([None if g is None else g.numpy() for g in grads])
    return {"losses": losses, "grads": grads_per_step, "variables": variables,
            "optimizer": list(optimizer.variables)}


FOLDED = "one gradient region for every forward path"


def test_a_gradient_call_that_keeps_meeting_new_forward_paths_gets_one_region():
    """Traces see "aaa" and "bbb" (a gradient region recorded for each forward pass); then
    every step is a combination no trace took. The first falls back at the gradient call and
    is traced, and so is the next; after two such paths (``Config.fold_after``) the call's
    regions are one in the next graph (TF's gradient through the switch-cases,
    ``terra.regions``), and the other combinations co-execute without a fallback (before:
    one fallback, trace and graph per new combination)."""
    plan = ["aaa", "bbb"] * 4 + ["aba", "bab", "abb", "baa", "aab", "bba", "abb", "aab",
                                 "bab", "baa", "aba", "bba"]
    outcome = assert_same_as_eager(lambda t, s: three_choices(t, s, plan), len(plan),
                                   max_traces=7, expect_fallbacks=(1, 1), min_coexecuted=12)
    assert FOLDED in outcome.explain, outcome.report()


def test_a_path_that_leaves_a_variable_unused_gets_eagers_none():
    """Each side reads its own variable. Once the regions are one (two new paths after the
    first graph), "aaa" leaves ``b`` unused: eager's gradient for it is None (Adam leaves
    ``b`` and its slots alone), where TF's gradient through the switch-cases gives zeros
    (Adam would move it). The PythonRunner sees ``b`` is not reached this iteration and
    falls back. The same on "aba" where the
    second point reads ``b`` only through ``tf.stop_gradient`` (recording paused) or
    ``tf.round`` (its gradient is None)."""
    def check(plan, **kwargs):
        outcome = assert_same_as_eager(lambda t, s: three_choices(t, s, plan, **kwargs),
                                       len(plan), max_traces=10, expect_fallbacks=(2, None),
                                       min_coexecuted=5)
        assert FOLDED in outcome.explain and "does not reach a source" in outcome.explain, \
            outcome.report()

    check(["aba", "bab"] * 4 + ["abb", "baa", "aba", "bab", "aaa", "abb", "bab", "baa"],
          pick_variables=True)
    for stop in (tf.stop_gradient, tf.round):
        check(["aaa", "bbb"] * 4 + ["bba", "aab", "aaa", "bbb", "aba", "bba", "aab", "bbb"],
              pick_variables=True, stop=stop)


def fixed_tensor_on_both_sides(tape_cls, steps, plan):
    """Two branch points whose every side reads one fixed eager tensor (100 values: a
    captured tensor). Which op reads it first depends on the path; the later readers read
    "the value its first reader read", so on "ab" after "aa" and "bb" (the second point's "b"
    side had read it second, after the first point's "b" side, which did not run) the
    iteration fell back at a forward op ("a different tensor")."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, 8, 4)
    scale = tf.constant(np.linspace(0.5, 1.5, 100).reshape(10, 10), dtype=tf.float32)
    w = tf.Variable(tf.random.normal((8, 8), seed=1) * 0.3)
    head = tf.Variable(tf.random.normal((8, 4), seed=3) * 0.3)
    optimizer = tf.keras.optimizers.SGD(0.1)
    loss_fn = sparse_xent()
    losses = []
    for step in range(steps):
        x, y = batch(data, step, 16)
        first, second = plan[step]
        with tape_cls() as tape:
            h = x @ w
            if first == "a":
                h = tf.nn.relu(h) * tf.reduce_mean(scale)
            else:
                h = tf.tanh(h) + tf.reduce_max(scale)
            h = h * 0.5
            if second == "a":
                h = tf.nn.sigmoid(h) * tf.reduce_min(scale)
            else:
                h = h - tf.reduce_sum(scale) * 0.01
            loss = loss_fn(y, h @ head)
        grads = tape.gradient(loss, [w, head])
        optimizer.apply_gradients(zip(grads, [w, head]))
        losses.append(float(loss))
    return {"losses": losses, "variables": [w, head]}


def test_a_fixed_tensor_read_first_on_another_path_is_the_same_capture():
    plan = ["aa", "bb"] * 4 + ["ab", "ba", "ab", "ba", "aa", "bb", "ab", "ba"]
    outcome = assert_same_as_eager(lambda t, s: fixed_tensor_on_both_sides(t, s, plan),
                                   len(plan), max_traces=7, expect_fallbacks=(0, 1),
                                   min_coexecuted=8)
    assert "a different tensor" not in outcome.explain, outcome.report()


def branch_and_batch_sizes(tape_cls, steps):
    """A branch on the step's parity and a batch size cycling through three: a region per
    branch, each recorded for the batch sizes its traces had (its backward values, a mean's
    count, depend on them), and a new (branch, size) pair fell back, six pairs in all."""
    tf.keras.utils.set_random_seed(0)
    data = classification_data(steps * 16, 8, 4)
    w = tf.Variable(tf.random.normal((8, 8), seed=1) * 0.3)
    head = tf.Variable(tf.random.normal((8, 4), seed=3) * 0.3)
    optimizer = tf.keras.optimizers.SGD(0.1)
    losses = []
    for step in range(steps):
        size = (16, 12, 8)[step % 3]
        x, y = (a[:size] for a in batch(data, step, 16))
        with tape_cls() as tape:
            h = x @ w
            h = tf.nn.relu(h) if step % 2 else tf.tanh(h) * 0.5
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, h @ head))
        grads = tape.gradient(loss, [w, head])
        optimizer.apply_gradients(zip(grads, [w, head]))
        losses.append(float(loss))
    return {"losses": losses, "variables": [w, head]}


def test_a_gradient_call_missing_shapes_on_branching_paths_folds():
    outcome = assert_same_as_eager(branch_and_batch_sizes, 20, max_traces=8,
                                   expect_fallbacks=(1, 2), min_coexecuted=10)
    assert FOLDED in outcome.explain, outcome.report()
