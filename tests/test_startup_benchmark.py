"""The start-up benchmark (``benchmarks.startup``): its arithmetic on hand-built timelines, and
one real run of a tiny program through the whole code path (fresh worker processes, the
iteration records Terra's runtime yields, the table and the JSON).

No timing is asserted: the figures of a real run depend on the machine; what must hold is how
they are computed and that they agree with each other.
"""

import json

import pytest

from benchmarks import startup


def _record(step, phase, iterations, traces=0, fallbacks=0, coexecuted=0, generations=0):
    return dict(step=step, phase=phase, iterations=iterations, traces=traces,
                fallbacks=fallbacks, coexecuted=coexecuted, graph_generations=generations)


def _final(iterations, traces, fallbacks, coexecuted, generations):
    return dict(iterations=iterations, traces=traces, fallbacks=fallbacks,
                coexecuted=coexecuted, graph_generations=generations)


# A run of 8 steps as the worker records it: a warm-up step, two traced steps (the second
# trace covered), one step that generates the graph at its start (when the trace ends) and
# runs eagerly while the graph is instantiated in the background, three co-executed steps,
# then one that falls back (to tracing). Each record's counters are those once every
# earlier iteration was closed.
RECORDS = [
    _record(0, "warmup", 1),
    _record(1, "tracing", 2),
    _record(2, "tracing", 3, traces=1),
    _record(3, "instantiating", 4, traces=2),
    _record(4, "coexecution", 5, traces=2, generations=1),
    _record(5, "coexecution", 6, traces=2, coexecuted=1, generations=1),
    _record(6, "coexecution", 7, traces=2, coexecuted=2, generations=1),
    _record(7, "coexecution", 8, traces=2, coexecuted=3, generations=1),
]
FINAL = _final(8, 3, 1, 3, 1)  # the last step fell back; its trace was merged
GENERATIONS = [dict(step=3, seconds=0.004)]
KINDS = ["warmup", "traced", "traced", "generating", "coexecuted", "coexecuted",
         "coexecuted", "fallback"]


def test_each_step_gets_its_kind_from_its_phase_and_its_counters():
    steps = startup.per_step(RECORDS, FINAL, 8, GENERATIONS)
    assert [s["kind"] for s in steps] == KINDS
    assert [s["generation_s"] for s in steps] == [0, 0, 0, 0.004, 0, 0, 0, 0]
    assert [s["phase"] for s in steps] == [r["phase"] for r in RECORDS]
    assert [s["traces"] for s in steps] == [0, 1, 1, 0, 0, 0, 0, 1]
    assert [s["begun"] for s in steps] == [1] * 8
    assert startup.timeline(KINDS) == "wttgcccf"
    # without the generation's record, the step is one that ran while the graph instantiated
    assert startup.per_step(RECORDS, FINAL, 8)[3]["kind"] == "instantiating"
    # the run's last step began in co-execution and had not fallen back at its end: its
    # iteration is still open (it closes at the next tape entry), yet it is co-executed
    open_end = startup.per_step(RECORDS, _final(8, 2, 0, 3, 1), 8)
    assert open_end[-1]["kind"] == "coexecuted" and open_end[-1]["coexecuted"] == 0


def test_a_step_without_a_tape_entry_and_a_step_of_two_iterations():
    records = [_record(0, "warmup", 1), _record(2, "coexecution", 2),
               _record(2, "coexecution", 3, coexecuted=1)]
    steps = startup.per_step(records, _final(3, 0, 0, 2, 0), 3)
    assert [s["kind"] for s in steps] == ["warmup", None, "coexecuted"]
    assert [s["begun"] for s in steps] == [1, 0, 2]
    assert steps[2]["coexecuted"] == 2 and steps[1]["coexecuted"] == 0
    assert startup.timeline([s["kind"] for s in steps]) == "w-c"


def test_the_figures_of_a_pair_against_a_hand_built_timeline():
    # eager steps: 10 ms each (the first 30); Terra's in ms as the kinds above take them
    eager = [0.030] + [0.010] * 7
    terra = [0.032, 0.025, 0.025, 0.012, 0.002, 0.002, 0.002, 0.020]
    steps = startup.per_step(RECORDS, FINAL, 8, GENERATIONS)
    figures = startup.pair_figures(eager, terra, steps, FINAL)
    # cumulative Terra less eager, in ms: 2, 17, 32, 34, 26, 18, 10, 20 -> at most 34, step 4
    assert figures["eager_step_ms"] == pytest.approx(10.0)
    assert figures["startup_steps"] == pytest.approx(3.4)
    assert figures["peak_step"] == 4
    assert figures["pays_back_from"] is None  # still 20 ms behind after the last step
    assert figures["whole_run_ratio"] == pytest.approx(0.100 / 0.120)
    assert figures["traced_ratio"] == pytest.approx(2.5)
    assert figures["first_coexecuted"] == 5
    assert (figures["coexecuted_steps"], figures["traced_steps"], figures["fallback_steps"],
            figures["other_steps"]) == (3, 2, 1, 2)
    assert (figures["traces"], figures["graph_generations"], figures["fallbacks"],
            figures["coexecuted"]) == (3, 1, 1, 3)
    assert figures["timeline"] == "wttgcccf"
    # the 34 ms up to the peak: 2 (warm-up), 15 + 15 (traced), 4 (generation), and the
    # generating step's own 12 - 10 - 4
    assert figures["cost_by_kind"] == dict(warmup=0.2, traced=3.0, generating=-0.2,
                                           generation=0.4)
    assert figures["generation_s"] == pytest.approx(0.004)

    # the same run with cheaper co-executed steps: cumulative 2, 17, 32, 34, 26, 17, 8, -1:
    # behind through step 7, ahead from step 8
    terra[5:] = [0.001] * 3
    figures = startup.pair_figures(eager, terra, steps, FINAL)
    assert figures["pays_back_from"] == 8
    assert figures["whole_run_ratio"] == pytest.approx(0.100 / 0.099)


