"""The PythonRunner alone, on plans generated from hand-written traces: no Runtime, no doors.

Each test builds a tiny TraceGraph (``y = Neg(x)``, ``z = <op>(y)``, ``Exp(z)`` read by
Python, as in ``test_graph_builder.trace``), generates its SymbolicGraph and issues the
iteration's ops to the runner's fast and slow entry points the way the doors do: with the
op's inputs, then its attrs. It checks the stand-ins handed out, the Divergence kind of each
mismatch, the values fetched against eager's, the path's end and the sweep; and
``fallback.replay`` of a prefix the runner matched.
"""

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context
from test_graph_builder import trace
from test_tracegraph import F32, HERE, at, ext, op, op_at

from terra import fallback
from terra.divergence import Divergence, GraphFailed, OffPath, PathEnded
from terra.graph_builder import generate
from terra.graph_runner import GraphRunner, Job, Watchdog
from terra.location import Sites
from terra.nodes import ExtRef, NodeKind, OpRef, SameRef
from terra.python_runner import Iteration, PythonRunner
from terra.trace import OpRecord, Recorder
from terra.tracegraph import TraceGraph

CTX = context.context()
INT32 = tf.int32.as_datatype_enum


def real_numpy(t):
    """TF's own ``_numpy`` (the hook table of a Runtime may have patched the method)."""
    return t._numpy_internal()


@pytest.fixture(scope="module")
def threads():
    """The GraphRunner and Watchdog threads the runner's waits use; a failed job ends the
    wait in progress, as the runtime does."""
    runners = []
    graph_runner = GraphRunner(lambda job: runners[-1].waiting.graph_failed())
    watchdog = Watchdog()
    yield graph_runner, watchdog, runners
    graph_runner.stop()
    watchdog.stop()


class Harness:
    """A runner over the graph generated from ``traces``, with its own hook table. Fallbacks
    met while materializing a stand-in are noted and handled as ``Runtime.leave`` does:
    cancel the job, restore, replay the matched prefix eagerly."""

    def __init__(self, threads, *traces):
        graph_runner, watchdog, runners = threads
        self.tracegraph = TraceGraph()
        for t in traces:
            self.tracegraph.merge(t)
        self.graph = generate(self.tracegraph)
        self.graph_runner = graph_runner
        self.tensors = {}
        self.fallbacks = []
        self.runner = PythonRunner(self.graph, self.tensors, real_numpy, watchdog, 30.0,
                                   self.leave, graph_runner.submit, Sites())
        runners.append(self.runner)

    def begin(self):
        it = Iteration(Job(self.graph))
        self.runner.begin(it)
        return it

    def leave(self, why):
        self.fallbacks.append(why)
        it = self.runner.it
        self.graph_runner.cancel(it.job)
        fallback.restore(it.job, 30.0)
        self.runner.it = None
        self.recorder = Recorder({}, real_numpy, Sites())
        fallback.replay(it.log, self.recorder, [], it.customs)

    def entry(self, t):
        return self.tensors[t._id]

    def fast(self, op_type, *inputs):
        return self.runner.fast(CTX, op_type, None, inputs)


def x_of(value, rows=4, dtype=np.float32):
    return tf.constant(np.full((rows, 3), value, dtype))


@pytest.fixture
def straight(threads):
    """``Exp(Abs(Neg(x)))`` with ``x`` fed (its value changed between the traces)."""
    return Harness(threads, trace(5, "Abs", value=1.0), trace(5, "Abs", value=2.0))


