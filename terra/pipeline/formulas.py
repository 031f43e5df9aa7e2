"""The papers' closed forms for bubble ratios and held activations, as exact fractions.

``D`` devices (pipeline stages), ``N`` micro-batches per step, ``v`` chunks per device. Kept in
one place so the tests and ``python -m benchmarks.pipeline`` compare the simulator with the same
expressions the papers print.
"""

from __future__ import annotations

import math
from fractions import Fraction as F


def gpipe(D, N):
    """GPipe and 1F1B alike: (D-1) / (N+D-1), whatever the forward and backward costs."""
    return F(D - 1, N + D - 1)


def interleaved(D, N, v):
    """Megatron-LM's interleaved 1F1B: the bubble shrinks by v, (D-1) / (vN+D-1)."""
    return F(D - 1, v * N + D - 1)


def twobp_table1(N):
    """2BP's Table 1 with N pipeline processes and forward = p1 = p2: (without, with) 2BP.

    GPipe and 1F1B-1 run N micro-batches, 1F1B-2 runs 2N.
    """
    return {"gpipe": (F(N - 1, 2 * N - 1), F(2 * (N - 1), 2 * (N - 1) + 3 * N)),
            "1f1b-1": (F(N - 1, 2 * N - 1), F(N - 1, N - 1 + 3 * N)),
            "1f1b-2": (F(N - 1, 3 * N - 1), F(N - 1, N - 1 + 6 * N))}


def twobp_table1_runs(N):
    """What each row of 2BP's Table 1 runs: (schedule without 2BP, with 2BP, micro-batches)."""
    return {"gpipe": ("gpipe", "2bp-gpipe", N), "1f1b-1": ("1f1b", "2bp-1f1b", N),
            "1f1b-2": ("1f1b", "2bp-1f1b", 2 * N)}


def twobp_gpipe(D, N):
    """2BP on GPipe for any N (Table 1's row is N = D): every p2 waits for the last p1."""
    return F(2 * (D - 1), 2 * (D - 1) + 3 * N)


def twobp_1f1b(D, N):
    """2BP on 1F1B for any N (Table 1's rows are N = D and N = 2D): one (D-1) fill remains."""
    return F(D - 1, D - 1 + 3 * N)


def bitpipe(D, N):
    """BitPipe as its paper derives it from Figure 3: (D-2) / (3N+D-2), backward = 2 forward."""
    return F(D - 2, 3 * N + D - 2)


def bitpipe_early_forwarding(D, N):
    """BitPipe with the early forwarding of its Appendix B: (D-2) / (4N+D-2)."""
    return F(D - 2, 4 * N + D - 2)


def one_f_one_b_held(p, s, m):
    """Micro-batches 1F1B's stage s of p holds at most: min(p - s, m)."""
    return min(p - s, m)


def bpipe_limit(p):
    """BPipe's balanced bound on every stage, ceil((p+2)/2)."""
    return math.ceil(F(p + 2, 2))


def bpipe_evictors(p):
    """Stages that evict under BPipe: s <= floor((p-4)/2) (none below p = 4)."""
    return list(range((p - 4) // 2 + 1)) if p >= 4 else []
