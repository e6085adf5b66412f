"""The saves of one run of a job, in closed form; pure.

Asynchronous saves as :mod:`supervisor.core.simulate` models them: every
``interval`` of training a save stalls the ranks, then writes in the
background; the checkpoint commits when the write ends, and one save is in
flight at a time. :class:`Saves` answers, for any time since the run's
first step, how long training was blocked, how many saves committed, and how
much training a fault then would replay, without stepping save by save (54
days of 16,384 GPUs hold about 14,000 saves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Saves:
    """The saves of one run, in seconds since its first step.

    Save ``k`` (from 1) is due after ``interval`` of training since the run
    started or since the previous save's stall ended; training then blocks for
    ``first_block`` (save 1) or ``block`` (later saves: the stall plus the
    wait for the previous write, if any). The state of the step reached when
    the save is due is what commits, ``write`` after the block ends.
    """

    interval: float
    first_block: float
    block: float
    write: float

    @classmethod
    def of(cls, interval: float, stall: float, write: float) -> Saves:
        """Saves every ``interval``, each stalling ``stall`` then writing ``write``."""
        return cls(interval, stall, stall + max(0.0, write - interval), write)

    def block_end(self, k: int) -> float:
        """When save ``k``'s block ends (0 for k = 0: the run's start)."""
        if k == 0:
            return 0.0
        return self.interval + self.first_block + (k - 1) * (self.interval + self.block)

    def due(self, k: int) -> float:
        """When save ``k`` is due: its step's state is what it saves."""
        return self.block_end(k - 1) + self.interval

    def blocks_ended(self, t: float) -> int:
        """How many blocks have ended by ``t``."""
        first = self.interval + self.first_block
        if t < first:
            return 0
        return 1 + math.floor((t - first) / (self.interval + self.block))

    def stalled(self, t: float) -> float:
        """Seconds training was blocked in ``[0, t]``."""
        k = self.blocks_ended(t)
        whole = 0.0 if k == 0 else self.first_block + (k - 1) * self.block
        current = self.first_block if k == 0 else self.block
        return whole + min(max(0.0, t - self.due(k + 1)), current)

    def committed(self, t: float) -> int:
        """How many saves have committed by ``t`` (their writes ended)."""
        return self.blocks_ended(t - self.write) if t >= self.write else 0

    def lost(self, t: float, committed: int | None = None) -> float:
        """Training after the newest committed save's step, up to ``t``: replayed on resume.

        ``committed`` names that save when the caller knows it (``t`` is its
        commit, where rounding could put ``t`` a hair before it).
        """
        k = self.committed(t) if committed is None else committed
        since = self.due(k) if k else 0.0
        return (t - since) - (self.stalled(t) - self.stalled(since))

    def first_commit_after(self, t: float) -> tuple[int, float]:
        """The first save committing at or after ``t``, and when it commits."""
        first = self.interval + self.first_block + self.write
        k = 1 if t <= first else 1 + math.ceil((t - first) / (self.interval + self.block))
        return k, self.block_end(k) + self.write
