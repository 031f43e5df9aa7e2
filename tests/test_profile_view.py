"""``benchmarks.profile_view``: the profiled run's trace read back thread by thread, and drawn.

docs/profile.png is only worth showing if the reader puts each of Terra's spans on the thread
that ran it and finds the graph's kernels on TF's inter-op threads; a reader that mixed the two
Python threads up (the profiler names both ``python``) would draw a plausible, wrong picture.
"""

import terra
from benchmarks import profile_view

PNG = b"\x89PNG\r\n\x1a\n"


def test_nesting_depths():
    spans = [(0, 10), (1, 4), (2, 3), (4, 6), (10, 12)]  # sorted by start, outer first
    assert profile_view._depths(spans) == [0, 1, 2, 1, 0]


def test_profiled_run_read_back_on_its_threads_and_drawn(tmp_path):
    # weight decay from step 8; with the suite's settings (conftest: the graph instantiated by
    # its first iteration, no cost budget) co-execution starts at the third iteration, so both
    # graphs co-execute whatever the machine's speed
    threads = profile_view.profile(16, str(tmp_path / "logdir"))
    s = terra.stats()
    assert s.coexecuted >= 3 and s.fallbacks == 1 and s.graph_generations == 2, terra.explain()

    roles = [t.role for t in threads]
    assert roles[:2] == ["loop", "graph"] and set(roles[2:]) == {"executor"}, roles
    assert len(threads) <= 2 + profile_view.MAX_EXECUTORS
    loop, graph, executors = threads[0], threads[1], threads[2:]
    on_loop = {sp.name for sp in loop.spans}
    assert {"terra_trace", "terra_merge", "terra_generate", "terra_coexecute",
            "terra_fallback", "terra_replay", "terra_fetch_wait"} <= on_loop, on_loop
    assert {sp.name for sp in graph.spans} == {"terra_graph_step"}
    assert all(not t.spans and t.ops for t in executors)

    # every co-executed iteration that ended in the trace ran as a graph call of its number
    # (but the one the fallback left: its graph call may be cancelled before it starts), and
    # the phases are outermost on the loop's thread, the waits inside them: the loss read of
    # every co-executed iteration is a fetch wait in it (a wait for the job's end is not
    # asked for: there is one only where Python got there before the graph, which depends
    # on the machine's load)
    coexecuted = {sp.step for sp in loop.spans if sp.name == "terra_coexecute"}
    fallback = next(sp for sp in loop.spans if sp.name == "terra_fallback")
    left = max(sp.step for sp in loop.spans
               if sp.name == "terra_coexecute" and sp.start < fallback.start)
    calls = {sp.step: sp for sp in graph.spans}
    assert len(coexecuted) >= 3 and coexecuted - {left} <= set(calls), (coexecuted, sorted(calls))
    assert all(sp.depth == 0 for sp in loop.spans if sp.name in profile_view.PHASES)
    assert any(sp.depth == 1 for sp in loop.spans if sp.name == "terra_fetch_wait")
    # the graph's kernels ran on the inter-op threads while a graph call was under way
    in_calls = [(a, d) for t in executors for a, d in t.ops
                if any(c.start <= a and a + d <= c.start + c.duration for c in calls.values())]
    assert len(in_calls) > 50, len(in_calls)
    # the first traced iteration starts the clock
    assert min(sp.start for t in threads for sp in t.spans) == 0

    start, end = profile_view.zoom_window(threads)
    last = [calls[step] for step in sorted(coexecuted)[-3:]]
    assert start <= last[0].start and last[-1].start + last[-1].duration <= end

    out = tmp_path / "profile.png"
    profile_view.draw(threads, out, "test")
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000, len(data)
