"""The ``tf.distribute`` benchmark (``benchmarks.distribute``): its loss checks and paired
ratios on hand-built runs, and one real run on tiny settings through the whole code path
(fresh worker processes splitting the CPU into logical devices, the JSON, the table, the plot).

No timing is asserted: the figures of a real run depend on the machine. What must hold is that
Terra's losses are eager's bit for bit, that Terra saw every step's tapes (co-executed or kept
plain), and that the figures are computed from the runs they claim.
"""

import json

import pytest

from benchmarks import distribute

LOSSES = [2.5, 2.25, 2.125]


def _run(mode, repeat, steps_per_s, losses=LOSSES, replicas=2, **extra):
    return dict(mode=mode, replicas=replicas, repeat=repeat, steps_per_s=steps_per_s,
                losses=list(losses), **extra)


def test_terra_must_match_bit_for_bit_and_tf_function_within_tolerance():
    eager = [_run("eager", 0, 10.0)]
    off_by_a_bit = [2.5, 2.25 * (1 + 1e-7), 2.125]  # float32 rounding away, not more
    same = distribute.check_losses("terra", [_run("terra", 0, 10.0)], eager, 1e-4, 1e-6)
    assert same["status"] == "match" and same["max_rel_diff"] == 0
    wrong = distribute.check_losses("terra", [_run("terra", 0, 10.0, off_by_a_bit)], eager,
                                    1e-4, 1e-6)
    assert wrong["status"] == "WRONG" and wrong["detail"].startswith("step 2:")
    close = distribute.check_losses("function", [_run("function", 0, 90.0, off_by_a_bit)],
                                    eager, 1e-4, 1e-6)
    assert close["status"] == "match" and close["max_rel_diff"] == pytest.approx(1e-7)
    far = distribute.check_losses("function", [_run("function", 0, 90.0, [2.5, 2.3, 2.125])],
                                  eager, 1e-4, 1e-6)
    assert far["status"] == "WRONG"
    failed = distribute.check_losses("terra", [dict(mode="terra", error="boom")], eager, 0, 0)
    assert (failed["status"], failed["detail"]) == ("FAIL", "boom")
    # eager is checked against its own first repeat
    nondet = distribute.check_losses("eager", eager + [_run("eager", 1, 9.0, off_by_a_bit)],
                                     eager, 1e-4, 1e-6)
    assert nondet["status"] == "NONDET"


def test_ratios_are_medians_of_per_repeat_ratios():
    # Terra is x3.0, x1.2, x1.05 of eager repeat by repeat: median x1.2, where the ratio of
    # the medians would be 21 / 10 = x2.1
    speeds = dict(eager=[10.0, 5.0, 20.0], terra=[30.0, 6.0, 21.0],
                  function=[100.0, 200.0, 20.0])
    runs = [_run(mode, k, v, terra_stats=dict(iterations=0, traces=0, coexecuted=0,
                                              plain_tapes=8, fallbacks=0, phase="warmup"))
            for mode, values in speeds.items() for k, v in enumerate(values)]
    (row,) = distribute.summarize(runs, [2], ["eager", "terra", "function"])
    assert row["terra_x_eager"] == pytest.approx([3.0, 1.2, 1.05])
    assert row["median_terra_x_eager"] == pytest.approx(1.2)
    assert row["terra_x_function"] == pytest.approx([0.3, 0.03, 1.05])
    assert row["median_terra_x_function"] == pytest.approx(0.3)  # not 21 / 100
    assert row["median_function_x_eager"] == pytest.approx(10.0)
    assert row["modes"]["terra"]["median_steps_per_s"] == 21.0
    assert row["modes"]["eager"]["spread_pct"] == pytest.approx(75.0)  # (20 - 5) / 2 / 10
    assert row["terra_stats"]["plain_tapes"] == 8
    assert all(m["status"] == "match" for m in row["modes"].values())
    text = distribute.table([row], steps=3, warmup=1)
    assert "| 2 | 10.00 (+-75%) | 21.00 (+-57%) | 100.00 (+-90%) | x1.20 | x0.30 | 0 of 4 | 8 |" \
        in text
    assert "Terra bit for bit" in text


