"""Goodput accounting, MTBF, the recommended interval and resume verification; pure.

Goodput is the share of wall time spent on training steps that survive into
the run's continuation. Everything else is badput, by cause:

- ``LOST_WORK``: steps computed after the checkpoint a recovery resumed from,
  up to the fault (they are recomputed: the first run's copy is waste);
- ``DETECTION``: fault -> the supervisor noticing it;
- ``RECOVERY``: detection -> the first step after the relaunch (drain,
  validation, backoff, srun, checkpoint load) less any queue wait inside it;
- ``CHECKPOINT_STALL``: training blocked on a save (outside lost work);
- ``STARTUP``: the allocation starting -> the first step of the first run;
- ``SHUTDOWN``: the last step -> the job's end (a final save, an evaluation
  after training, the processes' exit);
- ``QUEUE_WAIT``: pending in Slurm's queue (first submission and requeues).

The daemon builds the timeline from its store; nothing here reads a clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.checkpoint.interval import recommended_interval_s
from supervisor.core.intents import PushInterval


class FactKind(enum.Enum):
    """What one timeline fact records; ``value`` is the step or a duration as noted."""

    QUEUED = "queued"  # the job entered Slurm's queue
    ALLOCATED = "allocated"  # Slurm started it (an allocation exists)
    STEP = "step"  # progress sample: ``value`` = the step reached
    CHECKPOINT = "checkpoint"  # ``value`` = the committed step
    SAVE_STALL = "save_stall"  # ``value`` = seconds training blocked on a save
    FAULT = "fault"  # a fault happened (best estimate: last progress); ``cause``
    DETECTED = "detected"  # the supervisor saw the fault; ``cause``
    RESUMED = "resumed"  # relaunched from ``value`` = the checkpoint's step
    ENDED = "ended"  # the job ended (cause STILL_RUNNING: accounted up to then, running on)


# The cause of an ENDED fact that only says up to when a running job is accounted.
STILL_RUNNING = "still running"


class Badput(enum.Enum):
    """Where non-productive time went (see the module docstring)."""

    LOST_WORK = "lost_work"
    DETECTION = "detection"
    RECOVERY = "recovery"
    CHECKPOINT_STALL = "checkpoint_stall"
    STARTUP = "startup"
    SHUTDOWN = "shutdown"
    QUEUE_WAIT = "queue_wait"


@dataclass(frozen=True)
class Fact:
    """One timestamped fact of a job's timeline."""

    time_s: float
    kind: FactKind
    value: float | None = None
    cause: str | None = None


@dataclass(frozen=True)
class Goodput:
    """The accounting of one timeline: seconds productive and lost, by cause."""

    wall_s: float
    productive_s: float
    badput_s: Mapping[Badput, float]
    by_fault_cause_s: Mapping[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Productive share of wall time; 0 for an empty timeline."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _Walk:
    """Mutable state of one pass over a timeline (held by :class:`Accountant`)."""

    badput: dict[Badput, float]
    by_cause: dict[str, float]
    phase: str = "idle"  # idle, queue, startup, running, detecting, recovering
    since: float = 0.0
    fault_s: float | None = None
    cause: str = "unknown"
    steps: list[tuple[float, float]] = field(default_factory=list)  # (time, step) this run
    # False from a detection until the relaunch: a step then is the failed run's
    # (a rank that finished one more before its peers stopped), not the recovery's end.
    relaunched: bool = True
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds) this run
    last_step_s: float | None = None  # the time of the run's newest step (``steps[-1]``)
    run_from_s: float | None = None  # the run's RESUMED (None: the first run, from the start)
    # Restored from a summary: the run's steps and stalls up to here are not in
    # ``steps``/``stalls`` (the store holds them); a RESUMED needs them back first.
    missing_upto_s: float | None = None

    def charge(self, kind: Badput, seconds: float, fault: bool = False) -> None:
        seconds = max(0.0, seconds)
        self.badput[kind] += seconds
        if fault:
            self.by_cause[self.cause] = self.by_cause.get(self.cause, 0.0) + seconds


