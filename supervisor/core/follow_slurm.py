"""Following Slurm's view of a job: its starts, its own requeues, its ends; pure.

:func:`on_job_seen` is :func:`supervisor.core.policy.decide` for a
:class:`~supervisor.core.observations.SlurmJobSeen`. The rule (DESIGN §4): Slurm
reacts to some faults by itself (a node's slurmd died under a ``--requeue``
job: Slurm requeues it); the supervisor adopts such a reaction and never
requeues on top of it. Preemption and the time limit end the allocation
through no fault of the job: requeue without blame or budget. The
supervisor's own requeues (after a fault, or to grow back onto idle nodes)
put the job in REQUEUED before Slurm shows it queued, so their sighting is
never taken for Slurm's own.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import recovery
from supervisor.core.blame import Blame
from supervisor.core.decision import LIVE, Context, Decision, decision
from supervisor.core.model import MAX_LOST_REQUEUES, Cause, JobRecord, JobState
from supervisor.core.observations import SlurmJobSeen

# Slurm job states that mean the job ended and will not come back by itself.
_SLURM_FAILED = frozenset({"FAILED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})
_SLURM_QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


def _nothing(record: JobRecord, why: str) -> Decision:
    return decision(record, (), None, why)


def on_job_seen(record: JobRecord, seen: SlurmJobSeen, ctx: Context) -> Decision:
    """The next record for a ``squeue`` sighting of the job (see the module docstring)."""
    state = seen.state.upper()
    requeued_by_slurm = seen.restart_count > record.slurm_restart_count
    counted = record.slurm_restart_count
    record = replace(
        record, slurm_restart_count=max(seen.restart_count, record.slurm_restart_count)
    )
    if state == "RUNNING":
        if record.state in (JobState.SUBMITTED, JobState.REQUEUED):
            world, spares = recovery.split_allocation(record, seen.nodes)
            started = replace(
                recovery.to_state(record, JobState.STARTING, ctx.now_s),
                nodes=world,
                spare_nodes=spares,
            )
            with_spares = f" ({len(spares)} of them spare)" if spares else ""
            return _nothing(started, f"Slurm runs it on {len(seen.nodes)} node(s){with_spares}")
        if requeued_by_slurm:
            # Slurm requeued and restarted it between two sightings (the supervisor
            # was down, or the queue wait was shorter than a poll): adopt the
            # requeue; the next sighting starts the job on its new allocation.
            return _adopt(record, seen, ctx)
        return _nothing(record, "running")
    pending = record.recovery
    # The restart count our own requeue raised, first seen now: not a requeue of Slurm's.
    ours = False
    if record.state is JobState.REQUEUED and pending is not None and not pending.requeue_seen:
        if state not in _SLURM_QUEUED and not requeued_by_slurm:
            # Our requeue may not have reached Slurm yet: an ended state from before it is stale.
            return _nothing(record, f"Slurm shows {state} from before the requeue took effect")
        ours = requeued_by_slurm
        record = replace(record, recovery=replace(pending, requeue_seen=True))
    if state in _SLURM_FAILED and (ours or not requeued_by_slurm) and _requeue_pending(record):
        # Also when the sightings missed the queued state between (a loaded
        # slurmctld, a slow poll): the first one after the requeue is its loss.
        return _requeue_lost(record, seen, ctx)
    # After `scontrol requeue` from inside the job (Lightning's auto-requeue, the
    # driver's own), Slurm 22.05 shows COMPLETING with the new restart count first.
    if state in _SLURM_QUEUED or (state == "COMPLETING" and requeued_by_slurm):
        if requeued_by_slurm and record.state not in (JobState.SUBMITTED, JobState.REQUEUED):
            return _adopt(record, seen, ctx)
        return _nothing(record, "pending in Slurm's queue")
    if state in ("PREEMPTED", "TIMEOUT") and record.state is not JobState.SUBMITTED:
        cause = Cause.PREEMPTED if state == "PREEMPTED" else Cause.TIME_LIMIT
        verdict = Blame(None, cause, 0.0, (f"Slurm: {state} {seen.reason}".strip(),))
        return _restart_requeued(record, verdict, ctx)
    if state == "NODE_FAIL":
        verdict = Blame(None, Cause.NODE_LOST, 0.0, (f"Slurm: NODE_FAIL{_because(seen)}",))
        return _restart_requeued(record, verdict, ctx)
    if state == "COMPLETED":
        done = replace(recovery.to_state(record, JobState.COMPLETED, ctx.now_s), recovery=None)
        return decision(done, (), Cause.SLURM_ENDED, "Slurm reports the job completed")
    if state == "CANCELLED":
        ended = replace(recovery.to_state(record, JobState.CANCELLED, ctx.now_s), recovery=None)
        reason = f"cancelled in Slurm{_because(seen)}"
        return decision(replace(ended, final_reason=reason), (), Cause.OPERATOR, reason)
    if state in _SLURM_FAILED:
        reason = f"Slurm ended the job: {state}{_because(seen)}"
        failed = replace(recovery.to_state(record, JobState.FAILED, ctx.now_s), recovery=None)
        return decision(replace(failed, final_reason=reason), (), Cause.SLURM_ENDED, reason)
    # Not acted on: a restart count that rose stays to be seen with the next sighting.
    return _nothing(
        replace(record, slurm_restart_count=counted), f"Slurm state {state} needs no action"
    )


def _requeue_pending(record: JobRecord) -> bool:
    """Our requeue took (Slurm showed the job queued) and the job has not run since."""
    pending = record.recovery
    return (
        record.state is JobState.REQUEUED
        and pending is not None
        and pending.requeue_seen
        and pending.validated
    )


def _requeue_lost(record: JobRecord, seen: SlurmJobSeen, ctx: Context) -> Decision:
    """Slurm ended the requeued job before it ran again (showing it queued first, or
    not: the sightings may miss that).

    Seen on Slurm 22.05: a requeue made while the batch script still ended
    (the relaunch's ``srun`` failed as the requeue landed) was reported
    PENDING, then FAILED (NonZeroExitCode): the earlier run's end overrode the
    requeue. Nothing of the job ran, so nothing concluded about it: the
    requeue is made again (``requeuehold`` brings an ended job back under the
    same id), as a new attempt so that it is a new action. A job that Slurm
    ends after :data:`MAX_LOST_REQUEUES` of them is failed, with what to do.
    """
    pending = record.recovery
    assert pending is not None
    ended = f"Slurm ended the job ({seen.state.upper()}{_because(seen)})"
    if pending.requeues_lost >= MAX_LOST_REQUEUES:
        resume = pending.resume_from or "its newest valid checkpoint"
        reason = (
            f"{ended} after each of {pending.requeues_lost + 1} requeues, before it ran "
            f"again; resubmit it with `resurgo submit` and the same --ckpt-root: it "
            f"resumes from {resume}"
        )
        failed = replace(recovery.to_state(record, JobState.FAILED, ctx.now_s), recovery=None)
        return decision(replace(failed, final_reason=reason), (), Cause.SLURM_ENDED, reason)
    again = replace(
        record,
        attempt=record.attempt + 1,
        recovery=replace(
            pending, requeue=True, requeue_seen=False, requeues_lost=pending.requeues_lost + 1
        ),
    )
    planned = recovery.relaunch(again, ctx)
    why = f"{ended} after the requeue took, before it ran again: requeue again; "
    return replace(planned, explanation=why + planned.explanation)


def _restart_requeued(record: JobRecord, verdict: Blame, ctx: Context) -> Decision:
    """Slurm ended the allocation: recover through the requeue path."""
    if record.state not in LIVE and record.state is not JobState.RECOVERING:
        return _nothing(record, f"{verdict.cause.value} while {record.state.value}: nothing runs")
    if record.state is JobState.RECOVERING and record.recovery is not None:
        return recovery.add_fault(record, ctx, verdict, requeue=True, slurm_took_it=True)
    return recovery.start(record, ctx, verdict, requeue=True)


def _adopt(record: JobRecord, seen: SlurmJobSeen, ctx: Context) -> Decision:
    """Slurm requeued the job itself: follow it into REQUEUED; never requeue on top of it."""
    preempted = "preempt" in seen.reason.lower()
    cause = Cause.PREEMPTED if preempted else Cause.SLURM_REQUEUE
    if record.time_limit_end_s is not None:
        # The driver requeued its own job before the time limit (the supervisor
        # was away or late): the planned stop, no fault.
        cause = Cause.TIME_LIMIT
    pending = record.recovery
    if (
        record.state in (JobState.RECOVERING, JobState.RELAUNCHING)
        and pending is not None
        and pending.evidence_until_s is None
    ):
        # Our own recovery of the same fault is under way: Slurm's requeue replaces
        # its relaunch, and the restart was already counted against the budget.
        adopted = replace(
            recovery.to_state(record, JobState.REQUEUED, ctx.now_s),
            nodes=(),
            spare_nodes=(),
            not_before_s=None,
            recovery=replace(
                pending, requeue=True, requeue_seen=True, slurm_requeued=_allocation(record)
            ),
        )
        return decision(
            adopted, (), cause, f"Slurm requeued the job during recovery{_because(seen)}"
        )
    # While hang or exit evidence is collected no restart was counted yet: Slurm's
    # requeue is the restart, and the ranks it ended are no longer evidence.
    verdict = Blame(None, cause, 0.0, (f"Slurm requeued the job{_because(seen)}",))
    started = recovery.start(record, ctx, verdict, requeue=True, stop_ranks=False)
    if started.record.state is not JobState.RECOVERING:
        return started  # the budget ran out: the job stops
    assert started.record.recovery is not None
    adopted = replace(
        recovery.to_state(started.record, JobState.REQUEUED, ctx.now_s),
        nodes=(),
        spare_nodes=(),
        not_before_s=None,
        # Slurm relaunches it; we only choose where it resumes from.
        recovery=replace(
            started.record.recovery,
            requeue=True,
            requeue_seen=True,
            slurm_requeued=_allocation(record),
        ),
    )
    why = (
        "the job's driver requeued it before its time limit (its ranks had not stopped in "
        "time for the supervisor's requeue): the planned stop"
        if cause is Cause.TIME_LIMIT
        else f"adopted Slurm's requeue{_because(seen)}"
    )
    return decision(adopted, started.intents, cause, why)


def _allocation(record: JobRecord) -> tuple[str, ...]:
    """The nodes Slurm requeued the job from: its world and its spares."""
    return (*record.nodes, *record.spare_nodes)


def _because(seen: SlurmJobSeen) -> str:
    """Slurm's reason in parentheses, or nothing when it gave none (Slurm says "None")."""
    return f" ({seen.reason})" if seen.reason and seen.reason != "None" else ""
