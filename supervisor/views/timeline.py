"""A job's timeline from the store, for goodput accounting and the MTBF estimate.

:func:`timeline_of` turns what the store recorded about one job (its
decisions, attempts, progress samples, checkpoints and save statistics) into
the :class:`~supervisor.core.goodput.Fact` list that the pure
:func:`~supervisor.core.goodput.account` walks. The mapping:

- the job's registration is QUEUED; a decision out of ``submitted`` or
  ``requeued`` into ``starting``/``running`` is ALLOCATED; a decision into
  ``requeued`` is QUEUED again;
- a decision from a live state into ``recovering`` (or straight into
  ``requeued``: a requeue Slurm made that the supervisor adopted), unless that
  recovery ends the job ``completed`` (a clean end), is the fault's
  DETECTED, with the cause of that decision or of the next one that names a
  cause (an exit evidence window names it when it closes); the FAULT itself
  is dated at the last progress sample before it;
- every attempt after the first is RESUMED from its checkpoint's step, at the
  attempt's start; without one of ours, from the attempt's first progress
  sample (a script that keeps its own checkpoint resumes from it; 0: it
  started over);
- progress samples are STEP, ``checkpoint_stats`` observations SAVE_STALL;
- a terminal decision is ENDED; a job still running is accounted up to now.

Reads only; the daemon calls it for ``resurgo status`` and the MTBF. The
metrics keep a :class:`JobTimeline` per job, which reads only what is new at
each scrape, and keep its :meth:`~JobTimeline.summary` in the store, so that a
restarted supervisor's first scrape goes on from there instead of walking
every job's whole history again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from agent.checkpoint.layouts import step_in_path
from supervisor.core.goodput import (
    STILL_RUNNING,
    Accountant,
    Fact,
    FactKind,
    Goodput,
    RecoveryDurations,
    account,
)
from supervisor.core.model import NODE_FAULT_CAUSES
from supervisor.store import DecisionRow, JobRow, ProgressRow, Store

CHECKPOINT_STATS_KIND = "checkpoint_stats"
_LIVE = {"starting", "running", "relaunching"}
_TERMINAL = {"completed", "failed", "cancelled"}
_NODE_FAULTS = frozenset(cause.value for cause in NODE_FAULT_CAUSES)
# The format of JobTimeline.summary(). A summary of another format is not read (the
# job's history is walked again, once): raise it whenever what a summary holds, or
# the accounting that made it, changes.
SUMMARY_VERSION = 1


def timeline_of(store: Store, job_id: str, now_s: float) -> list[Fact]:
    """The job's facts, oldest first (see the module docstring)."""
    row = store.get_job(job_id)
    if row is None:
        return []
    window = _Window(-math.inf, math.inf, None, False)
    facts, _, _ = _facts_in(store, row.job_id, row.created_s, window)
    if not any(fact.kind is FactKind.ENDED for fact in facts):
        facts.append(Fact(max(now_s, facts[-1].time_s), FactKind.ENDED, cause=STILL_RUNNING))
    return sorted(facts, key=lambda fact: fact.time_s)


@dataclass(frozen=True)
class _Window:
    """Facts dated in ``(after_s, upto_s]``; what came before it that the facts depend on."""

    after_s: float
    upto_s: float
    last_progress_s: float | None  # the newest progress sample at or before ``after_s``
    ended: bool  # a terminal decision at or before ``after_s``
    stats_seq: int = 0  # save statistics up to this event seq were read (all dated <= after_s)


