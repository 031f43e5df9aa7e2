"""The simulator against the papers' closed forms, exactly (fractions), for D in {4, 8} and
N in {D, 2D, 4D}; and the places where an exact simulation and a paper's formula part."""

from fractions import Fraction

import pytest

from terra.pipeline import Op, Schedule, schedule, simulate
from terra.pipeline import bpipe as bp
from terra.pipeline import formulas as f

SIZES = [(D, N) for D in (4, 8) for N in (D, 2 * D, 4 * D)]


@pytest.mark.parametrize("D,N", SIZES)
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("costs", [(1, 2), (1, 1), (2, 3)])
def test_gpipe_and_1f1b_bubble(kind, D, N, costs):
    result = simulate(schedule(kind, D, N), forward=costs[0], backward=costs[1])
    assert result.bubble_ratio == f.gpipe(D, N)
    assert result.makespan == (N + D - 1) * sum(costs)


@pytest.mark.parametrize("D,N", SIZES)
def test_held_activations_gpipe_and_1f1b(D, N):
    assert simulate(schedule("gpipe", D, N)).peak_activations[0] == N
    held = simulate(schedule("1f1b", D, N)).peak_activations
    assert held[0] == min(D, N)
    assert list(held) == [f.one_f_one_b_held(D, s, N) for s in range(D)]


@pytest.mark.parametrize("D,N", SIZES)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble(D, N, v):
    assert simulate(schedule("interleaved", D, N, chunks=v)).bubble_ratio == \
        f.interleaved(D, N, v)


def test_interleaved_needs_whole_groups_of_microbatches():
    with pytest.raises(ValueError, match="multiple"):
        schedule("interleaved", 4, 6, chunks=2)


UNIT = {"forward": 1, "backward": 1, "weight": 1}  # 2BP Table 1: forward = p1 = p2


@pytest.mark.parametrize("D,N", SIZES)
def test_2bp_against_its_general_form(D, N):
    assert simulate(schedule("2bp-gpipe", D, N), **UNIT).bubble_ratio == f.twobp_gpipe(D, N)
    assert simulate(schedule("2bp-1f1b", D, N), **UNIT).bubble_ratio == f.twobp_1f1b(D, N)
    # Without 2BP the same costs make one backward of p1 + p2.
    assert simulate(schedule("1f1b", D, N), **UNIT).bubble_ratio == f.gpipe(D, N)


@pytest.mark.parametrize("N", [4, 8])
def test_2bp_table1_rows(N):
    """Table 1 has N = D pipeline processes; GPipe and 1F1B-1 run N micro-batches, 1F1B-2 2N."""
    table = f.twobp_table1(N)
    for row, (plain, split, micro) in f.twobp_table1_runs(N).items():
        without = simulate(schedule(plain, N, micro), **UNIT).bubble_ratio
        with_2bp = simulate(schedule(split, N, micro), **UNIT).bubble_ratio
        assert (without, with_2bp) == table[row], row


def test_2bp_fills_1f1b_waits_with_weight_gradients():
    """A W runs only where the device would wait, after its own micro-batch's B."""
    order = schedule("2bp-1f1b", 4, 4).per_device[0]
    assert [str(op) for op in order] == [
        "F0.0", "F1.0", "F2.0", "F3.0", "B0.0", "W0.0", "B1.0", "W1.0", "B2.0", "W2.0",
        "B3.0", "W3.0"]
    with pytest.raises(ValueError, match="weight="):
        simulate(schedule("2bp-1f1b", 4, 4))


# BitPipe's Figure 3 (D = 4, N = 4), transcribed: per device, micro-batch and arm of the V
# (a: first arm, b: second arm) of each operation, left to right. Micro-batches 0 and 1 take
# the down pipeline, 2 and 3 the up one.
FIGURE_3 = [
    "F0a F1a F2a F2b F3a F3b F0b B0b F1b B1b B2b B2a B3b B3a B0a B1a",
    "F0a F2a F1a F3a F2b F0b F3b F1b B0b B2b B1b B3b B2a B0a B3a B1a",
    "F2a F0a F3a F1a F0b F2b F1b F3b B2b B0b B3b B1b B0a B2a B1a B3a",
    "F2a F3a F0a F0b F1a F1b F2b B2b F3b B3b B0b B0a B1b B1a B2a B3a",
]


def test_bitpipe_order_is_figure_3():
    from terra.pipeline.charts import label

    plan = schedule("bitpipe", 4, 4)
    assert [" ".join(label(plan, op) for op in ops) for ops in plan.per_device] == FIGURE_3


def test_bitpipe_basic_unit_d4_matches_the_paper():
    result = simulate(schedule("bitpipe", 4, 4), forward=1, backward=2)
    assert result.bubble_ratio == f.bitpipe(4, 4) == Fraction(1, 7)
    assert result.makespan == 14


def test_bitpipe_basic_unit_d8_differs_from_the_paper():
    """The paper counts (3D-6)/4 bubbles on its D = 4 figure and writes (D-2)/(3N+D-2) for
    every D. Extending Figure 3's rule to D = 8, the two pipelines' backwards meet on the same
    devices in the drain and each device waits 14 forward-halves, not 12: 7/31, not 1/5."""
    result = simulate(schedule("bitpipe", 8, 8), forward=1, backward=2)
    assert f.bitpipe(8, 8) == Fraction(1, 5)
    assert result.bubble_ratio == Fraction(7, 31)
    assert result.makespan == 31


