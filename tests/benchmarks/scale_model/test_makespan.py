"""``calibrate.greedy_makespan``: its numpy rounds return the heap loop's float bit for bit."""

import heapq
import math

import numpy as np
import pytest

from benchmarks.scale_model import calibrate as C


def _heap_makespan(costs, repeats, slots):
    """The reference: each program in launch order to the SM that frees first (the code
    greedy_makespan had before its numpy rounds)."""
    heap = [0.0] * slots
    for c in costs.tolist() * repeats:
        heapq.heapreplace(heap, heap[0] + c)
    return max(heap)


@pytest.fixture
def rounds(monkeypatch):
    """The numpy rounds for any number of SMs (not only from ``_ROUNDS_MIN_SLOTS``), no memo
    left over from other tests."""
    monkeypatch.setattr(C, "_ROUNDS_MIN_SLOTS", 1)
    monkeypatch.setattr(C, "_MAKESPAN_CACHE", {})
    return monkeypatch


@pytest.mark.parametrize("costs, repeats, slots, expected", [
    ([3, 1, 1, 1, 2], 1, 3, 3.0),     # 0,0,0 -> 3 | 1 | 1 on the SM freed at 1 | 1 | 2 at 2: ends 2,3,3
    ([1, 4, 1, 1, 1, 3], 1, 2, 7.0),  # the three 1s chain on the SM free at 1 (2,3,4), the 3 starts at 4
    ([2, 1], 4, 3, 4.0),              # 2,1,2,1,2,1,2,1: every SM ends at 4
    ([1.0], 264, 132, 2.0),           # two full waves
    ([0, 0, 5], 2, 2, 5.0),           # zero costs
])
def test_hand_checked(rounds, costs, repeats, slots, expected):
    got = C.greedy_makespan(np.array(costs, dtype=float), repeats, slots)
    assert got == expected and type(got) is float


def _costs(rng, kind, n):
    if kind == "uniform":
        return rng.uniform(5e-6, 1e-3, n)
    if kind == "tiles":  # a_program + tiles * a_tile, skewed tiles, some zero
        tiles = np.floor(rng.pareto(1.2, n) * 20)
        tiles[rng.random(n) < 0.2] = 0
        return 5.4e-6 + tiles * 1.7e-7
    if kind == "ties":  # few distinct values
        return rng.choice(rng.uniform(1e-5, 1e-3, rng.integers(1, 6)), n)
    if kind == "ints":  # small integers, zeros included: exact ties everywhere
        return rng.integers(0, 4, n).astype(float)
    if kind == "spread":  # twelve orders of magnitude
        return 10.0 ** rng.uniform(-12, 3, n)
    if kind == "chains":  # short programs between long ones: long chains on one SM
        return np.where(rng.random(n) < 0.5, 1.0, 1e-9) * rng.uniform(0.5, 1.5, n)
    if kind == "zeros":
        c = np.zeros(n)
        c[rng.random(n) < 0.1] = 1.0
        return c
    if kind == "float32":
        return rng.uniform(0, 1, n).astype(np.float32)
    raise ValueError(kind)


KINDS = ["uniform", "tiles", "ties", "ints", "spread", "chains", "zeros", "float32"]


@pytest.mark.parametrize("passes", [1, 2, C._ROUND_PASSES])
def test_random_cases_match_the_heap_bit_for_bit(rounds, passes):
    """Random costs, repeats 1-40, 1-132 SMs (n just above the SMs included); with few passes
    per round many rounds go to the heap, mixing both paths in one call."""
    rounds.setattr(C, "_ROUND_PASSES", passes)
    rng = np.random.default_rng(passes)
    for case in range(300):
        slots = int(rng.choice([1, 2, 3, 7, 64, 131, 132, int(rng.integers(1, 133))]))
        repeats = int(rng.integers(1, 41))
        if case % 4 == 0:  # just above the SMs
            n = slots + int(rng.integers(1, 4))
            repeats = min(repeats, n)
            length = -(-n // repeats)
        else:
            length = int(rng.integers(1, max(2, 4000 // repeats)))
        costs = _costs(rng, KINDS[case % len(KINDS)], length)
        got = C.greedy_makespan(costs, repeats, slots)
        want = _heap_makespan(costs, repeats, slots) if length * repeats > slots else float(np.max(costs))
        assert got == want, (case, slots, repeats, length, KINDS[case % len(KINDS)])


def test_default_path_matches_the_heap(monkeypatch):
    """Without the fixture: 132 SMs take the numpy rounds, fewer than 64 the heap."""
    monkeypatch.setattr(C, "_MAKESPAN_CACHE", {})
    rng = np.random.default_rng(7)
    for slots in (132, 100, 64, 63, 16):
        for kind in KINDS:
            for repeats in (1, 4, 8, 32):
                costs = _costs(rng, kind, int(rng.integers(slots // repeats + 1, 600)))
                assert C.greedy_makespan(costs, repeats, slots) == _heap_makespan(costs, repeats, slots)


def test_negative_and_nan_costs_take_the_heap(rounds):
    rng = np.random.default_rng(3)
    costs = rng.uniform(-1, 1, 500)
    assert C.greedy_makespan(costs, 3, 132) == _heap_makespan(costs, 3, 132)
    costs[10] = np.nan
    got, want = C.greedy_makespan(costs, 1, 132), _heap_makespan(costs, 1, 132)
    assert got == want or (math.isnan(got) and math.isnan(want))


def test_memoised(rounds):
    costs = np.linspace(1e-5, 1e-4, 300)
    first = C.greedy_makespan(costs, 8, 132)
    assert C._MAKESPAN_CACHE[(costs.tobytes(), 8, 132)] == first
    assert C.greedy_makespan(costs, 8, 132) == first
