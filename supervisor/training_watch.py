"""One job's training-health watch: the step reports in, a settled anomaly out; no I/O.

The intake feeds every ``step_losses`` event of the job's current attempt to
its :class:`JobWatch`, which runs :class:`~supervisor.core.anomaly.LossWatch`
over them. An anomaly is not handed on at once: which ranks went bad AT the
onset step tells a node's fault from the data's, and the other ranks' reports
of that step may still be on their way (each node's agent sends its batch at
its own heartbeat). The anomaly settles when every rank that reports has reported the
onset step (as many ranks as reported in any attempt, up to the attempt's
world), or ``settle_s`` after it was found, or
when a rank of the attempt exits (a script that raises on a NaN). Then
``nodes`` names the nodes whose ranks alone were bad at the onset; it stays
empty when every node's were, or when fewer than two nodes report (a job
whose rank 0 alone reports its all-reduced loss cannot tell nodes apart).
A rank's own loss speaks first: a grad norm taken after the gradients'
all-reduce goes bad on every rank at the same step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from supervisor.core.anomaly import Anomaly, LossWatch, StepSignal, WatchPolicy
from supervisor.core.observations import TrainingAnomaly

# How long an anomaly waits for the other ranks' reports of its onset step:
# two heartbeat reports of the agents (5 s apart by default).
SETTLE_S = 10.0


def signals(rank: int, steps: list[dict[str, Any]]) -> list[StepSignal]:
    """A ``step_losses`` payload's steps as the detector's signals; a non-finite value
    travels as null with ``non_finite`` (``grad_non_finite``) naming it."""
    return [
        StepSignal(
            rank,
            int(entry["step"]),
            _value(entry.get("loss"), entry.get("non_finite")),
            _value(entry.get("grad_norm"), entry.get("grad_non_finite")),
        )
        for entry in steps
    ]


def _value(value: Any, non_finite: Any) -> float | None:
    if isinstance(non_finite, str):
        return float(non_finite)  # "nan", "inf", "-inf"
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


@dataclass
class _Pending:
    first: Anomaly
    found_s: float
    # rank -> (its earliest bad step, found in its loss there)
    onsets: dict[int, tuple[int, bool]] = field(default_factory=dict)


@dataclass
class JobWatch:
    """The detector of one job and what it needs to settle an anomaly (see the module)."""

    policy: WatchPolicy
    settle_s: float = SETTLE_S
    attempt: int | None = None
    detector: LossWatch = field(init=False)
    # this attempt's reporting ranks: rank -> (node, newest step)
    ranks: dict[int, tuple[str, int]] = field(default_factory=dict)
    cursors: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (step, cursor)
    onset_cursor: dict[tuple[int, int], int] = field(default_factory=dict)
    batch: int | None = None
    pending: _Pending | None = None
    # The most ranks that reported in one attempt so far, and the ranks the
    # current attempt runs: a launch that resumes right before the onset has
    # its first reports be the anomaly, before its other ranks were heard.
    most_reporters: int = 0
    world_ranks: int | None = None
    # (attempt, kind) already handed on: a NaN stays in the parameters and every
    # later step reports one; the attempt's first anomaly of a kind is the news.
    handed: set[tuple[int, str]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.detector = LossWatch(self.policy)

    def feed(
        self,
        attempt: int,
        node: str,
        rank: int,
        steps: list[dict[str, Any]],
        now_s: float,
        world_ranks: int | None = None,
    ) -> TrainingAnomaly | None:
        """One rank's reported steps of ``attempt`` (the job's current one, of
        ``world_ranks`` ranks); an anomaly once it settles."""
        if attempt != self.attempt:
            self.attempt, self.ranks, self.pending = attempt, {}, None
        self.world_ranks = world_ranks
        for entry in steps:
            self._note_cursor(rank, entry)
        found = self.detector.feed(signals(rank, steps))
        if steps:
            self.ranks[rank] = (node, max(int(entry["step"]) for entry in steps))
            self.most_reporters = max(self.most_reporters, len(self.ranks))
        if found is not None and (attempt, found.kind.value) not in self.handed:
            if self.pending is None:
                self.pending = _Pending(found, now_s)
            onsets = self.pending.onsets
            known = onsets.get(rank)
            if known is None or found.onset_step < known[0]:
                onsets[rank] = (found.onset_step, found.on_loss)
            first = self.pending.first
            if (found.onset_step, not found.on_loss) < (first.onset_step, not first.on_loss):
                self.pending.first = found  # the earliest; at one step, a loss's word first
        return self.due(now_s)

    def due(self, now_s: float, force: bool = False) -> TrainingAnomaly | None:
        """The pending anomaly once settled (every rank reported its onset, ``settle_s``
        passed, or ``force``: a rank of the attempt exited); else None."""
        pending = self.pending
        if pending is None or self.attempt is None:
            return None
        onset = pending.first.onset_step
        expected = min(self.most_reporters, self.world_ranks or self.most_reporters)
        reported = len(self.ranks) >= expected and all(
            step >= onset for _, step in self.ranks.values()
        )
        if not (force or reported or now_s - pending.found_s >= self.settle_s):
            return None
        self.pending = None
        self.handed.add((self.attempt, pending.first.kind.value))
        bad = sorted(rank for rank, (step, _) in pending.onsets.items() if step == onset)
        # A grad norm taken after the all-reduce goes bad on every rank at once: the
        # ranks whose own loss went bad at the onset are the ones that name a node.
        by_loss = [rank for rank in bad if pending.onsets[rank][1]]
        named = by_loss or bad
        nodes = sorted({self.ranks[rank][0] for rank in named if rank in self.ranks})
        every = {node for node, _ in self.ranks.values()}
        if len(every) < 2 or set(nodes) == every:
            nodes = []
        first = pending.first
        return TrainingAnomaly(
            kind=first.kind.value,
            onset_step=onset,
            attempt=self.attempt,
            ranks=tuple(bad),
            nodes=tuple(nodes),
            cursor=self.onset_cursor.get((first.rank, onset)),
            batch=self.batch,
            detail=first.detail,
        )

    def _note_cursor(self, rank: int, entry: dict[str, Any]) -> None:
        """Keep each step's cursor (for the onset's) and the global batch size: the
        smallest positive cursor step between consecutive steps (a skip is larger)."""
        cursor, step = entry.get("cursor"), int(entry["step"])
        if not isinstance(cursor, int) or isinstance(cursor, bool):
            return
        self.onset_cursor[(rank, step)] = cursor
        if len(self.onset_cursor) > 4 * max(1, len(self.ranks)) * self.policy.window:
            # Only recent steps can be an onset: drop the oldest half.
            for key in sorted(self.onset_cursor, key=lambda k: k[1])[: len(self.onset_cursor) // 2]:
                del self.onset_cursor[key]
        last = self.cursors.get(rank)
        if last is not None and step == last[0] + 1 and cursor > last[1]:
            diff = cursor - last[1]
            self.batch = diff if self.batch is None else min(self.batch, diff)
        self.cursors[rank] = (step, cursor)
