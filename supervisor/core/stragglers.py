"""Stragglers across nodes: the rank whose own compute time stands out from the job's.

In synchronous training every rank's step lasts as long as the slowest
rank's: the fast ranks wait for it in the collective, so step times are the
same everywhere and no node agent can see which rank is slow. What differs is
the time each rank works before it waits: ranks measure it around their
forward and backward (:meth:`agent.train.session.TrainingSession.compute`),
agents send its median per rank in their heartbeat reports, and this module
compares every rank's median with the job's. Pure: values in, verdicts out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import msgspec

# A rank must be this much slower in absolute terms too: two ranks that take
# 1 ms and 2 ms are twice as slow but cost the job nothing.
MIN_EXCESS_S = 0.01


class ComputeSample(msgspec.Struct, frozen=True, gc=False):
    """What one heartbeat said of one rank: the median of its last ``observed`` compute times.

    Thousands a second on a large cluster: untracked by the garbage collector
    (``gc=False``; it holds no container), as :class:`~supervisor.core.hang_hold.Heard`.
    """

    node: str
    global_rank: int
    p50_s: float
    observed: int


@dataclass(frozen=True)
class Straggler:
    """Rank ``global_rank`` on ``node`` computes ``ratio`` x the other ranks' median."""

    node: str
    global_rank: int
    p50_s: float
    reference_s: float
    ratio: float
    observed: int

    @property
    def detail(self) -> str:
        """The evidence in words, for the alert and the drain reason."""
        return (
            f"rank {self.global_rank} computes {self.p50_s:.3f}s per step, {self.ratio:.1f}x "
            f"the other ranks' median {self.reference_s:.3f}s (median of {self.observed} steps)"
        )


def find_stragglers(
    samples: Iterable[ComputeSample], *, factor: float, min_steps: int
) -> list[Straggler]:
    """Ranks whose median compute time exceeds ``factor`` x the median of every other rank's.

    Only ranks with at least ``min_steps`` measured steps take part, and at
    least two must. The excess must also be at least :data:`MIN_EXCESS_S`.
    ``O(n log n)`` in the ranks: one sort, then each rank's "median of the
    others" is read off the sorted list.
    """
    usable = sorted(
        (sample for sample in samples if sample.observed >= min_steps),
        key=lambda sample: (sample.p50_s, sample.global_rank),
    )
    if len(usable) < 2:
        return []
    values = [sample.p50_s for sample in usable]
    found = []
    for index, sample in enumerate(usable):
        reference = _median_without(values, index)
        if reference <= 0:
            continue
        if sample.p50_s > factor * reference and sample.p50_s - reference >= MIN_EXCESS_S:
            found.append(
                Straggler(
                    sample.node,
                    sample.global_rank,
                    sample.p50_s,
                    reference,
                    sample.p50_s / reference,
                    sample.observed,
                )
            )
    return sorted(found, key=lambda straggler: straggler.global_rank)


def _median_without(ordered: list[float], skip: int) -> float:
    """The median of ``ordered`` (sorted, at least 2 values) without the value at ``skip``."""

    def at(position: int) -> float:
        return ordered[position if position < skip else position + 1]

    remaining = len(ordered) - 1
    middle = remaining // 2
    if remaining % 2:
        return at(middle)
    return (at(middle - 1) + at(middle)) / 2