def _facts_in(
    store: Store, job_id: str, created_s: float, window: _Window
) -> tuple[list[Fact], list[ProgressRow], int]:
    """The facts dated in the window (unsorted), the progress rows read after it starts,
    and the seq of the last save statistics dated in it."""

    def inside(t: float) -> bool:
        return window.after_s < t <= window.upto_s

    facts = [Fact(created_s, FactKind.QUEUED)] if inside(created_s) else []
    since = None if math.isinf(window.after_s) else window.after_s
    decisions = store.decisions_for(job_id, after_s=since)
    read = [p for p in store.progress_for(job_id, since_s=since) if p.time_s > window.after_s]
    progress = [p for p in read if p.time_s <= window.upto_s]
    ended = window.ended
    for index, decision in enumerate(decisions):
        source, target, t = decision.from_state, decision.to_state, decision.decided_s
        if not inside(t):
            continue
        if source in ("submitted", "requeued") and target in ("starting", "running"):
            facts.append(Fact(t, FactKind.ALLOCATED))
        elif (
            source in _LIVE
            and target in ("recovering", "requeued")
            # not a recovery whose exit window found a clean end (ranks dead in teardown)
            and not (target == "recovering" and _ends_completed(decisions[index + 1 :]))
        ):
            # A recovery, or a requeue Slurm made itself that the supervisor adopted
            # (preemption, the driver's own requeue at a time limit): a restart either way.
            cause = _cause_from(decisions[index:])
            before = [p.time_s for p in progress if p.time_s <= t]
            fault_s = before[-1] if before else window.last_progress_s
            if fault_s is not None:
                facts.append(Fact(fault_s, FactKind.FAULT, cause=cause))
            facts.append(Fact(t, FactKind.DETECTED, cause=cause))
        if target == "requeued" and source != "requeued":
            facts.append(Fact(t, FactKind.QUEUED))
        if target in _TERMINAL and not ended:
            facts.append(Fact(t, FactKind.ENDED))
            ended = True
    for attempt in store.relaunches_for(job_id, started_after_s=window.after_s):
        if not inside(attempt.started_s):
            continue
        step = None if attempt.resumed_from is None else step_in_path(attempt.resumed_from)
        if step is None:
            # No checkpoint chosen, or one whose name gives no step (a script's ckpt.pt):
            # the script resumed where its first step report after the start says (0:
            # it started over).
            first = store.first_progress_after(job_id, attempt.started_s)
            step = None if first is None else first.step
        facts.append(Fact(attempt.started_s, FactKind.RESUMED, float(step or 0)))
    facts.extend(Fact(p.time_s, FactKind.STEP, float(p.step)) for p in progress)
    stats_seq = window.stats_seq
    for event in store.events_for(job_id, window.stats_seq, kinds=[CHECKPOINT_STATS_KIND]):
        if event.time_s > window.upto_s:
            break  # recorded in order: the rest is newer still
        stats_seq = event.seq
        if inside(event.time_s):
            facts.append(Fact(event.time_s, FactKind.SAVE_STALL, float(event.payload["stall_s"])))
    return facts, read, stats_seq


