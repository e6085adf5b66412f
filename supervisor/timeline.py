"""A job's timeline from the store, for goodput accounting and the MTBF estimate.

:func:`timeline_of` turns what the store recorded about one job (its
decisions, attempts, progress samples, checkpoints and save statistics) into
the :class:`~supervisor.goodput.Fact` list that the pure
:func:`~supervisor.goodput.account` walks. The mapping:

- the job's registration is QUEUED; a decision out of ``submitted`` or
  ``requeued`` into ``starting``/``running`` is ALLOCATED; a decision into
  ``requeued`` is QUEUED again;
- a decision from a live state into ``recovering`` is the fault's
  DETECTED, with the cause of that decision or of the next one that names a
  cause (an exit evidence window names it when it closes); the FAULT itself
  is dated at the last progress sample before it;
- every attempt after the first is RESUMED from its checkpoint's step (0
  without one), at the attempt's start;
- progress samples are STEP, ``checkpoint_stats`` observations SAVE_STALL;
- a terminal decision is ENDED; a job still running is accounted up to now.

Reads only; the daemon calls it for ``resurgo status``, metrics and the MTBF.
"""

from __future__ import annotations

from pathlib import Path

from agent.checkpoint.format import parse_step_dir_name
from supervisor.goodput import Fact, FactKind, Goodput, account
from supervisor.model import NODE_FAULT_CAUSES
from supervisor.store import DecisionRow, Store

CHECKPOINT_STATS_KIND = "checkpoint_stats"
_LIVE = {"starting", "running", "relaunching"}
_TERMINAL = {"completed", "failed", "cancelled"}
_NODE_FAULTS = frozenset(cause.value for cause in NODE_FAULT_CAUSES)


def timeline_of(store: Store, job_id: str, now_s: float) -> list[Fact]:
    """The job's facts, oldest first (see the module docstring)."""
    row = store.get_job(job_id)
    if row is None:
        return []
    facts = [Fact(row.created_s, FactKind.QUEUED)]
    decisions = store.decisions_for(job_id)
    progress = store.progress_for(job_id)
    ended = False
    for index, decision in enumerate(decisions):
        source, target, t = decision.from_state, decision.to_state, decision.decided_s
        if source in ("submitted", "requeued") and target in ("starting", "running"):
            facts.append(Fact(t, FactKind.ALLOCATED))
        elif target == "requeued" and source != "requeued":
            facts.append(Fact(t, FactKind.QUEUED))
        elif source in _LIVE and target == "recovering":
            cause = _cause_from(decisions[index:])
            before = [p.time_s for p in progress if p.time_s <= t]
            if before:
                facts.append(Fact(before[-1], FactKind.FAULT, cause=cause))
            facts.append(Fact(t, FactKind.DETECTED, cause=cause))
        if target in _TERMINAL and not ended:
            facts.append(Fact(t, FactKind.ENDED))
            ended = True
    for attempt in store.attempts_for(job_id)[1:]:
        step = None
        if attempt.resumed_from is not None:
            step = parse_step_dir_name(Path(attempt.resumed_from).name)
        facts.append(Fact(attempt.started_s, FactKind.RESUMED, float(step or 0)))
    facts.extend(Fact(p.time_s, FactKind.STEP, float(p.step)) for p in progress)
    for event in store.events_for(job_id, kinds=[CHECKPOINT_STATS_KIND]):
        facts.append(Fact(event.time_s, FactKind.SAVE_STALL, float(event.payload["stall_s"])))
    if not ended:
        facts.append(Fact(max(now_s, facts[-1].time_s), FactKind.ENDED))
    return sorted(facts, key=lambda fact: fact.time_s)


def _cause_from(decisions: list[DecisionRow]) -> str:
    for decision in decisions:
        if decision.cause not in ("none", ""):
            return str(decision.cause)
    return "unknown"


def goodput_of(store: Store, job_id: str, now_s: float) -> Goodput:
    """The job's goodput so far."""
    return account(timeline_of(store, job_id, now_s))


def node_faults(store: Store) -> list[float]:
    """When Resurgo decided a node was at fault, across all jobs (for the MTBF)."""
    times = []
    for job in store.list_jobs():
        decisions = store.decisions_for(job.job_id)
        for index, decision in enumerate(decisions):
            opened = decision.from_state in _LIVE and decision.to_state == "recovering"
            if opened and _cause_from(decisions[index:]) in _NODE_FAULTS:
                times.append(decision.decided_s)
    return times
