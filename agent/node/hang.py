"""Hang and straggler verdicts: pure functions of what the ranks reported and ``now``.

The node agent owns the effects (the socket, the clock, py-spy) and feeds this
module values; nothing here reads a clock or touches the OS, so every verdict
is a table test with a fixed ``NOW`` (STYLE.md §2). ``now_s`` is always the
agent's own monotonic clock: a rank's wall time never decides anything.

What the node agent calls, and when:

1. On every datagram that :func:`agent.wire.datagram.parse_datagram` decodes
   to a :class:`~agent.wire.datagram.RankBeat`:
   ``ranks[b.rank] = observe(ranks.get(b.rank), b, now_s, window=config.window)``.
   A rank is watched from its first beat on; until then (and for scripts that
   never import Resurgo) only stack sampling watches it. Drop a rank from the
   mapping when its process exits: that is an exit event, not a hang.
2. About once a second: :func:`hang_verdicts` ``(ranks, now_s, config)``, and
   :func:`local_stragglers` ``(ranks, config)`` when a summary goes up.
3. Every few tens of seconds, per rank: a :class:`StackSample` from
   :func:`agent.node.stacks.dump_stacks` (``fingerprint``, ``in_collective``); keep
   the samples since the fingerprint last changed and call
   :func:`stack_hang_verdict` with ``config.stack_timeout_s``.
4. On any hang: :func:`culprit_hints` over the hung ranks orders them for the
   supervisor's blame (behind first, then not inside the collective, then stopped first),
   given the hung ranks' ``in_collective`` from their stacks.

Progress means the step changed or the phase changed. A rank that re-sends the
same step in the same phase (a stuck loop that still beats, or a beat from a
background thread) is not making progress.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from agent.wire.datagram import Phase, RankBeat
from agent.wire.errors import ConfigError


@dataclass(frozen=True)
class HangConfig:
    """Timeouts for hang verdicts and thresholds for stragglers; seconds unless named.

    - ``floor_s``: the shortest TRAIN timeout, whatever the step times say.
    - ``k``: TRAIN timeout = max(floor_s, k x p99 of the last ``window`` step times).
    - ``init_grace_s`` / ``checkpoint_grace_s`` / ``eval_grace_s`` /
      ``data_grace_s``: the timeout in those phases. INIT's grace also covers
      TRAIN until the first step time is measured (the first steps compile,
      warm caches and spin up loaders).
    - ``busy_floor_s``: the TRAIN timeout of a rank that stopped stepping but
      keeps a core busy outside any collective (:func:`busy_share`): work the
      hooks do not see (a rank-0-only upload, a recompile) that its peers wait
      for. Such a rank is not called hung before this, whatever ``floor_s`` says.
    - ``stack_timeout_s``: how long an unchanged stack inside a collective is
      tolerated, for ranks that send no beats.
    - ``straggler_factor`` / ``straggler_min_steps``: a rank is a straggler when its
      median step time exceeds the factor x the other local ranks' median, once it
      has that many step times.
    """

    floor_s: float = 20.0
    k: float = 5.0
    window: int = 50
    init_grace_s: float = 600.0
    checkpoint_grace_s: float = 600.0
    eval_grace_s: float = 900.0
    data_grace_s: float = 600.0
    busy_floor_s: float = 60.0
    stack_timeout_s: float = 300.0
    straggler_factor: float = 1.5
    straggler_min_steps: int = 10

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("window", "straggler_min_steps"):
                minimum = 2 if f.name == "window" else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                    raise ConfigError(
                        f"hang config: {f.name} must be an int >= {minimum}, got {value!r}"
                    )
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"hang config: {f.name} must be a positive number, got {value!r}")
        if self.straggler_factor <= 1.0:
            raise ConfigError(
                f"hang config: straggler_factor must be > 1, got {self.straggler_factor!r}"
            )

    def grace_s(self, phase: Phase) -> float | None:
        """The fixed timeout of ``phase``; None for TRAIN, whose timeout adapts."""
        return {
            Phase.INIT: self.init_grace_s,
            Phase.CHECKPOINT: self.checkpoint_grace_s,
            Phase.EVAL: self.eval_grace_s,
            Phase.DATA: self.data_grace_s,
            Phase.COMPUTE: self.busy_floor_s,
        }.get(phase)


@dataclass(frozen=True)
class StepTimes:
    """The most recent step durations of one rank (seconds), at most ``window`` of them."""

    window: int = 50
    durations: tuple[float, ...] = ()

    def add(self, duration_s: float) -> StepTimes:
        """A copy with ``duration_s`` appended and the oldest beyond the window dropped."""
        return StepTimes(self.window, (*self.durations, duration_s)[-self.window :])

    @property
    def count(self) -> int:
        """How many durations are held (at most ``window``)."""
        return len(self.durations)

    @property
    def mean(self) -> float | None:
        """Mean duration, None when empty."""
        return sum(self.durations) / len(self.durations) if self.durations else None

    @property
    def p50(self) -> float | None:
        """Median duration, None when empty."""
        return self.quantile(0.5)

    @property
    def p99(self) -> float | None:
        """99th percentile (nearest rank), None when empty."""
        return self.quantile(0.99)

    def quantile(self, q: float) -> float | None:
        """Nearest-rank quantile, ``0 < q <= 1``; None when empty."""
        if not self.durations:
            return None
        ordered = sorted(self.durations)
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@dataclass(frozen=True)
class RankProgress:
    """What the agent knows about one instrumented rank; build with :func:`observe`.

    ``progress_s`` is when the step or phase last changed (and so where the
    next step-time measurement starts), ``seen_s`` when the last datagram
    arrived, ``beats`` how many arrived from this pid. ``compute_times``: the
    compute seconds the rank measured itself for its recent steps (beats that
    carry them), which the supervisor compares across nodes.
    """

    rank: int
    local_rank: int
    pid: int
    step: int
    phase: Phase
    progress_s: float
    seen_s: float
    step_times: StepTimes = field(default_factory=StepTimes)
    beats: int = 1
    compute_times: StepTimes = field(default_factory=StepTimes)
    # Beats from the bootstrap (a script that imports nothing): a stop is a
    # hang only once stacks confirm it (agent.node.watch).
    automatic: bool = False


def observe(
    previous: RankProgress | None, beat: RankBeat, now_s: float, *, window: int = 50
) -> RankProgress:
    """The rank's state after ``beat`` arrived at ``now_s`` (agent clock).

    A step time is recorded only between two TRAIN beats whose step advanced,
    divided by the steps advanced; a phase change restarts the measurement so a
    checkpoint's duration never counts as a step. A new pid is a new process:
    its history starts afresh.
    """
    if previous is None or previous.pid != beat.pid:
        return RankProgress(
            rank=beat.rank,
            local_rank=beat.local_rank,
            pid=beat.pid,
            step=beat.step,
            phase=beat.phase,
            progress_s=now_s,
            seen_s=now_s,
            step_times=StepTimes(window),
            compute_times=_with_compute(StepTimes(window), beat),
            automatic=beat.automatic,
        )
    step_changed = beat.step != previous.step
    phase_changed = beat.phase is not previous.phase
    if not step_changed and not phase_changed:
        return replace(previous, seen_s=now_s, beats=previous.beats + 1)
    step_times = previous.step_times
    if (
        beat.phase is Phase.TRAIN
        and not phase_changed
        and beat.step > previous.step
        and now_s >= previous.progress_s
    ):
        step_times = step_times.add((now_s - previous.progress_s) / (beat.step - previous.step))
    return RankProgress(
        rank=beat.rank,
        local_rank=beat.local_rank,
        pid=beat.pid,
        step=beat.step,
        phase=beat.phase,
        progress_s=now_s,
        seen_s=now_s,
        step_times=step_times,
        beats=previous.beats + 1,
        compute_times=_with_compute(previous.compute_times, beat),
        automatic=beat.automatic,
    )


def _with_compute(times: StepTimes, beat: RankBeat) -> StepTimes:
    return times if beat.compute_s is None else times.add(beat.compute_s)


class HangReason(enum.Enum):
    """Which timeout a hang verdict used."""

    FLOOR = "floor"  # TRAIN, floor_s was larger than k x p99
    ADAPTIVE = "adaptive"  # TRAIN, k x p99 step time
    INIT_GRACE = "init_grace"  # INIT, or TRAIN before any step time was measured
    CHECKPOINT_GRACE = "checkpoint_grace"
    EVAL_GRACE = "eval_grace"
    DATA_GRACE = "data_grace"
    BUSY_FLOOR = "busy_floor"  # COMPUTE: stopped stepping, busy outside any collective
    STACK_IN_COLLECTIVE = "stack_in_collective"  # uninstrumented: stack frozen in a collective


_PHASE_REASON = {
    Phase.INIT: HangReason.INIT_GRACE,
    Phase.CHECKPOINT: HangReason.CHECKPOINT_GRACE,
    Phase.EVAL: HangReason.EVAL_GRACE,
    Phase.DATA: HangReason.DATA_GRACE,
    Phase.COMPUTE: HangReason.BUSY_FLOOR,
}


@dataclass(frozen=True)
class HangVerdict:
    """Rank ``rank`` made no progress for ``since_progress_s`` > ``timeout_s``.

    ``last_step`` and ``phase`` are None for a verdict from stacks alone.
    ``detail`` says why in words, for events and logs.
    """

    rank: int
    last_step: int | None
    phase: Phase | None
    since_progress_s: float
    timeout_s: float
    reason: HangReason
    detail: str


def timeout_for(progress: RankProgress, config: HangConfig) -> tuple[float, HangReason]:
    """The timeout that applies to ``progress`` now, and which rule set it."""
    grace = config.grace_s(progress.phase)
    if grace is not None:
        return grace, _PHASE_REASON[progress.phase]
    p99 = progress.step_times.p99
    if p99 is None:
        return config.init_grace_s, HangReason.INIT_GRACE
    adaptive = config.k * p99
    if adaptive > config.floor_s:
        return adaptive, HangReason.ADAPTIVE
    return config.floor_s, HangReason.FLOOR


def hang_verdicts(
    ranks: Mapping[int, RankProgress], now_s: float, config: HangConfig
) -> list[HangVerdict]:
    """Every rank with no progress for longer than its timeout, ordered by rank."""
    verdicts = []
    for rank in sorted(ranks):
        progress = ranks[rank]
        since = now_s - progress.progress_s
        timeout, reason = timeout_for(progress, config)
        if since <= timeout:
            continue
        basis = _timeout_basis(progress, reason, config)
        verdicts.append(
            HangVerdict(
                rank=rank,
                last_step=progress.step,
                phase=progress.phase,
                since_progress_s=since,
                timeout_s=timeout,
                reason=reason,
                detail=(
                    f"rank {rank} made no progress for {since:.1f} s at step {progress.step} "
                    f"in {progress.phase.value}; timeout {timeout:.1f} s ({basis})"
                ),
            )
        )
    return verdicts


def _timeout_basis(progress: RankProgress, reason: HangReason, config: HangConfig) -> str:
    p99 = progress.step_times.p99 or 0.0
    if reason is HangReason.ADAPTIVE:
        return f"{config.k:g} x p99 step time {p99:.3f} s"
    if reason is HangReason.FLOOR:
        return f"floor; {config.k:g} x p99 step time is {config.k * p99:.1f} s"
    if reason is HangReason.INIT_GRACE and progress.phase is Phase.TRAIN:
        return "init grace: no step time measured yet"
    return f"{progress.phase.value} grace"


# A rank using at least this share of one core over the last few seconds is busy.
# A rank asleep, deadlocked on a lock or blocked on a dead peer uses next to none
# (its idle background threads); one that computes gets a tenth of a core even on
# a node with ten runnable processes per core.
BUSY_CPU_SHARE = 0.1
# Over how many seconds the share is taken (the oldest sample at least this old).
BUSY_WINDOW_S = 3.0


def busy_share(samples: Sequence[tuple[float, float]]) -> float | None:
    """The share of one core a process used lately, from ``(time_s, cpu_s)`` samples
    oldest first: over the span from the newest sample at least :data:`BUSY_WINDOW_S`
    old to the newest sample; None without such a span."""
    if len(samples) < 2:
        return None
    newest_s, newest_cpu = samples[-1]
    for time_s, cpu_s in reversed(samples):
        if newest_s - time_s >= BUSY_WINDOW_S:
            return max(0.0, newest_cpu - cpu_s) / (newest_s - time_s)
    return None


def computing(
    verdicts: Sequence[HangVerdict],
    shares: Mapping[int, float | None],
    in_collective: Mapping[int, bool],
    config: HangConfig,
) -> set[int]:
    """The ranks of ``verdicts`` that still work: busy (:data:`BUSY_CPU_SHARE`) and not
    known to wait in a collective, short of ``busy_floor_s``. A rank that waits in
    a collective may spin there (NCCL polls its stream), so it is never one."""
    return {
        verdict.rank
        for verdict in verdicts
        if verdict.since_progress_s <= config.busy_floor_s
        and in_collective.get(verdict.rank) is not True
        and (share := shares.get(verdict.rank)) is not None
        and share >= BUSY_CPU_SHARE
    }


@dataclass(frozen=True)
class StragglerVerdict:
    """Rank ``rank``'s median step time is ``ratio`` x the other local ranks' median."""

    rank: int
    median_step_s: float
    reference_s: float
    ratio: float


def local_stragglers(
    ranks: Mapping[int, RankProgress], config: HangConfig
) -> list[StragglerVerdict]:
    """Ranks whose recent median step time exceeds the factor x the others' median.

    Only ranks with at least ``straggler_min_steps`` step times take part, and a
    rank needs at least one other to be compared with. Ranks coupled by a
    collective every step finish their steps together, so their beat-to-beat
    times converge: this catches a slow rank only where steps are not coupled
    that tightly (or across jobs); the cross-node view is the supervisor's.
    """
    medians = {
        rank: median
        for rank, progress in ranks.items()
        if progress.step_times.count >= config.straggler_min_steps
        and (median := progress.step_times.p50) is not None
    }
    verdicts = []
    for rank in sorted(medians):
        others = [m for other, m in medians.items() if other != rank]
        if not others:
            continue
        reference = _median(others)
        if reference > 0 and medians[rank] > config.straggler_factor * reference:
            verdicts.append(
                StragglerVerdict(rank, medians[rank], reference, medians[rank] / reference)
            )
    return verdicts


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) / 2


@dataclass(frozen=True)
class StackSample:
    """One stack sample of a rank: when, its fingerprint, and whether it sat in a collective."""

    time_s: float
    fingerprint: str
    in_collective: bool


def stack_hang_verdict(
    samples: Sequence[StackSample], now_s: float, timeout_s: float, *, rank: int
) -> HangVerdict | None:
    """A verdict when the stack has not changed for longer than ``timeout_s`` in a collective.

    ``samples`` are one rank's, oldest first. The unchanged stretch starts at the
    oldest sample of the newest run of equal fingerprints; a single sample cannot
    show that nothing changed, so at least two are needed.
    """
    if len(samples) < 2:
        return None
    newest = samples[-1]
    if not newest.in_collective:
        return None
    since = newest.time_s
    for sample in reversed(samples):
        if sample.fingerprint != newest.fingerprint:
            break
        since = sample.time_s
    if since == newest.time_s:
        return None
    frozen_s = now_s - since
    if frozen_s <= timeout_s:
        return None
    return HangVerdict(
        rank=rank,
        last_step=None,
        phase=None,
        since_progress_s=frozen_s,
        timeout_s=timeout_s,
        reason=HangReason.STACK_IN_COLLECTIVE,
        detail=(
            f"rank {rank}'s stack has not changed for {frozen_s:.1f} s and sits in a "
            f"torch.distributed collective or wait; timeout {timeout_s:.1f} s"
        ),
    )


@dataclass(frozen=True)
class CulpritHint:
    """One hung rank, as evidence for blame: how far behind and how early it stopped."""

    rank: int
    last_step: int
    progress_s: float
    steps_behind: int
    stopped_earlier_s: float
    in_collective: bool | None


def culprit_hints(
    ranks: Mapping[int, RankProgress],
    hung: Iterable[int],
    in_collective: Mapping[int, bool] | None = None,
) -> list[CulpritHint]:
    """The hung ranks ordered most suspect first.

    In a collective hang every healthy rank waits for the culprit, so the
    culprit is the one behind (lowest step); among equals, one NOT inside the
    collective (its stack shows where it really is: beats from ranks at the
    same step differ by jitter only, a stack is stronger evidence), then the
    one that stopped first (earliest progress). ``steps_behind`` and
    ``stopped_earlier_s`` compare with the most advanced and the last-stopped of
    the hung ranks. Ranks without beats are left out.
    """
    known = [ranks[r] for r in set(hung) if r in ranks]
    if not known:
        return []
    top_step = max(p.step for p in known)
    last_progress = max(p.progress_s for p in known)
    collective = in_collective or {}

    def suspicion(p: RankProgress) -> tuple[int, bool, float, int]:
        return (p.step, collective.get(p.rank, True), p.progress_s, p.rank)

    return [
        CulpritHint(
            rank=p.rank,
            last_step=p.step,
            progress_s=p.progress_s,
            steps_behind=top_step - p.step,
            stopped_earlier_s=last_progress - p.progress_s,
            in_collective=collective.get(p.rank),
        )
        for p in sorted(known, key=suspicion)
    ]