def test_ahead_from_the_first_step_and_behind_again_later():
    kinds = [dict(kind="coexecuted")] * 4
    final = _final(4, 0, 0, 4, 1)
    ahead = startup.pair_figures([1.0] * 4, [0.5] * 4, kinds, final)
    assert (ahead["startup_steps"], ahead["pays_back_from"], ahead["peak_step"]) == (0.0, 1, 1)
    assert ahead["traced_ratio"] is None  # no traced step
    # ahead at steps 1-2, behind at 3, ahead again at 4: it pays back from step 4, not 1
    again = startup.pair_figures([1.0] * 4, [0.5, 0.5, 2.5, 0.2], kinds, final)
    assert again["pays_back_from"] == 4
    assert again["startup_steps"] == pytest.approx(0.5)


def test_a_row_is_the_median_over_repeats_and_never_counts_after_every_step():
    def run(mode, step_s, final=None):
        r = dict(mode=mode, steps=len(step_s), step_s=step_s, losses=[1.0] * len(step_s))
        if mode == "terra":
            r.update(iterations=[_record(k, "coexecution", k + 1, coexecuted=k)
                                 for k in range(len(step_s))], final=final)
        return r

    final = _final(3, 0, 0, 3, 1)
    pairs = [(run("eager", [1.0] * 3), run("terra", t, final))
             for t in ([0.5] * 3, [2.0] * 3, [3.0] * 3)]
    row = startup.program_row("ten", "p", pairs)
    assert row["pays_back_from"] is None  # two of the three never pay back
    assert row["whole_run_ratio"] == pytest.approx(0.5)  # 2.0, 0.5, 0.33
    assert row["startup_steps"] == pytest.approx(3.0)  # 0, 3, 6
    assert row["losses"] == "match" and row["timeline"] == "ccc"
    failed = startup.program_row("ten", "p", [pairs[0], (run("eager", [1.0] * 3),
                                                         dict(mode="terra", error="boom"))])
    assert failed["error"] == "terra: boom" and failed["whole_run_ratio"] == 2.0
    summary = startup.summary_rows([dict(row, program="a"), dict(row, program="b",
                                                                 whole_run_ratio=2.0)])
    assert [s["program"] for s in summary] == ["ten: median (2)", "ten: geometric mean"]
    assert summary[1]["whole_run_ratio"] == pytest.approx(1.0)
    assert "never (3)" in startup.table([row, *summary], 3)


def test_one_real_run_of_a_tiny_program(tmp_path):
    """``counter_branch`` (an if/else on the step number) for 12 steps, eager and Terra in
    fresh processes, with the suite's Terra settings (budget off, no background
    instantiation: co-execution begins right after generation)."""
    steps = 12
    assert startup.main(["--set", "control_flow", "--programs", "counter_branch",
                         "--steps", str(steps), "--out", str(tmp_path)], log=lambda _: None) == 0
    saved = json.loads((tmp_path / "startup.json").read_text())
    assert (tmp_path / "startup.md").read_text().count("| counter_branch |") == 1
    eager, terra = saved["runs"]
    for run in (eager, terra):
        assert "error" not in run, run.get("traceback")
        assert len(run["step_s"]) == len(run["losses"]) == steps
    row = saved["rows"][0]
    assert row["program"] == "counter_branch" and row["losses"] == "match"
    assert row["coexecuted_steps"] + row["traced_steps"] + row["fallback_steps"] + \
        row["other_steps"] == steps
    assert len(row["timeline"]) == steps and row["timeline"][0] == "w"
    assert row["coexecuted_steps"] >= 1, terra["explain"]
    assert 1 < row["first_coexecuted"] <= steps
    assert row["timeline"][row["first_coexecuted"] - 1] == "c"
    assert "c" not in row["timeline"][:row["first_coexecuted"] - 1]
    # one tape per step: the counters agree with the step kinds (the last step's iteration
    # may still be open at the run's end, not counted yet)
    assert row["iterations"] == steps
    still_open = 1 if row["timeline"].endswith("c") else 0
    assert row["coexecuted_steps"] - still_open <= row["coexecuted"] <= row["coexecuted_steps"]
    assert row["traces"] <= row["traced_steps"] + row["fallback_steps"]
    assert row["graph_generations"] >= 1 and row["generation_s"] > 0
    # the start-up's parts add up to it (the peak is Terra's largest excess over eager)
    if row["startup_steps"] > 0:
        assert sum(row["cost_by_kind"].values()) == pytest.approx(row["startup_steps"],
                                                                  abs=0.05)
    assert row["startup_steps"] >= 0 and row["whole_run_ratio"] > 0
    assert (row["pays_back_from"] is None) == (row["whole_run_ratio"] <= 1)
    assert row["traced_ratio"] is not None and row["traced_steps"] >= 1
