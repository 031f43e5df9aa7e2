"""A short soak (``benchmarks/soak.py``) in a child process: both programs co-execute and the
process's memory does not grow with the iterations. Fails if a program stops co-executing
(every iteration would then be eager, which hides leaks of co-execution) or if RSS grows by more
than 15% after the warm-up: something an iteration leaves behind (stand-ins, queued values,
frozen garbage) would grow with the run. The full run and its figures are in docs/soak.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ITERATIONS, SAMPLE_EVERY, WARMUP = 600, 100, 200
GROWTH_BOUND = 0.15


def test_short_soak_coexecutes_with_flat_memory(tmp_path):
    out = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", "--iterations", str(ITERATIONS),
         "--sample-every", str(SAMPLE_EVERY), "--warmup", str(WARMUP), "--json", str(out)],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    results = json.loads(out.read_text())
    assert [r["program"] for r in results] == ["mlp", "alternating"]
    for r in results:
        assert r["iterations"] == ITERATIONS, r
        assert r["coexecuted"] >= ITERATIONS // 2, f"{r['program']} did not co-execute: {r}"
        assert len(r["rss"]) == ITERATIONS // SAMPLE_EVERY, r
        assert r["growth"] <= GROWTH_BOUND, f"{r['program']}: RSS grew: {r['rss']}"