def _lost_work(walk: _Walk, resume_step: float) -> float:
    """Seconds between reaching ``resume_step`` in the failed run and the fault, less stalls.

    A resume at or past the last step the failed run reported lost nothing of
    it (a checkpoint saved at the fault's step, or steps reported late): none.
    """
    fault_s = walk.fault_s if walk.fault_s is not None else walk.since
    reached = [t for t, step in walk.steps if step >= resume_step]
    start = reached[0] if reached else fault_s
    stalled = sum(d for t, d in walk.stalls if start <= t <= fault_s)
    return max(0.0, fault_s - start - stalled)


def _end_charges(walk: _Walk, t: float, ended: bool) -> list[tuple[Badput, float, bool]]:
    """What an ENDED fact at ``t`` charges: (kind, seconds, counted for the fault's cause).
    ``ended`` False: a job still running, accounted up to ``t``; its steps go on."""
    if walk.phase == "running" and ended and walk.last_step_s is not None:
        return [(Badput.SHUTDOWN, t - walk.last_step_s, False)]
    if walk.phase in ("queue", "recovering-queue"):
        return [(Badput.QUEUE_WAIT, t - walk.since, False)]
    if walk.phase == "startup":
        return [(Badput.STARTUP, t - walk.since, False)]
    if walk.phase in ("recovering", "detecting"):
        return [(Badput.RECOVERY, t - walk.since, True)]
    return []