def test_the_runner_hands_out_stand_ins_and_fetches_the_eager_value(straight):
    h = straight
    it = h.begin()
    x = tf.constant(np.arange(12, dtype=np.float32).reshape(4, 3) - 5.0)
    y = h.fast("Neg", x)
    # a stand-in: the recorded shape and dtype, a dummy's zeros, named by its entry
    assert (y.shape, y.dtype) == ((4, 3), tf.float32)
    assert not real_numpy(y).any()
    e = h.entry(y)
    assert (e.node.op_type, e.out, e.iteration, e.value) == ("Neg", 0, it, None)
    assert not h.runner.at_end()
    z = h.runner.slow("Abs", 1, [y], ("T", F32), CTX)[0]  # the slow door: attrs given
    assert h.entry(z).node.op_type == "Abs" and not h.runner.at_end()
    w = h.fast("Exp", z)
    # the path's last step: the runner waited for the graph to finish the iteration
    assert h.runner.at_end() and it.job.done.is_set() and it.job.error is None
    want = np.exp(np.abs(-x.numpy()))
    np.testing.assert_allclose(real_numpy(h.runner.value_of(h.entry(w))), want, rtol=1e-6)
    np.testing.assert_allclose(h.entry(w).numpy(w), want, rtol=1e-6)  # materialized
    assert [type(logged).__name__ for logged in it.log] == ["LoggedOp"] * 3
    assert h.fallbacks == []


def test_the_sweep_keeps_what_python_holds_and_releases_the_iteration(straight):
    h = straight
    it = h.begin()
    y = h.fast("Neg", x_of(2.0))
    w = h.fast("Exp", h.fast("Abs", y))
    y_id, kept = y._id, h.entry(w)
    del y
    assert h.runner.finish() == []  # w's value was fetched; y was dropped
    assert y_id not in h.tensors and h.tensors[w._id] is kept
    assert it.log is None  # released: nothing is left to replay
    np.testing.assert_allclose(real_numpy(kept.value), np.exp(np.full((4, 3), 2.0)),
                               rtol=1e-6)


def test_a_stand_in_held_without_a_fetch_point_is_uncovered(straight):
    h = straight
    h.begin()
    y = h.fast("Neg", x_of(2.0))
    h.fast("Exp", h.fast("Abs", y))
    assert h.runner.finish() == [h.entry(y)]  # the graph returns no value for it


def test_each_iteration_reads_its_own_values(straight):
    h = straight
    for value in (1.5, -0.5, 3.0):
        h.begin()
        w = h.fast("Exp", h.fast("Abs", h.fast("Neg", x_of(value))))
        got = real_numpy(h.runner.value_of(h.entry(w)))
        np.testing.assert_allclose(got, np.exp(np.full((4, 3), abs(value))), rtol=1e-6)
        del w
        assert h.runner.finish() == []


@pytest.mark.parametrize("case, kind, category, message", [
    ("another op", OffPath, "new op", "expected Neg, got Abs"),
    ("an external input where a node was", Divergence, "new producer", "new producer"),
    ("a new shape", Divergence, "shape change", "changed shape"),
    ("a new dtype", Divergence, "shape change", "changed dtype"),
    ("an op past the end", PathEnded, "new op", "after the end"),
    ("a value without a fetch point", Divergence, "new fetch point", "new fetch point"),
])
def test_a_mismatch_raises_its_divergence(straight, case, kind, category, message):
    h = straight
    h.begin()
    x = x_of(1.0)
    with pytest.raises(Divergence) as raised:
        if case == "another op":
            h.fast("Abs", x)
        elif case == "an external input where a node was":
            h.fast("Neg", x)
            h.fast("Abs", x)
        elif case == "a new shape":
            h.fast("Neg", x_of(1.0, rows=5))
        elif case == "a new dtype":
            h.fast("Neg", x_of(1.0, dtype=np.float64))
        elif case == "an op past the end":
            h.fast("Exp", h.fast("Abs", h.fast("Neg", x)))
            h.fast("Neg", x)
        else:
            y = h.fast("Neg", x)
            h.runner.value_of(h.entry(y))
    assert type(raised.value) is kind
    assert raised.value.category == category and message in raised.value.reason, \
        raised.value.reason


