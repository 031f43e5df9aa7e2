"""The differential fuzzer on a fixed small set, and checks that it can fail at all.

``benchmarks.fuzz`` draws random imperative training programs and runs each eagerly and under
Terra in separate processes. Here: a fixed set of seeds (the same code path as
``python -m benchmarks.fuzz --count 12 --seed 0``) must show no mismatch, crash or hang; a
difference injected into the Terra run must be caught, as mismatch and as crash, by a written
program run alone; and a seed must draw the same source in every process.
"""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.fuzz import standalone
from benchmarks.fuzz.driver import Options, Summary, campaign
from benchmarks.fuzz.program import generate, render
from benchmarks.fuzz.runner import run
from benchmarks.fuzz.snippets import Snippet

ROOT = Path(__file__).resolve().parent.parent
QUICK = Options(count=12, seed=0, jobs=2, min_trials=0)
KNOWN = {}  # seed -> the Terra bug that program still finds (xfail(strict) until fixed)


@pytest.fixture(scope="module")
def quick_results():
    with ThreadPoolExecutor(QUICK.jobs) as pool:
        return {r.program.seed: r for r in campaign(QUICK, pool)}


@pytest.mark.parametrize("seed", [
    pytest.param(s, marks=pytest.mark.xfail(strict=True, reason=KNOWN[s])) if s in KNOWN else s
    for s in range(QUICK.seed, QUICK.seed + QUICK.count)])
def test_program_agrees_with_eager(quick_results, seed):
    result = quick_results[seed]
    assert result.kind in ("ok",), (
        f"{result.kind}: {result.verdict['detail']} | {result.verdict['reason']} "
        f"| repro: {QUICK.command(seed)}")


def test_summary_counts_the_set(quick_results):
    line = Summary(list(quick_results.values())).line()
    failing = sum(r.failed for r in quick_results.values())
    assert line.startswith(f"{QUICK.count} programs, ")
    assert failing == len(KNOWN), line


def _injected(seed, statement):
    """Program ``seed`` plus one statement run after each update, only in the Terra process
    (the harness imports ``terra`` there alone)."""
    program = generate(seed)
    snippet = Snippet("injected", (("after", (statement,)),))
    return program.__class__(program.seed, program.steps, program.base,
                             program.snippets + (snippet,), "injected")


def test_an_injected_difference_is_a_mismatch_and_the_file_runs_alone(tmp_path):
    program = _injected(3, "if 'terra' in sys.modules and step == 9:\n"
                           "    params[0].assign_add(tf.fill(params[0].shape, 0.01))")
    path = tmp_path / "injected.py"
    path.write_text(render(program))
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("mismatch: loss at step 10"), done.stdout


def test_an_injected_exception_is_a_crash():
    result = run(_injected(5, "if 'terra' in sys.modules and step == 7:\n"
                              "    raise RuntimeError('injected')"))
    assert (result.kind, result.verdict["detail"]) == ("crash", "RuntimeError: injected")


def test_a_timeout_is_a_hang_and_an_eager_failure_is_invalid():
    eager = {"status": "ok", "error": None, "values": {"losses": []}, "log": ""}
    assert standalone.judge(eager, {"status": "timeout", "stderr": ""})["kind"] == "hang"
    failed = dict(eager, error={"type": "ValueError", "message": "generator bug"})
    assert standalone.judge(failed, failed)["kind"] == "invalid"


def test_a_seed_draws_the_same_source_in_another_process():
    show = subprocess.run([sys.executable, "-m", "benchmarks.fuzz", "--seed", "17", "--show"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    assert show.stdout == render(generate(17, command=QUICK.command(17))) + "\n"
    assert render(generate(17)) != render(generate(18))


def test_the_program_that_found_a_skip_failing_mid_fetch_agrees_with_eager():
    # seed 6 of ``--only masked_loss,fan_out`` (docs/fuzz.md, bug 11): the graph failed while
    # a skipped ``tf.boolean_mask`` fetched its value, and the fallback handed the next op None
    result = run(generate(6, only=["masked_loss", "fan_out"]))
    assert result.kind == "ok", f"{result.kind}: {result.verdict['detail']}"
