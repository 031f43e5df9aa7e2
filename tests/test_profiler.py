"""Terra's phases in the TensorBoard profiler: a loop profiled with
``tf.profiler.experimental.start``/``stop`` shows the loop thread's phases and the graph's
iterations on the GraphRunner's thread, in the trace the profiler writes."""

import glob
import os

import tensorflow as tf
from differential import assert_same_as_eager
from test_keras_fit_differential import dataset_loop_to_its_end
from tiny_models import batch, mlp_task

import terra
from terra import profiling

try:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
except ImportError:  # where TF ships TSL as its own package
    from tsl.profiler.protobuf import xplane_pb2

_LOOP_PHASES = {"terra_trace", "terra_merge", "terra_generate", "terra_coexecute",
                "terra_fetch_wait", "terra_fallback", "terra_replay"}


def _loop(steps, new_path_at):
    """The usual loop, reading the loss every step; at step ``new_path_at`` the forward
    pass takes a path no trace had, so co-execution falls back there."""
    data, model, optimizer, loss_fn = mlp_task(steps)
    for step in range(steps):
        x, y = batch(data, step, 16)
        with terra.TerraGradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            if step == new_path_at:
                loss = loss * 1.0
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        float(loss)


def _events(logdir):
    """The host plane's events of the written trace: ``{thread line id: {name: [{stat name:
    value}]}}``."""
    (path,) = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    (host,) = [p for p in space.planes if p.name == "/host:CPU"]
    stat_names = {k: v.name for k, v in host.stat_metadata.items()}
    lines = {}
    for line in host.lines:
        for e in line.events:
            stats = {stat_names[s.metadata_id]: s.int64_value for s in e.stats}
            name = host.event_metadata[e.metadata_id].name
            lines.setdefault(line.id, {}).setdefault(name, []).append(stats)
    return lines


def test_profiler_shows_the_phases_and_the_graph_steps_on_their_threads(tmp_path):
    terra.reset()
    tf.profiler.experimental.start(str(tmp_path))
    try:
        _loop(12, new_path_at=7)
    finally:
        tf.profiler.experimental.stop()
    s = terra.stats()
    assert s.coexecuted > 0 and s.fallbacks > 0, terra.explain()
    lines = _events(str(tmp_path))
    loops = [names for names in lines.values() if "terra_coexecute" in names]
    graphs = [names for names in lines.values() if "terra_graph_step" in names]
    assert len(loops) == len(graphs) == 1, [sorted(names) for names in lines.values()]
    loop, graph = loops[0], graphs[0]
    assert _LOOP_PHASES <= set(loop), sorted(loop)
    assert graph is not loop and not _LOOP_PHASES & set(graph)  # another thread
    # each graph call carries its iteration's number, a root step event for the step view
    steps = [stats["step_num"] for stats in graph["terra_graph_step"]]
    assert all(stats["_r"] == 1 for stats in graph["terra_graph_step"])
    assert len(steps) == len(set(steps)) >= s.coexecuted
    coexecuted = {stats["step_num"] for stats in loop["terra_coexecute"]}
    traced = {stats["step_num"] for stats in loop["terra_trace"]}
    # (the iteration that fell back may have been cancelled before its graph call started)
    assert coexecuted - traced <= set(steps), (coexecuted, traced, steps)
    # traces come first; the iteration that fell back was co-executed, then traced
    assert min(traced) < min(coexecuted) and traced & coexecuted, (traced, coexecuted)


def test_no_profiler_builds_no_annotation():
    assert not profiling.enabled()
    assert profiling.trace("terra_anything", step_num=1) is profiling.trace("terra_other")
    phase = profiling.Phase()
    phase.begin("terra_anything")
    assert phase._me is None


def test_a_dataset_loop_ends_under_the_profiler_with_eagers_numbers(tmp_path):
    tf.profiler.experimental.start(str(tmp_path))
    try:
        # each pass over the dataset ends at the path's start, where the profiler names the wait
        assert_same_as_eager(dataset_loop_to_its_end, 12, exact=("losses", "variables"))
    finally:
        tf.profiler.experimental.stop()