def test_a_constant_input_takes_its_value_as_a_tensor_or_a_python_value(threads):
    h = Harness(threads, trace(5, "Abs", value=2.0), trace(5, "Abs", value=2.0))
    assert [s.slots[0].kind for s in h.graph.steps.values() if s.op_type == "Neg"] == \
        ["const"]
    for x in (x_of(2.0), [[2.0] * 3] * 4, [[2] * 3] * 4):  # converted as TF would
        h.begin()
        w = h.fast("Exp", h.fast("Abs", h.fast("Neg", x)))
        np.testing.assert_allclose(real_numpy(h.runner.value_of(h.entry(w))),
                                   np.exp(np.full((4, 3), 2.0)), rtol=1e-6)
        del w
        h.runner.finish()
    for x in (x_of(3.0), [[2.5] * 3] * 4):
        h.begin()
        with pytest.raises(Divergence) as raised:
            h.fast("Neg", x)
        assert raised.value.category == "value change", raised.value.reason


@pytest.fixture
def branching(threads):
    """``Exp(Abs(Neg(x)))`` or ``Exp(Square(Neg(x)))``: one switch-case after ``Neg``."""
    return Harness(threads, trace(5, "Abs", value=1.0), trace(7, "Square", value=2.0),
                   trace(5, "Abs", value=3.0), trace(7, "Square", value=4.0))


@pytest.mark.parametrize("middle, eager", [("Square", np.square), ("Abs", np.abs)])
def test_a_branch_point_takes_the_successor_the_op_is(branching, middle, eager):
    h = branching
    for value in (1.5, -2.0):  # either path, twice: the graph's Case follows the runner
        h.begin()
        y = h.fast("Neg", x_of(value))
        assert not h.runner.at_end()
        w = h.fast("Exp", h.fast(middle, y))
        assert h.entry(w).node.op_type == "Exp" and h.runner.at_end()
        got = real_numpy(h.runner.value_of(h.entry(w)))
        np.testing.assert_allclose(got, np.exp(eager(np.full((4, 3), -value))), rtol=1e-6)
        del y, w
        assert h.runner.finish() == []


def test_an_op_no_trace_had_at_a_branch_point_is_a_new_branch(branching):
    h = branching
    h.begin()
    y = h.fast("Neg", x_of(1.0))
    with pytest.raises(Divergence) as raised:
        h.fast("Log", y)
    assert type(raised.value) is OffPath and raised.value.category == "new op"
    assert raised.value.reason.startswith("new branch: Log where the recorded iterations "
                                          "had Abs, Square"), raised.value.reason


def python_neg_trace(value):
    """``Neg`` run in Python (as a random op would be): the graph is fed its output."""
    x = ext(np.full((4, 3), value))
    neg = op("Neg", x, in_graph=False)
    neg.location, neg.site = at(1)
    recs = [neg, op_at(at(5), "Abs", OpRef(0, 0)), op_at(at(9), "Exp", OpRef(1, 0))]
    recs[-1].fetched.add(0)
    return recs


def test_an_op_run_in_python_returns_its_real_value_and_feeds_it(threads):
    h = Harness(threads, python_neg_trace(1.0), python_neg_trace(2.0))
    it = h.begin()
    y = h.fast("Neg", x_of(3.0))
    np.testing.assert_array_equal(real_numpy(y), np.full((4, 3), -3.0))  # ran for real
    assert h.entry(y).value is y
    w = h.fast("Exp", h.fast("Abs", y))
    np.testing.assert_allclose(real_numpy(h.runner.value_of(h.entry(w))),
                               np.exp(np.full((4, 3), 3.0)), rtol=1e-6)
    assert [type(logged).__name__ for logged in it.log] == \
        ["LoggedPythonOp", "LoggedOp", "LoggedOp"]


def test_an_iteration_ends_before_steps_without_effects_and_drops_their_values(straight):
    """An op off the path where the graph has only side-effect-free work left (``Abs``, then
    ``Exp`` fetched for Python): the iteration may end there. The graph's ``Exp`` value,
    computed ahead, is taken unread, so the next iteration reads its own."""
    h = straight
    h.begin()
    y = h.fast("Neg", x_of(1.0))
    rest = h.runner.rest_without_effects()
    assert [(step.op_type, i) for step, i in rest] == [("Neg", 0), ("Abs", 0), ("Exp", 0)]
    with pytest.raises(OffPath) as raised:
        h.fast("Log", y)
    assert h.runner.may_end_before(raised.value)
    h.runner.end_path()
    del y, raised  # the traceback holds the op's inputs
    assert h.runner.finish() == [] and h.fallbacks == []
    h.begin()
    w = h.fast("Exp", h.fast("Abs", h.fast("Neg", x_of(3.0))))
    np.testing.assert_allclose(real_numpy(h.runner.value_of(h.entry(w))),
                               np.exp(np.full((4, 3), 3.0)), rtol=1e-6)


