"""The quick part of the real-program corpus: real libraries' training code, eager vs Terra.

Each test runs one corpus program twice in fresh processes (eagerly, then with
``terra.enable()``) through the corpus driver and asserts the same per-step losses and the same
final value of every variable. A program whose library is not installed is skipped; the README's
test command installs the libraries these tests need.
"""

import numpy as np
import pytest

from benchmarks.corpus import REGISTRY
from benchmarks.corpus.driver import compare, run_child

STEPS = 30  # Terra's cost budget judges a program after 30 iterations
QUICK = [name for name, entry in REGISTRY.items() if entry.quick]


def run_pair(program, steps, tmp_path):
    """``program`` eagerly, then with ``terra.enable()``, each in a fresh process: the same
    losses and variables, and the program's own ``tf.GradientTape`` was Terra's (else this
    compared eager with eager). Skipped where its library is not installed. Terra's run."""
    for module in REGISTRY[program].requires:
        pytest.importorskip(module)
    eager = run_child(program, "eager", steps, 0, str(tmp_path))
    terra = run_child(program, "terra", steps, 0, str(tmp_path))
    comparison = compare(eager, terra)
    assert comparison.match, f"{comparison.detail}\n{terra.get('explain')}\n" \
                             f"{terra.get('traceback') or eager.get('traceback') or ''}"
    assert terra["stats"]["iterations"] >= steps, terra["stats"]
    return terra


@pytest.mark.parametrize("program", QUICK)
def test_terra_equals_eager(program, tmp_path, monkeypatch):
    monkeypatch.setenv("TERRA_BACKGROUND", "1")  # as a user runs it (the suite turns it off)
    terra = run_pair(program, STEPS, tmp_path)
    # one optimizer update per step, the library's own: every co-executed step skipped it
    assert terra["stats"]["skipped_calls"] >= terra["stats"]["coexecuted"], terra["stats"]


def _runs(tmp_path, eager_vars, terra_vars, eager_losses, terra_losses):
    """A pair of results as the worker writes them, from given numbers."""
    runs = []
    for mode, values, losses in (("eager", eager_vars, eager_losses),
                                 ("terra", terra_vars, terra_losses)):
        path = str(tmp_path / f"{mode}.npz")
        np.savez(path, **values)
        runs.append(dict(mode=mode, losses=losses, variables_path=path))
    return runs


def test_comparison_sees_different_numbers(tmp_path):
    weights = {"0000 w": np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)}
    nudged = {"0000 w": weights["0000 w"] + np.float32(1e-3) * np.eye(2, 3, dtype=np.float32)}
    losses = [1.0, 0.5, 0.25]
    assert compare(*_runs(tmp_path, weights, weights, losses, list(losses))).match
    loss_off = compare(*_runs(tmp_path, weights, weights, losses, [1.0, 0.5, 0.2501]))
    assert not loss_off.match and "step 3" in loss_off.detail
    weight_off = compare(*_runs(tmp_path, weights, nudged, losses, list(losses)))
    assert not weight_off.match and "0000 w" in weight_off.detail
    failed = compare(*_runs(tmp_path, weights, weights, losses, losses)[:1],
                     dict(mode="terra", error="RuntimeError during training: boom"))
    assert not failed.match and "boom" in failed.detail


def test_a_row_is_the_median_of_paired_runs_and_every_pair_must_match(monkeypatch, tmp_path):
    """Three pairs, the order of the modes alternating; the ratio is the median of the ratios
    taken within each pair (not a ratio of medians), and one mismatching pair fails the row."""
    from benchmarks.corpus import driver

    eager_s, terra_s = iter([2.0, 1.0, 4.0]), iter([1.0, 2.0, 1.0])  # ratios 2, 0.5, 4
    order = []

    def fake_run_child(program, mode, steps, seed, scratch, timeout):
        order.append(mode)
        total = next(eager_s if mode == "eager" else terra_s)
        return dict(mode=mode, steps=steps, total_s=total, second_half_s=total / 2,
                    second_half_steps=steps // 2, losses=[1.0], stats={"traces": 2})

    verdicts = iter([True, False, True])
    monkeypatch.setattr(driver, "run_child", fake_run_child)
    monkeypatch.setattr(driver, "compare",
                        lambda eager, terra: driver.Comparison(next(verdicts), "detail"))
    row = driver.run_program("sonnet_mlp", 10, repeats=3)
    assert order == ["eager", "terra", "terra", "eager", "eager", "terra"]
    assert row["ratio"] == 2.0 and row["eager_sps"] == 5.0
    assert not row["match"]


def test_step_times_give_the_ratios_over_eager_and_tf_function(monkeypatch):
    """The function mode joins each set (the order reversed from set to set); "x eager" and
    "x tf.function" are the baselines' median second-half step times over Terra's, each taken
    within its set; a program without ``step_function`` shows n/a, not a number."""
    from benchmarks.corpus import driver

    # per mode, the step times of each of two sets: only the second half counts
    times = {"eager": iter([[9.0, 0.4, 0.4, 0.4], [9.0, 0.6, 0.6, 0.6]]),
             "terra": iter([[9.0, 9.0, 0.1, 0.1], [9.0, 9.0, 0.2, 0.2]]),
             "function": iter([[9.0, 0.1, 0.05, 0.05], [9.0, 0.1, 0.1, 0.1]])}
    order = []

    def fake_run_child(program, mode, steps, seed, scratch, timeout):
        order.append(mode)
        step_s = next(times[mode])
        return dict(mode=mode, steps=steps, total_s=sum(step_s), second_half_s=sum(step_s[2:]),
                    second_half_steps=2, step_s=step_s, losses=[1.0], stats={"traces": 2})

    monkeypatch.setattr(driver, "run_child", fake_run_child)
    monkeypatch.setattr(driver, "compare", lambda eager, terra: driver.Comparison(True, ""))
    row = driver.run_program("vae", 4, repeats=2, function=True)
    assert order == ["eager", "terra", "function", "function", "terra", "eager"]
    assert row["terra_step_ms"] == pytest.approx(150.0)
    assert row["x_eager"] == pytest.approx(3.5)  # the median of 400/100 and 600/200
    assert row["x_function"] == pytest.approx(0.5)  # of 50/100 and 100/200
    assert row["function"] == "ran"
    assert "| 500.00 | 75.00 | 150.00 | 3.50 | 0.50 |" in driver.table([row])

    def unsupported(program, mode, steps, seed, scratch, timeout):
        if mode == "function":
            return dict(mode=mode, unsupported="the program has no step_function()")
        return fake_run_child(program, mode, steps, seed, scratch, timeout)

    times.update(eager=iter([[1.0] * 4]), terra=iter([[1.0] * 4]))
    monkeypatch.setattr(driver, "run_child", unsupported)
    row = driver.run_program("sonnet_mlp", 4, function=True)
    assert row["function"] == "n/a" and row["x_function"] is None
    assert "| n/a | 1000.00 | 1.00 | n/a |" in driver.table([row])