def test_one_real_run_on_two_replica_counts(tmp_path):
    """1 and 2 replicas, eager and Terra, 1 warm-up and 3 timed steps, one repeat: four fresh
    worker processes, each splitting its CPU before TensorFlow initialises."""
    replicas, warmup, steps = [1, 2], 1, 3
    assert distribute.main(["--replicas", "1,2", "--steps", str(steps), "--warmup", str(warmup),
                            "--repeats", "1", "--modes", "eager,terra", "--out", str(tmp_path)],
                           log=lambda _: None) == 0
    saved = json.loads((tmp_path / "distribute.json").read_text())
    assert saved["meta"]["modes"] == ["eager", "terra"] and saved["meta"]["replicas"] == replicas
    runs = {(r["replicas"], r["mode"]): r for r in saved["runs"]}
    assert sorted(runs) == [(n, m) for n in replicas for m in ("eager", "terra")]
    for (n, _), run in runs.items():
        assert "error" not in run, run.get("traceback")
        assert run["replicas_in_sync"] == n and len(run["devices"]) == n
        assert run["keras_version"].startswith("3.")
        assert len(run["losses"]) == warmup + steps and run["steps_per_s"] > 0
    for n in replicas:
        eager, terra = runs[(n, "eager")], runs[(n, "terra")]
        assert terra["losses"] == eager["losses"], terra.get("explain")  # bit for bit
        stats = terra["terra_stats"]
        assert set(distribute.COUNTERS) <= set(stats)
        # every step's tapes reached Terra: each replica's tape ran plainly, or Terra ran
        # the step's iteration itself (traced or co-executed)
        assert stats["plain_tapes"] + stats["iterations"] >= warmup + steps, terra["explain"]
        assert stats["fallbacks"] == 0, terra["explain"]
    rows = saved["rows"]
    assert [row["replicas"] for row in rows] == replicas
    for row in rows:
        assert row["modes"]["terra"]["status"] == "match"
        assert row["modes"]["eager"]["status"] == "match"
        assert row["median_terra_x_eager"] > 0 and "median_terra_x_function" not in row
    # the one-replica run is the same program on a global batch split once: the two replica
    # counts start from the same weights and data, so their first losses agree closely
    assert runs[(1, "eager")]["losses"][0] == pytest.approx(runs[(2, "eager")]["losses"][0],
                                                            rel=1e-5)
    text = (tmp_path / "distribute.md").read_text()
    assert text.count("Terra bit for bit") == len(replicas)
    assert (tmp_path / "distribute.png").stat().st_size > 0
    # the table again from the saved runs, written elsewhere: the same table
    again = tmp_path / "again"
    assert distribute.main(["--table", str(tmp_path / "distribute.json"), "--out", str(again)],
                           log=lambda _: None) == 0
    assert (again / "distribute.md").read_text() == text


def test_four_replicas_reduce_as_eager(tmp_path):
    """Over four replicas the collective all-reduce is a ring, and the order in which it adds
    an element's four terms follows where the element lies in the buffer reduced: eagerly TF
    reduces each gradient by itself, so Terra's reduction must too. Reduced packed into one
    buffer, as TF's graph code does, this run's losses were 1 ulp off eager's from step 2."""
    assert distribute.main(["--replicas", "4", "--steps", "12", "--warmup", "5", "--repeats",
                            "1", "--modes", "eager,terra", "--out", str(tmp_path)],
                           log=lambda _: None) == 0
    runs = {r["mode"]: r for r in json.loads((tmp_path / "distribute.json").read_text())["runs"]}
    for run in runs.values():
        assert "error" not in run, run.get("traceback")
        assert run["replicas_in_sync"] == 4
    assert runs["terra"]["losses"] == runs["eager"]["losses"], runs["terra"].get("explain")
    assert runs["terra"]["terra_stats"]["coexecuted"] > 0, runs["terra"]["explain"]