class Accountant:
    """:func:`account` as a fold: feed facts in time order, read the goodput at any point.

    The metrics feed each job's new facts at every scrape instead of walking
    its whole history again; :meth:`goodput` with ``end_s`` accounts a job
    still running up to then without changing what was fed.
    """

    def __init__(self) -> None:
        self._walk: _Walk | None = None
        self._first_s: float | None = None
        self._last_s: float | None = None
        self._stalled_s = 0.0

    def feed(self, fact: Fact) -> None:
        """Account one fact; facts come in time order (ties keep their order)."""
        t = fact.time_s
        if self._walk is None:
            self._walk = _Walk(badput={kind: 0.0 for kind in Badput}, by_cause={}, since=t)
            self._first_s = t
        # A fault is dated at the last progress, which an earlier feed may have passed.
        self._last_s = t if self._last_s is None else max(self._last_s, t)
        walk = self._walk
        if fact.kind is FactKind.QUEUED:
            if walk.phase == "recovering":
                walk.charge(Badput.RECOVERY, t - walk.since, fault=True)
                walk.phase = "recovering-queue"
            else:
                walk.phase = "queue"
            walk.since = t
        elif fact.kind is FactKind.ALLOCATED:
            if walk.phase in ("queue", "recovering-queue"):
                walk.charge(Badput.QUEUE_WAIT, t - walk.since)
            walk.phase = "recovering" if walk.phase == "recovering-queue" else "startup"
            walk.since = t
        elif fact.kind is FactKind.STEP:
            walk.last_step_s = t
            if walk.phase == "recovering" and not walk.relaunched:
                walk.steps.append((t, fact.value or 0.0))
                return
            if walk.phase == "startup":
                walk.charge(Badput.STARTUP, t - walk.since)
            elif walk.phase == "recovering":
                walk.charge(Badput.RECOVERY, t - walk.since, fault=True)
            if walk.phase in ("startup", "recovering", "idle"):
                walk.phase, walk.since = "running", t
            walk.steps.append((t, fact.value or 0.0))
        elif fact.kind is FactKind.SAVE_STALL:
            walk.stalls.append((t, fact.value or 0.0))
            self._stalled_s += fact.value or 0.0
        elif fact.kind is FactKind.FAULT and walk.phase == "running":
            walk.phase, walk.fault_s, walk.cause = "detecting", t, fact.cause or "unknown"
        elif fact.kind is FactKind.DETECTED and walk.phase in ("running", "detecting"):
            if walk.phase == "running":  # no separate fault time: detected at once
                walk.fault_s, walk.cause = t, fact.cause or "unknown"
            walk.charge(Badput.DETECTION, t - (walk.fault_s or t), fault=True)
            walk.phase, walk.since, walk.relaunched = "recovering", t, False
        elif fact.kind is FactKind.RESUMED:
            if walk.missing_upto_s is not None:
                raise RuntimeError(
                    "a resume needs the run's steps and stalls before the summary this "
                    "accountant was restored from: pass them to fill_run() first"
                )
            walk.charge(Badput.LOST_WORK, _lost_work(walk, fact.value or 0.0), fault=True)
            walk.stalls, walk.steps, walk.fault_s, walk.relaunched = [], [], None, True
            walk.last_step_s, walk.run_from_s = None, t
        elif fact.kind is FactKind.ENDED:
            ended = fact.cause != STILL_RUNNING
            for kind, seconds, fault in _end_charges(walk, t, ended=ended):
                walk.charge(kind, seconds, fault)
            walk.phase = "idle"

    def goodput(self, end_s: float | None = None) -> Goodput:
        """The accounting so far; ``end_s``: as if the job ENDED then (a job still running)."""
        walk = self._walk
        if walk is None or self._first_s is None or self._last_s is None:
            return Goodput(0.0, 0.0, {kind: 0.0 for kind in Badput})
        badput, by_cause = dict(walk.badput), dict(walk.by_cause)
        last_s = self._last_s
        if end_s is not None:
            last_s = max(last_s, end_s)
            for kind, seconds, fault in _end_charges(walk, last_s, ended=False):
                badput[kind] += max(0.0, seconds)
                if fault:
                    by_cause[walk.cause] = by_cause.get(walk.cause, 0.0) + max(0.0, seconds)
        # Every stall is checkpoint badput; lost work left the stalls inside it out.
        badput[Badput.CHECKPOINT_STALL] = self._stalled_s
        wall = last_s - self._first_s
        productive = max(0.0, wall - sum(badput.values()))
        return Goodput(wall, productive, badput, by_cause)

    # A summary holds everything fed so far except the current run's steps and save
    # stalls, which grow with the run; only the next RESUMED reads them (its lost
    # work), so a restored accountant asks for them then (missing_run, fill_run).

    def summary(self) -> dict[str, Any]:
        """What was fed so far, as a JSON-ready document, less the current run's steps
        and save stalls (the store keeps those: an accountant :meth:`restored` from it
        names them with :meth:`missing_run`)."""
        walk = self._walk
        state = None
        if walk is not None:
            state = {
                "badput": {kind.value: seconds for kind, seconds in walk.badput.items()},
                "by_cause": dict(walk.by_cause),
                "phase": walk.phase,
                "since": walk.since,
                "fault_s": walk.fault_s,
                "cause": walk.cause,
                "relaunched": walk.relaunched,
                "last_step_s": walk.last_step_s,
                "run_from_s": walk.run_from_s,
            }
        return {
            "first_s": self._first_s,
            "last_s": self._last_s,
            "stalled_s": self._stalled_s,
            "walk": state,
        }

    @classmethod
    def restored(cls, summary: Mapping[str, Any], upto_s: float) -> Accountant:
        """An accountant that goes on from :meth:`summary`, made when every fact up to
        ``upto_s`` had been fed. It lacks the current run's steps and stalls up to
        ``upto_s`` (:meth:`missing_run`) until :meth:`fill_run` gives them.
        ValueError: not a summary."""
        accountant = cls()
        try:
            accountant._first_s = _optional(summary["first_s"])
            accountant._last_s = _optional(summary["last_s"])
            accountant._stalled_s = float(summary["stalled_s"])
            state = summary["walk"]
            if state is not None:
                accountant._walk = _Walk(
                    badput={kind: float(state["badput"][kind.value]) for kind in Badput},
                    by_cause={str(k): float(v) for k, v in state["by_cause"].items()},
                    phase=str(state["phase"]),
                    since=float(state["since"]),
                    fault_s=_optional(state["fault_s"]),
                    cause=str(state["cause"]),
                    relaunched=bool(state["relaunched"]),
                    last_step_s=_optional(state["last_step_s"]),
                    run_from_s=_optional(state["run_from_s"]),
                    missing_upto_s=upto_s,
                )
        except (KeyError, TypeError, AttributeError, ValueError) as error:
            raise ValueError(f"not a goodput summary ({error!r})") from error
        return accountant

    def missing_run(self) -> tuple[float | None, float] | None:
        """(from, up to): when the current run's steps and stalls this accountant lacks
        were dated (from None: the job's start), both ends included; None: it lacks none."""
        walk = self._walk
        if walk is None or walk.missing_upto_s is None:
            return None
        return walk.run_from_s, walk.missing_upto_s

    def fill_run(
        self, steps: Sequence[tuple[float, float]], stalls: Sequence[tuple[float, float]]
    ) -> None:
        """Give back the :meth:`missing_run` steps and stalls, each (time, value) in the
        order they were fed (by time), ahead of those fed since the summary."""
        walk = self._walk
        if walk is None or walk.missing_upto_s is None:
            raise RuntimeError("fill_run() on an accountant that lacks nothing")
        walk.steps = [*steps, *walk.steps]
        walk.stalls = [*stalls, *walk.stalls]
        walk.missing_upto_s = None


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


