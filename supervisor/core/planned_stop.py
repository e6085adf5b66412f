"""The time limit as a planned stop, in the decision core; pure.

The agents and the driver carry the stop out by themselves (:mod:`agent.timelimit`):
a final checkpoint, a graceful stop, and, when the supervisor does not, a
requeue by the driver. The core's part:

- the driver's or an agent's notice (:func:`on_notice`) marks the job as
  stopping (``JobRecord.time_limit_end_s``): from then on the ranks' exits and
  hang reports are the stop, not faults (:func:`during_stop`);
- when the ranks have stopped, or the end is close (:data:`REQUEUE_MARGIN_S`),
  the job is requeued at its size (:func:`requeue`): cause ``time_limit``, no
  blame, no drain, no budget, and a QUICK validation (marker, manifest, DCP
  metadata), because a full read of a large checkpoint takes longer than the
  time left and the ranks that wrote it were healthy. A save cut short by the
  limit has no commit marker, so the previous committed checkpoint is chosen.
  When the end drew near with no stop reported, the ranks may still be
  writing their final checkpoint: it is awaited until
  :data:`SETTLE_BEFORE_END_S` before the end (a loaded node's ranks can
  overrun their stop by seconds; taking the previous checkpoint would train
  every step since again).

A notice during a fault's recovery only turns it to the requeue path: the
allocation is about to end, so the fast path inside it is pointless.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import recovery
from supervisor.core.blame import Blame
from supervisor.core.decision import LIVE, Context, Decision, decision
from supervisor.core.model import Cause, JobRecord, JobState

# Requeue no later than this long before Slurm ends the job when the ranks' stop
# was never reported: requeuehold, resize and release take about 2 s (a requeue
# just after the end still works while slurmctld holds the job). Not earlier: with
# the shortest leads the ranks may save until 5 to 7.5 s before the end.
REQUEUE_MARGIN_S = 5.0
# A final save still being written then is awaited until this long before the end
# (at most 2 s of the decision task's time). Should the driver requeue the job
# itself meanwhile (5 s before the end), that requeue is adopted as this one.
SETTLE_BEFORE_END_S = 3.0
# Without a time left from the notice, the end is assumed this far off.
UNKNOWN_END_S = 60.0


def on_notice(
    record: JobRecord, time_left_s: float | None, stopped: bool, ctx: Context
) -> Decision:
    """The time limit is near (``stopped``: and the ranks stopped for it)."""
    left = UNKNOWN_END_S if time_left_s is None else time_left_s
    end_s = ctx.now_s + left
    if record.state in LIVE:
        known = record.time_limit_end_s
        record = replace(record, time_limit_end_s=end_s if known is None else min(known, end_s))
        if stopped:
            return requeue(record, ctx, "the ranks stopped for the time limit")
        if known is not None:
            return decision(record, (), None, "planned stop for the time limit under way")
        return decision(
            record,
            (),
            Cause.TIME_LIMIT,
            f"time limit in {left:.0f} s: the ranks save a final checkpoint and stop, then "
            f"the job is requeued at {len(record.nodes) or record.original_nodes} node(s)",
        )
    pending = record.recovery
    if record.state is JobState.RECOVERING and pending is not None and not pending.requeue:
        turned = replace(record, recovery=replace(pending, requeue=True))
        return decision(
            turned, (), pending.cause, "time limit near during the recovery: it requeues"
        )
    return decision(record, (), None, f"time limit near while {record.state.value}")


def during_stop(record: JobRecord, what: str) -> Decision:
    """An exit or a hang report while the ranks stop for the time limit: no fault."""
    return decision(record, (), None, f"{what} during the planned stop for the time limit")


def on_tick(record: JobRecord, ctx: Context) -> Decision | None:
    """Requeue when the end is close and the ranks' stop was never reported; else None."""
    end_s = record.time_limit_end_s
    if end_s is None or record.state not in LIVE or ctx.now_s < end_s - REQUEUE_MARGIN_S:
        return None
    why = f"{max(0.0, end_s - ctx.now_s):.0f} s left of the time limit"
    return requeue(record, ctx, why, settle_until_s=end_s - SETTLE_BEFORE_END_S)


def requeue(
    record: JobRecord, ctx: Context, why: str, settle_until_s: float | None = None
) -> Decision:
    """Requeue at the job's size from the newest committed checkpoint; no fault.
    ``settle_until_s``: a final save still being written is awaited until then."""
    verdict = Blame(None, Cause.TIME_LIMIT, 0.0, (why,))
    return recovery.start(
        record, ctx, verdict, requeue=True, stop_ranks=False, settle_until_s=settle_until_s
    )
