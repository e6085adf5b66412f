"""What the in-job driver is told: the answer to each of its questions.

The driver never decides: after a failed step it asks, and does what it is
told (launch, relaunch on nodes, wait, stop). :func:`answer` is that answer,
from the job's record and what the intake gathered for it (:class:`DriverFacts`:
the relaunch waiting for the driver, the checkpoints validation rejected, when
the idle spares were last checked); it takes ``now`` and reads nothing else.
Confirming a relaunch (``RELAUNCHED``) is the executor's and is not answered
here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

from agent.wire.protocol import DriverAction, DriverAnswer, DriverPhase, DriverRequest
from supervisor.core.decision import Policy
from supervisor.core.intents import RelaunchStep
from supervisor.core.model import JobRecord, JobState
from supervisor.core.observations import Observation, SpareCheckFailed, TimeLimitNear

# How long the driver is told to wait before asking again.
DRIVER_RETRY_S = 2.0
# While a recovery prepares the relaunch (evidence, checkpoint choice, backoff),
# the driver asks again this soon, or right after the backoff ends: the relaunch
# is planned within moments, and the driver is the one to start it.
DRIVER_RECOVERY_RETRY_S = 0.2
# What the driver asks that observe-only mode answers as if no supervisor decided.
_OBSERVED_PHASES = frozenset({DriverPhase.START, DriverPhase.RUNNING, DriverPhase.ENDED})


class Checked(NamedTuple):
    """A checkpoint the current attempt's validation looked at (from the action log)."""

    path: str
    valid: bool
    reason: str


class PastRollback(NamedTuple):
    """A valid checkpoint that lies past a rollback's point (from the action log)."""

    path: str
    step: int


class Aside(NamedTuple):
    """Why the driver was last told to move a checkpoint aside, and whether it is valid
    and only past a rollback's point."""

    reason: str
    past_rollback: bool


@dataclass(frozen=True)
class DriverFacts:
    """What the answer depends on besides the record and the question.

    ``validation``: the current attempt's validation results in the action
    log's order, gathered only when :func:`quarantine_wanted`.
    """

    record: JobRecord
    pending: RelaunchStep | None
    observe_only: bool
    spares_checked_s: float | None
    validation: tuple[Checked | PastRollback, ...] = ()


@dataclass(frozen=True)
class DriverReply:
    """The answer, and what the intake does besides sending it.

    ``observations``: for the decision task. ``step_ended``: note the driver's
    "the step ended" (:mod:`supervisor.core.steps`). ``spares_checked``: the
    idle spares' check was asked for now. ``aside``: what the driver is told to
    move aside and why (None: unchanged). ``note``: a line for the log.
    """

    answer: DriverAnswer
    observations: tuple[Observation, ...] = ()
    step_ended: bool = False
    spares_checked: bool = False
    aside: Mapping[str, Aside] | None = None
    note: str = ""


def quarantine_wanted(record: JobRecord) -> bool:
    """Whether a launch now moves checkpoints aside: the recovery's checkpoint is chosen,
    and it rejected some or rolls back past a training anomaly."""
    recovery = record.recovery
    if recovery is None or not recovery.validated:
        return False
    return bool(recovery.rejected) or recovery.resume_before is not None


def answer(facts: DriverFacts, request: DriverRequest, now: float, policy: Policy) -> DriverReply:
    """Tell the in-job driver what to do (see :class:`agent.wire.protocol.DriverPhase`)."""
    record = facts.record
    if facts.observe_only and request.phase in _OBSERVED_PHASES:
        return _observing(record, request)
    if record.state.terminal:
        action = DriverAction.DONE if record.state is JobState.COMPLETED else DriverAction.STOP
        reason = record.final_reason or record.state.value
        return DriverReply(DriverAnswer(action, record.attempt, reason=reason))
    if request.phase is DriverPhase.TIME_LIMIT:
        stopped = request.exit_code is not None
        wait = DriverAnswer(
            DriverAction.WAIT,
            record.attempt,
            reason="requeueing for the time limit" if stopped else "planned stop noted",
            retry_after_s=DRIVER_RETRY_S,
        )
        return DriverReply(wait, (TimeLimitNear(request.time_left_s, stopped, request.attempt),))
    if request.phase is DriverPhase.SPARE_CHECK:
        return _spares_checked(record, request)
    if request.phase is DriverPhase.RUNNING:
        if facts.pending is not None and facts.pending.attempt > (request.attempt or 0):
            return _steered(facts, _relaunch_answer(facts.pending, record))
        due = _spares_due(facts, request.attempt, now, policy)
        carry_on = DriverAnswer(
            DriverAction.WAIT, record.attempt, reason="carry on", check_spares=due
        )
        return DriverReply(carry_on, spares_checked=bool(due))
    ended = request.phase is DriverPhase.ENDED
    if facts.pending is not None:
        return replace(_steered(facts, _relaunch_answer(facts.pending, record)), step_ended=ended)
    if request.phase is DriverPhase.START:
        return _launch(facts, now)
    wait = DriverAnswer(
        DriverAction.WAIT,
        record.attempt,
        reason=f"job is {record.state.value}",
        retry_after_s=retry_s(record, now),
    )
    return DriverReply(wait, step_ended=ended)


