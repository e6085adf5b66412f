"""Cross-node straggler verdicts from per-rank compute medians (pure)."""

from __future__ import annotations

import statistics

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.stragglers import ComputeSample, Straggler, find_stragglers


def sample(rank: int, p50_s: float, observed: int = 20) -> ComputeSample:
    return ComputeSample(f"node{rank + 1}", rank, p50_s, observed)


def test_the_one_slow_rank_of_four_is_named_with_its_evidence() -> None:
    samples = [sample(0, 0.20), sample(1, 0.21), sample(2, 0.80), sample(3, 0.19)]
    (found,) = find_stragglers(samples, factor=1.5, min_steps=10)
    assert found == Straggler("node3", 2, 0.80, 0.20, 4.0, 20)
    assert found.detail == (
        "rank 2 computes 0.800s per step, 4.0x the other ranks' median 0.200s (median of 20 steps)"
    )


def test_ranks_within_the_factor_or_with_too_few_steps_are_not_stragglers() -> None:
    even = [sample(rank, 0.2 + rank * 0.01) for rank in range(4)]
    assert find_stragglers(even, factor=1.5, min_steps=10) == []
    young = [sample(0, 0.2), sample(1, 0.2), sample(2, 0.9, observed=9)]
    assert find_stragglers(young, factor=1.5, min_steps=10) == []
    alone = [sample(0, 0.2), sample(2, 0.9, observed=9)]
    assert find_stragglers(alone, factor=1.5, min_steps=10) == []


def test_a_tiny_absolute_difference_is_not_a_straggler() -> None:
    samples = [sample(0, 0.001), sample(1, 0.001), sample(2, 0.004)]  # 4x, but 3 ms
    assert find_stragglers(samples, factor=1.5, min_steps=10) == []


def test_with_two_ranks_the_slow_one_is_compared_with_the_other() -> None:
    (found,) = find_stragglers([sample(0, 0.1), sample(1, 0.5)], factor=1.5, min_steps=10)
    assert (found.global_rank, found.reference_s) == (1, 0.1)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=2, max_size=40))
def test_the_reference_is_the_median_of_the_other_ranks(values: list[float]) -> None:
    samples = [sample(rank, value) for rank, value in enumerate(values)]
    found = {s.global_rank: s for s in find_stragglers(samples, factor=1.5, min_steps=1)}
    for rank, value in enumerate(values):
        others = statistics.median(values[:rank] + values[rank + 1 :])
        expected = others > 0 and value > 1.5 * others and value - others >= 0.01
        assert (rank in found) is expected, (rank, value, others)
        if expected:
            assert abs(found[rank].reference_s - others) < 1e-12