@pytest.mark.parametrize("D,N,expected", [(4, 8, Fraction(5, 53)), (4, 16, Fraction(1, 17)),
                                          (8, 16, Fraction(7, 39)), (8, 32, Fraction(5, 53))])
def test_bitpipe_several_units(D, N, expected):
    """Concatenated basic units keep bubbles inside the step that (D-2)/(3N+D-2) leaves out
    (the paper says so: only its Appendix B's early forwarding removes them), so the simulated
    ratio lies above that formula; the early-forwarding one is lower still."""
    ratio = simulate(schedule("bitpipe", D, N), forward=1, backward=2).bubble_ratio
    assert ratio == expected
    assert ratio > f.bitpipe(D, N) > f.bitpipe_early_forwarding(D, N)


def test_bitpipe_balances_activations():
    held = simulate(schedule("bitpipe", 8, 8)).peak_activations
    one_f_one_b = simulate(schedule("1f1b", 8, 8)).peak_activations
    assert max(held) - min(held) < max(one_f_one_b) - min(one_f_one_b)


def test_figure_4_2_transfer_plan():
    """Stage 0 of p = 4, m = 8: 22 decisions, C_9 = B1, C_18 a bubble; it evicts micro-batch 1
    during F2, then 3 and 5 in the steady phase, and loads each back before its backward."""
    computation = bp.computation_schedule(4, 8, 0)
    assert len(computation) == 22
    assert computation[9] == Op("B", 1, 0) and computation[18] is None
    plan = bp.transfer_plan(4, 0, 8, computation)
    assert {i: t for i, t in enumerate(plan) if t} == {
        2: ("EVICT", 1), 7: ("EVICT", 3), 8: ("LOAD", 1), 11: ("EVICT", 5), 12: ("LOAD", 3),
        16: ("LOAD", 5)}


@pytest.mark.parametrize("D,N", SIZES)
def test_bpipe_balances_memory(D, N):
    plain = simulate(schedule("1f1b", D, N))
    balanced = simulate(schedule("bpipe", D, N))
    assert max(balanced.peak_activations) == f.bpipe_limit(D)
    assert max(plain.peak_activations) > f.bpipe_limit(D)
    assert balanced.makespan == plain.makespan  # transfers overlap the computation
    moving = sorted({op.stage for ops in schedule("bpipe", D, N).per_device for op in ops
                     if op.kind == "EVICT"})
    assert moving == bp.evictors(D) == f.bpipe_evictors(D)
    for s in moving:
        ops = schedule("bpipe", D, N).per_device[s]
        evicts = [op for op in ops if op.kind == "EVICT"]
        assert all(op.peer == D - s - 1 for op in evicts)
        assert sorted(op.microbatch for op in evicts) == sorted(
            op.microbatch for op in ops if op.kind == "LOAD")
        # each load comes before its backward
        for op in evicts:
            assert ops.index(Op("LOAD", op.microbatch, s, D - s - 1)) < ops.index(
                Op("B", op.microbatch, s))


def test_every_op_waits_for_its_inputs_and_devices_run_one_at_a_time():
    for kind in ("gpipe", "1f1b", "interleaved", "bitpipe", "bpipe"):
        plan = schedule(kind, 4, 8, chunks=2)
        result = simulate(plan)
        end = {(op.kind, op.microbatch, op.stage): e for _, op, _, e in result.timeline}
        for d in range(plan.devices):
            rows = result.device_timeline(d)
            assert all(a[2] <= b[1] for a, b in zip(rows, rows[1:]))
        for _, op, start, _ in result.timeline:
            if op.kind == "F" and op.stage:
                assert start >= end["F", op.microbatch, op.stage - 1]
            if op.kind == "B":
                assert start >= end["F", op.microbatch, op.stage]
                if op.stage < plan.num_stages - 1:
                    assert start >= end["B", op.microbatch, op.stage + 1]


def test_a_deadlocking_order_is_reported():
    good = schedule("gpipe", 2, 1)
    swapped = ((Op("B", 0, 0), Op("F", 0, 0)), good.per_device[1])
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(Schedule("gpipe", 2, 1, 1, good.routes, swapped))


def test_a_missing_or_misplaced_op_is_rejected():
    good = schedule("gpipe", 2, 1)
    with pytest.raises(ValueError, match="appears 0 times"):
        Schedule("gpipe", 2, 1, 1, good.routes, (good.per_device[0][:1], good.per_device[1]))
    with pytest.raises(ValueError, match="route says"):
        Schedule("gpipe", 2, 1, 1, good.routes, (good.per_device[1], good.per_device[0]))


def test_float_costs_are_exact_decimals():
    result = simulate(schedule("1f1b", 4, 4), forward=0.1, backward=0.2)
    assert result.makespan == Fraction(21, 10)


def test_text_chart():
    assert str(schedule("1f1b", 2, 2)) == "\n".join([
        "1f1b: 2 devices, 2 micro-batches, costs {'forward': 1, 'backward': 2}: makespan 9, "
        "bubble 1/3 (0.333)",
        "d0 |F0|F1|......B0   |...B1   |",
        "d1 |...F0|B0   |F1|B1   |......",
    ])
    chart = str(schedule("bpipe", 4, 8)).splitlines()
    assert chart[2].split() == ["e1", "e3", "l1", "e5", "l3", "l5"]