def test_an_iteration_does_not_end_before_a_step_the_graph_feeds_from_python(threads):
    # Neg runs in Python and the graph reads its output: the graph waits for it
    h = Harness(threads, python_neg_trace(1.0), python_neg_trace(2.0))
    h.begin()
    assert h.runner.rest_without_effects() is None
    assert h.runner.may_end_before(OffPath("expected Neg, got Log")) is False


def test_materializing_a_value_the_graph_does_not_return_replays_the_prefix(straight):
    """``Entry.numpy`` at a new fetch point: the runner hands the divergence to its fallback,
    whose ``fallback.replay`` runs the matched ops eagerly; Python gets the replayed value,
    and every stand-in of the prefix has its eager value."""
    h = straight
    h.begin()
    x = x_of(-1.5)
    y = h.fast("Neg", x)
    z = h.fast("Abs", y)
    got = h.entry(y).numpy(y)
    assert [why.category for why in h.fallbacks] == ["new fetch point"]
    np.testing.assert_array_equal(got, np.full((4, 3), 1.5))
    np.testing.assert_array_equal(real_numpy(h.entry(z).value), np.full((4, 3), 1.5))


def test_a_graph_error_is_raised_at_the_paths_end_with_the_stand_in(threads):
    """An integer division by zero fails the graph: the runner learns of it when it waits at
    the path's end, after the op is in the log (the replay runs it, so Python gets its
    stand-in rather than running it again). The values are larger than the shape-sized ones
    Python computes itself (``folding.MAX_LOCAL``)."""
    def division(divisor):
        x = ExtRef(tf.constant(np.full((40, 30), 7, np.int32)))
        d = ExtRef(tf.constant(np.full((40, 30), divisor, np.int32)))
        div = OpRecord(NodeKind.OP, "FloorDiv", (), [x, d], (((40, 30), INT32),), HERE, True)
        div.fetched.add(0)  # read by Python: the graph computes it
        return [div]

    h = Harness(threads, division(2), division(3))
    it = h.begin()
    seven = tf.constant(np.full((40, 30), 7, np.int32))
    with pytest.raises(GraphFailed) as raised:
        h.fast("FloorDiv", seven, tf.constant(np.zeros((40, 30), np.int32)))
    failed = raised.value
    assert failed.at_end and failed.ran and failed.job is it.job
    assert isinstance(failed.job.error, tf.errors.InvalidArgumentError)
    assert h.entry(failed.result).node.op_type == "FloorDiv"
    with pytest.raises(tf.errors.InvalidArgumentError, match="raised by the op issued at"):
        fallback.replay(it.log, Recorder({}, real_numpy, Sites()), [], it.customs)


# -- library regions: a call the skeleton skips (terra.library_regions) -------------------
CALL = ("Adam.apply", ("t",), 0)


def mark_at(line, what, *inputs, attrs=CALL):
    rec = OpRecord(NodeKind.MARK, what, attrs, list(inputs), (), None)
    rec.location, rec.site = at(line)
    return rec


def region_trace(value, other):
    """``y = Neg(x)``; a library call on ``y`` whose region is ``AddV2(y, c)`` (``c``: the
    same constant in both traces, or a value Python feeds if ``other`` differs); then
    ``Exp(y)``, read by Python."""
    x = ext(np.full((4, 3), value))
    recs = [op_at(at(1), "Neg", x), mark_at(2, "call", OpRef(0, 0)),
            op_at(at(3), "AddV2", OpRef(0, 0), ext(np.full((4, 3), other))),
            mark_at(4, "return"), op_at(at(9), "Exp", OpRef(0, 0))]
    recs[-1].fetched.add(0)
    return recs