def _launch(facts: DriverFacts, now: float) -> DriverReply:
    """The answer to START: launch on the allocation, once the checkpoint is chosen and
    (with hot spares) Slurm's allocation is known."""
    record = facts.record
    recovery = record.recovery
    if recovery is not None and not recovery.validated:
        return DriverReply(
            DriverAnswer(
                DriverAction.WAIT,
                record.attempt,
                reason="choosing a checkpoint",
                retry_after_s=retry_s(record, now),
            )
        )
    if record.spares_wanted and not record.nodes:
        # Which nodes are the world and which the spares is decided on
        # Slurm's view of the allocation: the next poll brings it.
        return DriverReply(_waiting_for_allocation(record))
    spare = record.spare_nodes
    spares = f", {len(spare)} spare(s) kept ready" if spare else ""
    launch = DriverAnswer(
        DriverAction.LAUNCH,
        record.attempt,
        nodes=record.nodes if record.spare_nodes else None,
        resume_from=recovery.resume_from if recovery is not None else None,
        skip_samples=record.skipped_samples,
        reason=f"launch on the current allocation{spares}",
    )
    return _steered(facts, launch)


def _waiting_for_allocation(record: JobRecord) -> DriverAnswer:
    return DriverAnswer(
        DriverAction.WAIT, record.attempt, reason="waiting for Slurm's allocation",
        retry_after_s=DRIVER_RETRY_S,
    )  # fmt: skip


def retry_s(record: JobRecord, now: float) -> float:
    """When the driver should ask again: soon while a recovery prepares the relaunch
    (right after its backoff, when one runs), else :data:`DRIVER_RETRY_S`."""
    if record.state is not JobState.RECOVERING:
        return DRIVER_RETRY_S
    wait_s = DRIVER_RECOVERY_RETRY_S
    if record.not_before_s is not None:
        wait_s = max(wait_s, record.not_before_s - now + DRIVER_RECOVERY_RETRY_S / 4)
    return min(wait_s, DRIVER_RETRY_S)


def _spares_due(
    facts: DriverFacts, attempt: int | None, now: float, policy: Policy
) -> tuple[str, ...]:
    """The idle spares the driver should health-check now: all of them, once the
    policy's interval passed since the last check (at once, the first time), while
    the current attempt runs."""
    record, interval_s = facts.record, policy.spare_check_interval_s
    if not record.spare_nodes or not interval_s or attempt != record.attempt:
        return ()
    if record.state is not JobState.RUNNING:
        return ()
    last_s = facts.spares_checked_s
    if last_s is not None and now - last_s < interval_s:
        return ()
    return record.spare_nodes


def _spares_checked(record: JobRecord, request: DriverRequest) -> DriverReply:
    """The driver's spare check: a spare that failed is decided on (released)."""
    failed = dict(request.unhealthy)
    healthy = [node for node in request.checked if node not in failed]
    note = f"idle spares checked: {','.join(healthy) or 'none'} healthy" + "".join(
        f"; {node} failed: {detail}" for node, detail in failed.items()
    )
    return DriverReply(
        DriverAnswer(DriverAction.WAIT, record.attempt, reason="spare check noted"),
        tuple(SpareCheckFailed(node, detail) for node, detail in failed.items()),
        note=note,
    )