class JobTimeline:
    """One job's goodput and recovery durations, kept up to date a window at a time.

    :func:`timeline_of` walks a job's whole history; a scrape every 15 s of a
    week-long job would walk it again each time. :meth:`advance` reads only
    what is newer than the last call and feeds it to a
    :class:`~supervisor.core.goodput.Accountant`. Facts dated within ``settle_s``
    of now wait for the next call, so a row written a moment late is never
    skipped; a fault's cause is the one known when its window is read, and so is
    whether its exit window ended the job completed (a clean end, no fault). A
    resume whose step only its first step report says (no step in its
    checkpoint's name) waits, with everything after it, until that report came
    (or the job ended): read before, it would be a resume from step 0 for good.

    :meth:`summary` is what was fed so far, a small document of its own size
    whatever the history's; :meth:`from_summary` goes on from it, reading only
    what is dated after it (and, once, at the next resume, the steps and save
    stalls of the run the resume ends: the work it lost).
    """

    def __init__(self, job_id: str, *, settle_s: float = 5.0) -> None:
        self.job_id = job_id
        self.settle_s = settle_s
        self.accountant = Accountant()
        self.durations = RecoveryDurations()
        self.latest_step: int | None = None
        self._window = _Window(-math.inf, -math.inf, None, False)

    @classmethod
    def from_summary(
        cls, job_id: str, summary: Mapping[str, Any], *, settle_s: float = 5.0
    ) -> JobTimeline:
        """The timeline as it was when :meth:`summary` made ``summary``.

        ValueError: a document of another :data:`SUMMARY_VERSION`, or none at all.
        """
        timeline = cls(job_id, settle_s=settle_s)
        try:
            if summary["version"] != SUMMARY_VERSION:
                raise ValueError(
                    f"format {summary['version']!r}, this Resurgo reads {SUMMARY_VERSION}"
                )
            window = summary["window"]
            upto_s = float(window["upto_s"])
            last_progress_s = window["last_progress_s"]
            timeline._window = _Window(
                upto_s,
                upto_s,
                None if last_progress_s is None else float(last_progress_s),
                bool(window["ended"]),
                int(window["stats_seq"]),
            )
            latest = summary["latest_step"]
            timeline.latest_step = None if latest is None else int(latest)
            timeline.accountant = Accountant.restored(summary["accountant"], upto_s)
            timeline.durations = RecoveryDurations.restored(summary["durations"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"job {job_id}: not a timeline summary: {error}") from error
        return timeline

    @property
    def upto_s(self) -> float | None:
        """Every fact dated up to here was fed; None before the first :meth:`advance`."""
        return None if math.isinf(self._window.after_s) else self._window.after_s

    def summary(self) -> dict[str, Any] | None:
        """What was fed so far, as a JSON document for :meth:`from_summary`; None before
        the first :meth:`advance` (nothing to keep)."""
        window = self._window
        if math.isinf(window.after_s):
            return None
        return {
            "version": SUMMARY_VERSION,
            "window": {
                "upto_s": window.after_s,
                "last_progress_s": window.last_progress_s,
                "ended": window.ended,
                "stats_seq": window.stats_seq,
            },
            "latest_step": self.latest_step,
            "accountant": self.accountant.summary(),
            "durations": self.durations.summary(),
        }

    def advance(self, store: Store, now_s: float, row: JobRow | None = None) -> None:
        """Feed the facts dated up to ``now_s - settle_s`` that were not fed yet
        (``row``: the job's row, when the caller has just read it)."""
        row = store.get_job(self.job_id) if row is None else row
        if row is None:
            return
        upto_s = self._until_resume_known(store, row, now_s - self.settle_s)
        if upto_s <= self._window.after_s:
            return
        window = replace(self._window, upto_s=upto_s)
        facts, read, stats_seq = _facts_in(store, self.job_id, row.created_s, window)
        if read:
            self.latest_step = read[-1].step
        facts.sort(key=lambda fact: fact.time_s)
        for fact in facts:
            if fact.kind is FactKind.RESUMED:
                self._fill_run(store)
            self.accountant.feed(fact)
            self.durations.feed(fact)
        fed = [p.time_s for p in read if p.time_s <= upto_s]
        self._window = _Window(
            upto_s,
            upto_s,
            fed[-1] if fed else self._window.last_progress_s,
            window.ended or any(fact.kind is FactKind.ENDED for fact in facts),
            stats_seq,
        )

    def goodput(self, now_s: float) -> Goodput:
        """The goodput so far; a job that has not ended is accounted up to ``now_s``."""
        return self.accountant.goodput(None if self._window.ended else now_s)

    def _until_resume_known(self, store: Store, row: JobRow, upto_s: float) -> float:
        """``upto_s``, or just before the first attempt started after the window whose
        resume step is its first step report's while none came yet (and the job goes on)."""
        if row.state in _TERMINAL:
            return upto_s
        after_s = self._window.after_s
        for attempt in store.relaunches_for(self.job_id, started_after_s=after_s):
            if not after_s < attempt.started_s <= upto_s:
                continue
            if attempt.resumed_from is not None and step_in_path(attempt.resumed_from) is not None:
                continue
            if store.first_progress_after(self.job_id, attempt.started_s) is None:
                return math.nextafter(attempt.started_s, -math.inf)
        return upto_s

    def _fill_run(self, store: Store) -> None:
        """Read back the steps and save stalls of the current run that a timeline made
        :meth:`from_summary` was made without, for the resume about to be fed."""
        missing = self.accountant.missing_run()
        if missing is None:
            return
        from_s, upto_s = missing

        def dated(t: float) -> bool:
            return (from_s is None or from_s <= t) and t <= upto_s

        # In the order they were fed: by time, then as stored.
        progress = store.progress_for(self.job_id, since_s=from_s)
        steps = sorted(
            ((p.time_s, float(p.step)) for p in progress if dated(p.time_s)),
            key=lambda step: step[0],
        )
        stats = store.events_for(self.job_id, kinds=[CHECKPOINT_STATS_KIND])
        stalls = sorted(
            ((e.time_s, float(e.payload["stall_s"])) for e in stats if dated(e.time_s)),
            key=lambda stall: stall[0],
        )
        self.accountant.fill_run(steps, stalls)


def goodput_of(store: Store, job_id: str, now_s: float) -> Goodput:
    """The job's goodput so far."""
    return account(timeline_of(store, job_id, now_s))


def node_faults(store: Store, jobs: Sequence[JobRow] | None = None) -> list[float]:
    """When Resurgo decided a node was at fault, across all jobs (or ``jobs``, the
    store's job rows as the caller read them), for the MTBF."""
    return [
        opened_s
        for job in (store.list_jobs() if jobs is None else jobs)
        for opened_s, cause in store.recoveries_opened(job.job_id, _LIVE)
        if cause in _NODE_FAULTS
    ]


def _ends_completed(later: list[DecisionRow]) -> bool:
    """Whether the recovery that the decision before ``later`` began ends the job
    completed (the exit window found every rank had finished): no fault, no restart."""
    for decision in later:
        if decision.from_state == "recovering" and decision.to_state != "recovering":
            return decision.to_state == "completed"
    return False


def _cause_from(decisions: list[DecisionRow]) -> str:
    for decision in decisions:
        if decision.cause not in ("none", ""):
            return str(decision.cause)
    return "unknown"