def test_a_library_call_whose_region_needs_nothing_from_python_is_skipped(threads):
    h = Harness(threads, region_trace(1.0, 2.0), region_trace(3.0, 2.0))
    it = h.begin()
    y = h.fast("Neg", x_of(2.0))
    assert h.runner.library_call(CALL, [y], False) is True  # the method is not run
    w = h.fast("Exp", y)
    np.testing.assert_allclose(real_numpy(h.runner.value_of(h.entry(w))),
                               np.exp(np.full((4, 3), -2.0)), rtol=1e-6)
    assert [type(logged).__name__ for logged in it.log] == ["LoggedOp", "LoggedSkip", "LoggedOp"]
    assert h.fallbacks == []


def test_a_region_with_a_fed_input_takes_the_per_op_path(threads):
    h = Harness(threads, region_trace(1.0, 2.0), region_trace(3.0, 5.0))
    it = h.begin()
    y = h.fast("Neg", x_of(2.0))
    assert h.runner.library_call(CALL, [y], False) is False  # Python must feed AddV2's input
    h.fast("AddV2", y, x_of(7.0))
    h.runner.mark("return", CALL, (), None)
    h.fast("Exp", y)
    assert [type(logged).__name__ for logged in it.log] == \
        ["LoggedOp", "LoggedMark", "LoggedOp", "LoggedMark", "LoggedOp"]


def test_a_call_with_other_settings_diverges(threads):
    h = Harness(threads, region_trace(1.0, 2.0), region_trace(3.0, 2.0))
    h.begin()
    y = h.fast("Neg", x_of(2.0))
    with pytest.raises(Divergence) as raised:
        h.runner.library_call(("Adam.apply", ("t",), 1), [y], False)
    assert raised.value.category == "attribute change"


def test_a_fallback_replays_a_skipped_region_from_the_plan(threads):
    h = Harness(threads, region_trace(1.0, 2.0), region_trace(3.0, 2.0))
    it = h.begin()
    y = h.fast("Neg", x_of(2.0))
    h.runner.library_call(CALL, [y], False)
    skip = it.log[-1]
    with pytest.raises(Divergence):
        h.fast("Abs", y)  # not Exp: the iteration leaves the plan after the region
    h.leave(None)
    # the region's op ran eagerly on the replayed Neg and the traced constant
    (add,) = [s for s in skip.steps if s.op_type == "AddV2"]
    np.testing.assert_allclose(real_numpy(skip.values[(add.node, 0)][1]), np.zeros((4, 3)))
    # its marks were recorded again (the recorder here has no op callback: ops go unseen)
    marks = [(r.op_type, r.site) for r in h.recorder.records]
    assert marks == [("call", (2, 0)), ("return", (4, 0))]


def same_input_trace(value):
    """A region whose op reads again the external value ``Neg`` read first (``x``, fed):
    ``Sub(y, x)``; the graph reads it from the feed, Python feeds nothing in the region."""
    x = ext(np.full((4, 3), value))
    recs = [op_at(at(1), "Neg", x), mark_at(2, "call", OpRef(0, 0)),
            op_at(at(3), "Sub", OpRef(0, 0), SameRef(0, 0)),
            mark_at(4, "return"), op_at(at(9), "Exp", OpRef(0, 0))]
    recs[-1].fetched.add(0)
    return recs


def test_a_skipped_region_reads_a_value_fed_before_it_in_the_replay_too(threads):
    h = Harness(threads, same_input_trace(1.0), same_input_trace(3.0))
    it = h.begin()
    y = h.fast("Neg", x_of(2.0))
    assert h.runner.library_call(CALL, [y], False) is True
    skip = it.log[-1]
    with pytest.raises(Divergence):
        h.fast("Abs", y)
    h.leave(None)
    (sub,) = [s for s in skip.steps if s.op_type == "Sub"]
    assert sub.slots[1].kind == "same"
    np.testing.assert_allclose(real_numpy(skip.values[(sub.node, 0)][1]),
                               np.full((4, 3), -4.0))  # -2 - 2: this iteration's x