def _steered(facts: DriverFacts, launch: DriverAnswer) -> DriverReply:
    """``launch`` with what the driver moves aside first (see :func:`_to_quarantine`);
    after a rollback, also every checkpoint newer than the one it resumes from that the
    driver finds then (a save the stopped run made after the validation)."""
    record = facts.record
    recovery = record.recovery
    after = None
    if recovery is not None and recovery.validated and recovery.resume_before is not None:
        after = recovery.resume_step
    aside = _to_quarantine(facts) if quarantine_wanted(record) else None
    quarantine = () if aside is None else tuple((path, why.reason) for path, why in aside.items())
    steered = replace(launch, quarantine=quarantine, aside_after_step=after)
    return DriverReply(steered, aside=aside)


def _to_quarantine(facts: DriverFacts) -> dict[str, Aside]:
    """The checkpoints newer than the one this recovery resumes from, and why: those it
    rejected, and, for a rollback past a training anomaly, those past its point.

    The driver moves them aside (:mod:`agent.checkpoint.quarantine`), so a
    script that resumes by its framework's own "latest" finds the chosen one.
    """
    record = facts.record
    recovery = record.recovery
    assert recovery is not None
    rollback = recovery.resume_before is not None
    reasons: dict[str, str] = {}
    for found in facts.validation:
        if isinstance(found, Checked) and found.path and not found.valid:
            reasons[found.path] = found.reason or "failed validation"
        elif isinstance(found, PastRollback) and rollback:
            reasons[found.path] = _past_the_rollback(found.step, record)
    moved = dict.fromkeys(recovery.rejected)
    moved.update(dict.fromkeys(path for path in reasons if path not in recovery.rejected))
    return {
        path: Aside(reasons.get(path, "failed validation"), path not in recovery.rejected)
        for path in moved
    }


def _past_the_rollback(step: int, record: JobRecord) -> str:
    """Why a checkpoint of ``step`` is moved aside by a rollback."""
    acted = [a for a in record.anomalies if a.action in ("rollback", "drain")]
    anomaly = acted[-1] if acted else None
    onset = "" if anomaly is None else f" at step {anomaly.onset_step} ({anomaly.kind})"
    resumed = record.recovery.resume_step if record.recovery is not None else None
    return (
        f"step {step} lies past the rollback to step {resumed} after the training "
        f"anomaly{onset}: the run resumes before it"
    )


def _relaunch_answer(pending: RelaunchStep, record: JobRecord) -> DriverAnswer:
    return DriverAnswer(
        DriverAction.RELAUNCH,
        pending.attempt,
        nodes=pending.nodes,
        resume_from=pending.resume_from,
        # Every range skipped so far: a resume from before one skips it again.
        skip_samples=record.skipped_samples,
        action_id=pending.action_id,
        reason=f"relaunch on {len(pending.nodes)} node(s)",
    )


def _observing(record: JobRecord, request: DriverRequest) -> DriverReply:
    """Observe-only: the driver runs the job as it would run without Resurgo. It
    launches at once, as the job was submitted (no checkpoint chosen for it, none
    moved aside), its step runs on whatever was decided (no stop, no relaunch, no
    spare check), and the step's end is the job's."""
    if request.phase is DriverPhase.START and record.spares_wanted and not record.nodes:
        return DriverReply(_waiting_for_allocation(record))
    if request.phase is DriverPhase.START:
        return DriverReply(
            DriverAnswer(
                DriverAction.LAUNCH,
                record.attempt,
                nodes=record.nodes if record.spare_nodes else None,
                reason="launch on the current allocation (observe-only)",
            )
        )
    if request.phase is DriverPhase.RUNNING:
        carry_on = DriverAnswer(DriverAction.WAIT, record.attempt, reason="carry on (observe-only)")
        return DriverReply(carry_on)
    if request.exit_code == 0:
        done = DriverAnswer(DriverAction.DONE, record.attempt, reason="the step completed")
        return DriverReply(done, step_ended=True)
    why = (
        f"observe-only: the step ended with exit code {request.exit_code}, and the job "
        f"ends as it would without Resurgo (`resurgo events {record.job_id}` shows what it "
        "would have done)"
    )
    return DriverReply(DriverAnswer(DriverAction.STOP, record.attempt, reason=why), step_ended=True)
