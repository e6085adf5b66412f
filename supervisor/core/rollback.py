"""What a training anomaly does to a job: roll back past it, or stop, or drain; pure.

The intake's :class:`~supervisor.core.anomaly.LossWatch` finds a NaN or
infinite loss (or grad norm), a loss spike or a grad-norm explosion in the
ranks' step reports and hands over a
:class:`~supervisor.core.observations.TrainingAnomaly`. Under
``anomaly_action = "rollback"`` (the default):

- a first anomaly is the data's or the optimizer's, never a node's: stop the
  ranks, resume from the newest valid checkpoint at least
  ``anomaly_margin_steps`` before the onset (:attr:`Recovery.resume_before`),
  skip the window of data around the onset (:mod:`supervisor.core.skips`),
  relaunch on the same nodes. Nothing is drained; the restart budget is not
  spent, the anomaly budget (``anomaly_max_rollbacks``) is;
- a recurrence (within ``anomaly_recurrence_steps`` of the last onset):
  - on the same data (no cursor to skip by, so the data could not change):
    a crash loop, the job stops for good;
  - on fresh data from one node's ranks alone, both times: that node computes
    wrong (silent data corruption). It is blamed and drained, and the job
    relaunches without it from before the onset, skipping nothing more;
  - on fresh data otherwise: the model itself diverges. A crash loop: the job
    stops with the verdict, and no node is drained.

Under ``alert`` an anomaly is told to a person (once per onset) and training
goes on; under ``off`` the intake does not look.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import recovery
from supervisor.core.anomaly import AnomalyAction
from supervisor.core.blame import Blame
from supervisor.core.decision import LIVE, Context, Decision, Policy, decision
from supervisor.core.intents import Alert, Severity
from supervisor.core.model import AnomalySeen, Cause, JobRecord, JobState
from supervisor.core.observations import TrainingAnomaly
from supervisor.core.skips import describe

# How sure a node's blame is when its ranks alone went bad twice on different data.
CORRUPTION_CONFIDENCE = 0.9


def on_anomaly(record: JobRecord, seen: TrainingAnomaly, ctx: Context) -> Decision:
    """The decision for a training anomaly of ``seen.attempt`` (see the module)."""
    if seen.attempt != record.attempt:
        return decision(record, (), None, f"anomaly report of attempt {seen.attempt} is stale")
    pending = record.recovery
    # A script that raises on a NaN dies of it: its exits opened a window the
    # anomaly explains (no node is at fault for them).
    dying = record.state is JobState.RECOVERING and pending is not None and pending.collecting_exits
    if record.state not in LIVE and not dying:
        return decision(record, (), None, f"{seen.detail}: noted; the job is {record.state.value}")
    entry = AnomalySeen(
        seen.kind, seen.onset_step, seen.attempt, seen.nodes, seen.cursor, seen.batch,
        seen.detail, action="",
    )  # fmt: skip
    if ctx.policy.anomaly_action is AnomalyAction.ALERT:
        return _alert(record, entry)
    previous = _last_acted(record)
    if previous is not None and seen.onset_step <= (
        previous.onset_step + ctx.policy.anomaly_recurrence_steps
    ):
        return _recurrence(record, entry, previous, ctx)
    if record.rollbacks >= ctx.policy.anomaly_max_rollbacks:
        reason = (
            f"{seen.detail}; {record.rollbacks} rollback(s) already, the most "
            f"anomaly_max_rollbacks {ctx.policy.anomaly_max_rollbacks} allows: the data or the "
            "training recipe needs a person"
        )
        return recovery.stop(
            record.with_anomaly(replace(entry, action="crash_loop")),
            ctx.now_s, JobState.FAILED, Cause.TRAINING_ANOMALY, reason,
        )  # fmt: skip
    return _roll_back(record, entry, ctx)


def _last_acted(record: JobRecord) -> AnomalySeen | None:
    """The newest anomaly the job rolled back or drained for."""
    for seen in reversed(record.anomalies):
        if seen.action in ("rollback", "drain"):
            return seen
    return None


def _before(seen: AnomalySeen, policy: Policy) -> int:
    """The newest checkpoint step a rollback may resume from: the params that made the
    onset step's loss are step ``onset - 1``'s, and the margin goes back further."""
    return seen.onset_step - 1 - policy.anomaly_margin_steps


def _alert(record: JobRecord, entry: AnomalySeen) -> Decision:
    known = any(a.onset_step == entry.onset_step and a.kind == entry.kind for a in record.anomalies)
    if known:
        return decision(record, (), None, f"{entry.detail}: already reported")
    message = (
        f"job {record.job_id}: {entry.detail}; anomaly_action is alert, so the job trains on. "
        'Roll back by hand, or set anomaly_action = "rollback"'
    )
    alert = Alert(record.job_id, record.attempt, Severity.WARNING, message)
    noted = record.with_anomaly(replace(entry, action="alert"))
    return decision(noted, (alert,), Cause.TRAINING_ANOMALY, f"{entry.detail}: alert only")


def _roll_back(record: JobRecord, entry: AnomalySeen, ctx: Context) -> Decision:
    before = _before(entry, ctx.policy)
    verdict = Blame(
        None, Cause.TRAINING_ANOMALY, 0.0,
        (f"{entry.detail}: a training anomaly blames no node",),
    )  # fmt: skip
    marked = replace(
        record.with_anomaly(replace(entry, action="rollback")), rollbacks=record.rollbacks + 1
    )
    started = recovery.start(marked, ctx, verdict, resume_before=before)
    if started.record.state is not JobState.RECOVERING:
        return started
    skip = (
        f"skip {ctx.policy.anomaly_skip_batches} global batch(es) from "
        f"{ctx.policy.anomaly_skip_lead_batches} before the onset"
        if entry.cursor is not None and entry.batch is not None
        else "no data cursor reported, so nothing can be skipped"
    )
    why = (
        f"{entry.detail}: roll back to the newest valid checkpoint at or before step {before} "
        f"(onset {entry.onset_step}, margin {ctx.policy.anomaly_margin_steps}), {skip}; rollback "
        f"{marked.rollbacks} of {ctx.policy.anomaly_max_rollbacks}"
    )
    return replace(started, explanation=why)


def _recurrence(
    record: JobRecord, entry: AnomalySeen, previous: AnomalySeen, ctx: Context
) -> Decision:
    again = (
        f"{entry.detail}, {entry.onset_step - previous.onset_step} step(s) after the "
        f"{previous.kind} at step {previous.onset_step}"
    )
    if entry.cursor is None or previous.cursor is None:
        reason = (
            f"crash loop: {again}, on the same data (the script reports no global sample "
            "cursor, so the data could not be skipped: a script that imports nothing from "
            "Resurgo cannot be); not a node fault, no drain. Fix or leave out the data of "
            f"step {entry.onset_step}, or report a cursor (GlobalBatchSampler with "
            "TrainingSession), then resubmit: it resumes from the newest valid checkpoint"
        )
        return _stop(record, entry, ctx.now_s, reason)
    if entry.cursor == previous.cursor:
        # The ranks were told to skip, and trained the same batch at the onset again.
        reason = (
            f"crash loop: {again}, on the same data at global sample {entry.cursor}: the "
            f"skip ({describe(previous)}) did not take effect. Give TrainingSession the "
            "GlobalBatchSampler (it reads RESURGO_SKIP_SAMPLES); not a node fault, no drain"
        )
        return _stop(record, entry, ctx.now_s, reason)
    node = entry.nodes[0] if len(entry.nodes) == 1 else None
    if node is not None and previous.nodes == entry.nodes and node in record.nodes:
        verdict = Blame(
            node, Cause.SILENT_CORRUPTION, CORRUPTION_CONFIDENCE,
            (f"{again}: only {node}'s ranks went bad, both times, on different data "
             "(suspected silent data corruption)",),
        )  # fmt: skip
        marked = record.with_anomaly(replace(entry, action="drain"))
        return recovery.start(marked, ctx, verdict, resume_before=_before(entry, ctx.policy))
    where = f"on {', '.join(entry.nodes)}" if entry.nodes else "on every reporting node"
    reason = (
        f"crash loop: {again}, on fresh data {where}: the training itself diverges, not the "
        "data or a node; no drain. Lower the learning rate or raise anomaly_margin_steps, "
        "then resubmit: it resumes from the newest valid checkpoint"
    )
    return _stop(record, entry, ctx.now_s, reason)


def _stop(record: JobRecord, entry: AnomalySeen, now_s: float, reason: str) -> Decision:
    marked = record.with_anomaly(replace(entry, action="crash_loop"))
    return recovery.stop(marked, now_s, JobState.FAILED, Cause.CRASH_LOOP, reason)


def nothing_before(step: int, rejected: tuple[str, ...], policy: Policy) -> str:
    """Why a rollback found no checkpoint to resume from, and what to do."""
    tried = f" (rejected: {', '.join(rejected)})" if rejected else ""
    return (
        f"training anomaly: no checkpoint at or before step {step} passed "
        f"{policy.validation_level.value} validation{tried}; newer ones hold the anomaly. "
        "Lower anomaly_margin_steps, or resubmit with a fresh --ckpt-root to start over"
    )