class RecoveryDurations:
    """Time to detect and time to recover of each recovery, fed fact by fact in time order.

    Detect: the fault (last progress) to the supervisor's detection. Recover:
    detection to the first training step after the relaunch.
    """

    def __init__(self) -> None:
        self.detect_s: list[float] = []
        self.recover_s: list[float] = []
        self._fault_s: float | None = None
        self._detected_s: float | None = None
        self._resumed = False

    def feed(self, fact: Fact) -> None:
        """Take one fact (in time order)."""
        if fact.kind is FactKind.FAULT:
            self._fault_s = fact.time_s
        elif fact.kind is FactKind.DETECTED:
            fault_s = self._fault_s
            self.detect_s.append(fact.time_s - fault_s if fault_s is not None else 0.0)
            self._detected_s, self._fault_s, self._resumed = fact.time_s, None, False
        elif fact.kind in (FactKind.RESUMED, FactKind.ALLOCATED) and self._detected_s is not None:
            self._resumed = True
        elif fact.kind is FactKind.STEP and self._detected_s is not None and self._resumed:
            self.recover_s.append(fact.time_s - self._detected_s)
            self._detected_s = None

    def summary(self) -> dict[str, Any]:
        """Everything taken so far, as a JSON-ready document (:meth:`restored` reads it)."""
        return {
            "detect_s": list(self.detect_s),
            "recover_s": list(self.recover_s),
            "fault_s": self._fault_s,
            "detected_s": self._detected_s,
            "resumed": self._resumed,
        }

    @classmethod
    def restored(cls, summary: Mapping[str, Any]) -> RecoveryDurations:
        """Durations that go on from :meth:`summary`; ValueError: not one."""
        durations = cls()
        try:
            durations.detect_s = [float(s) for s in summary["detect_s"]]
            durations.recover_s = [float(s) for s in summary["recover_s"]]
            durations._fault_s = _optional(summary["fault_s"])
            durations._detected_s = _optional(summary["detected_s"])
            durations._resumed = bool(summary["resumed"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a recovery durations summary ({error!r})") from error
        return durations


def account(timeline: Sequence[Fact]) -> Goodput:
    """Goodput and badput of a timeline (sorted by time here; ties keep their order)."""
    accountant = Accountant()
    for fact in sorted(timeline, key=lambda f: f.time_s):
        accountant.feed(fact)
    return accountant.goodput()


def mtbf_estimate(
    fault_times_s: Sequence[float], observed_span_s: float, n_nodes: int
) -> float | None:
    """Per-node MTBF in seconds: node-seconds observed per fault; None with no fault yet.

    A job on ``k`` nodes then fails every ``mtbf / k`` seconds on average (faults
    independent per node, the usual first-order model).
    """
    if observed_span_s <= 0 or n_nodes < 1:
        raise ValueError("observed span must be positive and n_nodes >= 1")
    faults = [t for t in fault_times_s if math.isfinite(t)]
    if not faults:
        return None
    return observed_span_s * n_nodes / len(faults)


def recommended_interval(save_stall_s: float, write_s: float, mtbf_s: float) -> float:
    """The checkpoint interval to push, from :mod:`agent.checkpoint.interval` (Daly).

    ``mtbf_s`` is the job's MTBF: the per-node estimate divided by its nodes.
    """
    return recommended_interval_s(save_stall_s, write_s, mtbf_s)


# Pushing a new interval for every small change in the estimate would only churn
# the agents; a change under this share keeps the current interval.
INTERVAL_CHANGE_SHARE = 0.1


def interval_push(
    job_id: str,
    attempt: int,
    current_interval_s: float | None,
    node_mtbf_s: float | None,
    n_nodes: int,
    save_stall_s: float,
    write_s: float,
) -> PushInterval | None:
    """A PushInterval when the recommended interval differs enough from the current one."""
    if node_mtbf_s is None or n_nodes < 1:
        return None  # no fault seen yet: the MTBF is unknown, keep the user's interval
    target = recommended_interval(save_stall_s, write_s, node_mtbf_s / n_nodes)
    if current_interval_s and abs(target - current_interval_s) < (
        INTERVAL_CHANGE_SHARE * current_interval_s
    ):
        return None
    return PushInterval(job_id, attempt, target)


@dataclass(frozen=True)
class VerifyResult:
    """Whether a resume reproduced the run; ``first_diverging_step`` names where it did not."""

    verified: bool
    first_diverging_step: int | None
    compared: int
    reason: str


def _same(a: float, b: float, tolerance: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b if tolerance == 0 else abs(a - b) <= tolerance


def verify_resume(
    losses_before: Mapping[int, float], losses_after: Mapping[int, float], tolerance: float = 0.0
) -> VerifyResult:
    """Compare replayed losses with those reported before the fault, step by step.

    Only steps in both are compared; none in common means nothing is verified
    (the fault hit right after the checkpoint, or the reports were lost).
    """
    if tolerance < 0 or not math.isfinite(tolerance):
        raise ValueError(f"tolerance must be finite and >= 0, got {tolerance!r}")
    common = sorted(set(losses_before) & set(losses_after))
    if not common:
        return VerifyResult(False, None, 0, "no step was both reported before and replayed")
    for step in common:
        if not _same(losses_before[step], losses_after[step], tolerance):
            return VerifyResult(
                False,
                step,
                len(common),
                f"step {step}: loss {losses_before[step]!r} before, {losses_after[step]!r} "
                "after the resume: nondeterministic resume",
            )
    return VerifyResult(True, None, len(common), f"{len(common)} replayed step(s) match")


def verify_cursor(
    checkpoint_cursor: int, first_sample_after_resume: int, step: int
) -> VerifyResult:
    """For a resized resume: the first global sample must be the checkpoint's cursor.

    ``checkpoint_cursor`` is the global consumed-sample count saved with the
    checkpoint of ``step``; the resumed run's first global sample index must
    equal it (skipping or repeating samples shows up as a difference).
    """
    if first_sample_after_resume == checkpoint_cursor:
        return VerifyResult(True, None, 1, f"resumed at global sample {checkpoint_cursor}")
    return VerifyResult(
        False,
        step,
        1,
        f"resumed at global sample {first_sample_after_resume}, checkpoint cursor "
        f"{checkpoint_cursor}: {first_sample_after_resume - checkpoint_cursor:+d} samples",
    )
