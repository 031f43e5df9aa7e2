"""terra.stats()'s wall and CPU times of co-executed iterations (terra/clocks.py): filled after
co-execution, and plausible: the loop's thread cannot use more CPU than the wall time, nor
the other threads more than the wall time on every core."""

import os

from differential import assert_same_as_eager
from tiny_models import mlp_loop

import terra


def test_coexecuted_iterations_have_wall_and_cpu_times_of_both_runners():
    outcome = assert_same_as_eager(mlp_loop, 12, min_coexecuted=5)
    s = outcome.stats
    assert s.coexec_wall > 0 and s.python_cpu > 0 and s.graph_cpu > 0, outcome.report()
    assert s.python_cpu <= s.coexec_wall * 1.01, outcome.report()
    assert s.graph_cpu <= s.coexec_wall * (os.cpu_count() or 1) * 1.01, outcome.report()
    assert s.graph_exec <= s.coexec_wall * 1.5, outcome.report()  # the graph's calls fit in
    assert "co-executed iterations:" in outcome.explain


def test_no_coexecution_no_times():
    terra.reset()
    terra.configure(disable=True)
    try:
        mlp_loop(terra.TerraGradientTape, 6)
        s = terra.stats()
    finally:
        terra.configure(disable=False)
        terra.reset()
    assert s.coexec_wall == s.python_cpu == s.graph_cpu == 0.0
