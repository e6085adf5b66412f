"""The executor: carries the decision core's intents out, each exactly once (DESIGN §3).

Protocol per intent (see ``supervisor/store/store.py``): the daemon plans every
intent in the same store transaction as the decision (:meth:`Executor.plan`);
:meth:`Executor.execute` then, in order, commits ``mark_started``, runs the
side effect and commits ``mark_done`` (with the drain audit row, in one
transaction) or ``mark_failed`` (retryable when Slurm was unreachable).
A done action is never run again: executing the same intents twice replays
the recorded observations and calls Slurm for nothing.

A failed prerequisite (stop ranks, validation, shrink, requeue) leaves the
intents after it planned: relaunching on an allocation that did not shrink
would be worse than waiting. :meth:`Executor.reconcile` picks them up. A job
stopped for good (:class:`StopJob`) never waits for one: that stop is how the
core answers a prerequisite that failed for good.

After a restart, :meth:`Executor.reconcile` finishes what is unfinished: a
``started`` action may or may not have taken effect, so Slurm is asked first
(``supervisor/act/reconcile.py``) and it is marked done or run again, never
blindly re-run. Reconcile also retries retryable failures of the job's
newest attempt, so the daemon calls it at start and then every few ticks.

Hand-off to the in-job driver: a :class:`RelaunchStep` is carried out by the
driver inside the allocation, not here. The executor marks it ``started``
and leaves it there; the driver reads it with :meth:`Executor.pending_relaunch`
(through the API), starts the srun step, and reports back through
:meth:`Executor.confirm_relaunch`, which finishes the action and returns the
:class:`RelaunchFinished` observation for the decision core. Confirming twice
returns the first outcome.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.checkpoint import catalog, layouts
from agent.checkpoint.report import Level
from supervisor.act import storage
from supervisor.act.ahead import AheadValidation
from supervisor.act.reconcile import (
    KIND_OF,
    Verdict,
    args_of,
    command_for,
    effect_of,
    intent_of,
    kind_of,
    relaunch_finished,
    replay,
    slurm_job_id,
    validated_doc,
)
from supervisor.act.ticket_hook import TicketHook
from supervisor.act.validation import Limits, ValidationProcess
from supervisor.act.wording import ticket_doc, ticket_message, would_do
from supervisor.core.intents import (
    Alert,
    CheckNode,
    DrainNode,
    DrainTicket,
    Intent,
    PushInterval,
    RelaunchStep,
    RequeueSmaller,
    ResumeNode,
    Severity,
    ShrinkAllocation,
    StopJob,
    StopRanks,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import JobState
from supervisor.core.observations import (
    CheckpointValidated,
    Observation,
    RelaunchFinished,
    RequeueFailed,
    StorageUnavailable,
)
from supervisor.errors import (
    SlurmError,
    SlurmNotSettled,
    SlurmRequeueFailed,
    SlurmUnavailable,
    StoreError,
)
from supervisor.slurm import Slurm
from supervisor.store import ActionRow, ActionState, Store

log = logging.getLogger(__name__)

Validator = Callable[[str, ValidationLevel], tuple[bool, str]]
"""Validates one checkpoint directory at a level: ``(valid, reason)``; runs in a thread.
The daemon validates in a process of its own instead (:mod:`supervisor.act.validation`)."""

# Later intents of a decision depend on these having happened.
_PREREQUISITES = (StopRanks, ValidateCheckpoints, ShrinkAllocation, RequeueSmaller)
# Never held by a failed prerequisite of the same attempt: ending the job for good
# is the core's answer to such a failure (a requeue Slurm refused), not a step of
# the plan that failed. Held, the job was never cancelled and ran on for minutes.
_NEVER_HELD = (StopJob,)
_UNFINISHED = (ActionState.PLANNED, ActionState.STARTED, ActionState.FAILED)
# A shrink refused this often (or for good) abandons the fast path: requeue instead.
SHRINK_ATTEMPTS = 3
# A requeue whose job stays COMPLETING (each try waits the client's settle time, 60 s)
# is tried this often before the job is stopped with the requeue's error.
REQUEUE_ATTEMPTS = 5
# A job stopped for good (status failed) is left this long to its in-job driver,
# which learns of the stop at its next question (every few seconds) and ends
# the job with exit code 93, "do not requeue"; only then is it cancelled.
DRIVER_STOP_GRACE_S = 30.0
# How often a save still being written is looked at again while a validation awaits it.
SETTLE_POLL_S = 0.25
ALERT_KIND = "alert"
REQUEUE_BASELINE_KIND = "requeue_baseline"
# In observe-only mode: what the supervisor would have done, recorded in the job's events.
WOULD_KIND = "would_act"
# What changes a job or the cluster: in observe-only mode recorded as "would", not done.
# Validation (it reads) and alerts (they say) still happen.
_EFFECTS = (
    DrainNode, ResumeNode, DrainTicket, CheckNode, StopRanks, PushInterval, ShrinkAllocation,
    RequeueSmaller, RelaunchStep, StopJob,
)  # fmt: skip


_Result = tuple[dict[str, Any], list[Observation]]
"""What carrying an intent out gives: the action's result document and the
observations for the decision core."""

_VALIDATOR_IMPORT = threading.Lock()


def load_validator() -> None:
    """Import the checkpoint validator (and torch with it), one thread at a time:
    torch's nested package imports are not safe from two threads at once
    (pytorch#182560)."""
    with _VALIDATOR_IMPORT:
        importlib.import_module("agent.checkpoint.validate")


def validate_checkpoint(path: str, level: ValidationLevel) -> tuple[bool, str]:
    """A :data:`Validator` in this process: the ladder of the checkpoint's layout
    (:mod:`agent.checkpoint.layouts`; a DCP check or a load test imports torch)."""
    load_validator()
    report = layouts.check(path, Level(level.value))
    return report.valid, report.reason or ""


@dataclass
class _Outcome:
    observations: list[Observation] = field(default_factory=list)
    settled: bool = True  # False: not done, later intents of a prerequisite wait


# The background validator's niceness: the trainers and the daemon come first.
BACKGROUND_NICE = 10


class Executor:
    """Carries intents out through Slurm, the agents' command queue and the store."""

    def __init__(
        self,
        store: Store,
        slurm: Slurm,
        *,
        checkpoint_root_of: Callable[[str], Path | None],
        validate_fn: Validator | None = None,
        validation: ValidationProcess | None = None,
        clock: Callable[[], float] = time.time,
        ticket_hook: TicketHook | None = None,
        observe_only: bool = False,
        storage_min_free_bytes: int = storage.MIN_FREE_BYTES,
        validate_ahead: bool = True,
    ) -> None:
        """``checkpoint_root_of(job_id)`` is where the job saves (None: unknown);
        checkpoints are validated by ``validate_fn`` in a thread when given, else
        in ``validation``'s process (by default one with the default limits);
        ``ticket_hook`` gets each drain ticket (:mod:`supervisor.act.ticket_hook`).
        ``observe_only``: every action that would change a job or the cluster is
        recorded as done with what it would have done, and not carried out.
        ``storage_min_free_bytes``: the least free space a storage look calls usable
        (the policy's ``storage_min_free_gb``). ``validate_ahead``: each job's newest
        checkpoint is validated as soon as it is reported (:attr:`ahead`, whose
        :meth:`~supervisor.act.ahead.AheadValidation.run` the daemon runs, in the
        niced child :attr:`background`), and a recovery takes that verdict while the
        checkpoint is unchanged."""
        self._store = store
        self._slurm = slurm
        self._checkpoint_root_of = checkpoint_root_of
        self._storage_min_free_bytes = storage_min_free_bytes
        self._validate_fn = validate_fn
        self.validation = validation or ValidationProcess(Limits())
        # The background's own child, niced: a recovery's validation never waits for it.
        self.background = ValidationProcess(self.validation.limits, nice=BACKGROUND_NICE)
        self.ahead = (
            AheadValidation(
                lambda path, level: self._read(path, level, self.background),
                reading=lambda: validate_fn is not None or self.background.running,
            )
            if validate_ahead
            else None
        )
        self._clock = clock
        self._ticket_hook = ticket_hook
        self.observe_only = observe_only
        self._handlers = self._handler_table()

    # ------------------------------------------------------------------
    # Plan and execute.

    def plan(self, job_id: str, intents: Sequence[Intent], now_s: float) -> list[ActionRow]:
        """Plan every intent (idempotent by action id); call inside the decision's transaction."""
        if not intents:
            return []  # no transaction: an empty one still costs a fsynced commit's locks
        # Planned already (in the decision's own transaction, as nearly always when
        # execute() plans them): read back, without a commit that writes nothing.
        planned = [self._store.get_action(intent.action_id) for intent in intents]
        if all(row is not None and row.job_id == job_id for row in planned):
            return [row for row in planned if row is not None]
        with self._store.transaction():
            return [self._plan_one(job_id, intent, now_s) for intent in intents]

    async def execute(
        self, job_id: str, intents: Sequence[Intent], now_s: float
    ) -> list[Observation]:
        """Carry ``intents`` out in order; return what the decision core should hear next.

        Already-done intents are not run again; their recorded observations
        are returned again. Stops after a prerequisite that did not finish.
        """
        rows = self.plan(job_id, intents, now_s)
        observations: list[Observation] = []
        for index, (intent, row) in enumerate(zip(intents, rows, strict=True)):
            outcome = await self._advance(intent, row, now_s)
            observations.extend(outcome.observations)
            if not outcome.settled and isinstance(intent, _PREREQUISITES):
                log.info(
                    "job %s: %d later action(s) wait for %s",
                    job_id, len(intents) - index - 1, intent.action_id,
                )  # fmt: skip
                break
        return observations

    async def reconcile(self, now_s: float) -> list[tuple[str, Observation]]:
        """Finish every unfinished action (planned, started, retryable-failed), in plan order.

        Returns ``(job_id, observation)`` pairs for the decision core. Actions
        after an unfinished prerequisite of the same job attempt wait.
        """
        observations: list[tuple[str, Observation]] = []
        waiting: set[tuple[str, int]] = set()
        newest: dict[str, int] = {}
        for row in self._store.list_actions(states=_UNFINISHED):
            intent = intent_of(row)
            key = (row.job_id, intent.attempt)
            if row.state is ActionState.FAILED:
                if not row.retryable:
                    if isinstance(intent, _PREREQUISITES):
                        waiting.add(key)
                    continue
                if intent.attempt < self._newest_attempt(row.job_id, newest):
                    continue  # the job moved on; a retry would act on a stale plan
            if key in waiting and not isinstance(intent, _NEVER_HELD):
                log.info(
                    "action %s job=%s kind=%s: %s, waits for an earlier action",
                    row.action_id, row.job_id, row.kind, row.state.value,
                )  # fmt: skip
                continue
            outcome = await self._advance(intent, row, now_s)
            observations.extend((row.job_id, seen) for seen in outcome.observations)
            if not outcome.settled and isinstance(intent, _PREREQUISITES):
                waiting.add(key)
        return observations

    # ------------------------------------------------------------------
    # The in-job driver's hand-off (see the module docstring).

    def pending_relaunch(self, job_id: str) -> RelaunchStep | None:
        """The newest started, unconfirmed :class:`RelaunchStep` of the job, or None."""
        for row in reversed(self._store.list_actions(job_id, states=(ActionState.STARTED,))):
            intent = intent_of(row)
            if isinstance(intent, RelaunchStep):
                return intent
        return None

    def confirm_relaunch(
        self, job_id: str, action_id: str, ok: bool, reason: str, now_s: float
    ) -> RelaunchFinished:
        """The driver's report on a relaunch: finish the action, return the observation."""
        row = self._store.get_action(action_id)
        if row is None or row.job_id != job_id or row.kind != KIND_OF[RelaunchStep]:
            raise StoreError(f"job {job_id} has no relaunch action {action_id} to confirm")
        intent = intent_of(row)
        assert isinstance(intent, RelaunchStep)
        if row.state in (ActionState.DONE, ActionState.FAILED):
            log.info("action %s job=%s kind=relaunch: confirmed again, kept", action_id, job_id)
            return relaunch_finished(intent, row)
        if row.state is ActionState.PLANNED:
            self._store.mark_started(action_id, now_s)
        if ok:
            self._store.mark_done(action_id, {"ok": True, "reason": reason}, now_s)
        else:
            self._store.mark_failed(action_id, reason or "relaunch failed", now_s, retryable=False)
        _log_transition(intent, "started", "done" if ok else "failed", reason)
        return RelaunchFinished(intent.attempt, ok, reason)

    # ------------------------------------------------------------------
    # One action.

    def _plan_one(self, job_id: str, intent: Intent, now_s: float) -> ActionRow:
        if intent.job_id != job_id:
            raise ValueError(f"intent {intent.action_id} is not for job {job_id}")
        return self._store.plan_action(
            intent.action_id, job_id, kind_of(intent), args_of(intent), now_s
        )

    async def _advance(self, intent: Intent, row: ActionRow, now_s: float) -> _Outcome:
        if row.state is ActionState.DONE:
            return _Outcome(replay(intent, row))
        if self.observe_only and isinstance(intent, _EFFECTS):
            self._would(intent, row, now_s)
            return _Outcome()
        if row.state is ActionState.FAILED and not row.retryable:
            return _Outcome(replay(intent, row), settled=False)
        if row.state is ActionState.STARTED:
            if isinstance(intent, RelaunchStep):
                return _Outcome()  # with the in-job driver until it confirms
            try:
                found = await effect_of(intent, self._slurm, self._baseline(intent))
            except SlurmUnavailable as error:
                log.warning(
                    "action %s job=%s kind=%s: started, Slurm unreachable (%s); "
                    "left started for the next reconcile",
                    intent.action_id, intent.job_id, kind_of(intent), error,
                )  # fmt: skip
                return _Outcome(settled=False)
            if found.verdict is Verdict.TOOK_EFFECT:
                self._finish(intent, {"reconciled": found.detail}, [])
                _log_transition(intent, "started", "done", f"already in Slurm: {found.detail}")
                return _Outcome()
            if found.verdict is Verdict.MOOT:
                self._store.mark_failed(
                    intent.action_id, found.detail, self._clock(), retryable=False
                )
                _log_transition(intent, "started", "failed", found.detail)
                return _Outcome(settled=False)
            log.info(
                "action %s job=%s kind=%s: started, not in effect (%s); running it again",
                intent.action_id, intent.job_id, kind_of(intent), found.detail,
            )  # fmt: skip
        return await self._run(intent, row, now_s)

    async def _run(self, intent: Intent, row: ActionRow, now_s: float) -> _Outcome:
        if isinstance(intent, Alert):
            return await self._raise_alert(intent, row, now_s)
        try:
            if isinstance(intent, RequeueSmaller):
                await self._record_requeue_baseline(intent, now_s)
            self._store.mark_started(intent.action_id, now_s)
            _log_transition(intent, row.state.value, "started", "")
            if isinstance(intent, StopJob) and await self._left_to_the_driver(intent, row, now_s):
                return _Outcome()  # started: reconcile cancels it if the driver has not
            if isinstance(intent, RelaunchStep):
                log.info(
                    "action %s job=%s kind=relaunch: handed to the in-job driver (%d nodes)",
                    intent.action_id, intent.job_id, len(intent.nodes),
                )  # fmt: skip
                return _Outcome()
            result, observations = await self._carry_out(intent)
        except SlurmError as error:
            retryable = _retryable(error)
            current = self._store.get_action(intent.action_id)
            starts = current.starts if current is not None else 1
            gave_up = isinstance(intent, ShrinkAllocation) and (
                not retryable or starts >= SHRINK_ATTEMPTS
            )
            if gave_up or (isinstance(intent, RequeueSmaller) and starts >= REQUEUE_ATTEMPTS):
                retryable = False
            if current is not None and current.state is not ActionState.FAILED:
                self._store.mark_failed(
                    intent.action_id, str(error), self._clock(), retryable=retryable
                )
            _log_transition(intent, "started", "failed", f"retryable={retryable}: {error}")
            if isinstance(intent, RequeueSmaller) and not retryable:
                return _Outcome([RequeueFailed(intent.attempt, str(error))], settled=False)
            if gave_up:
                # The allocation cannot be shrunk (22.05 refused a job's second shrink
                # for minutes): the fast path failed, the core falls back to a requeue.
                assert isinstance(intent, ShrinkAllocation)
                reason = f"shrink to {','.join(intent.keep_nodes)} failed {starts}x: {error}"
                return _Outcome([RelaunchFinished(intent.attempt, False, reason)], settled=False)
            return _Outcome(settled=False)
        self._finish(intent, result, observations)
        _log_transition(intent, "started", "done", _brief(result))
        return _Outcome(observations)

    async def _carry_out(self, intent: Intent) -> _Result:
        """Run the side effect; the store writes that go with it happen in :meth:`_finish`."""
        return await self._handlers[type(intent)](intent)

    def _handler_table(self) -> dict[type[Intent], Callable[[Any], Awaitable[_Result]]]:
        """The handler of each intent type: one entry per type of
        :data:`~supervisor.core.intents.Intent` (tests/unit/test_executor.py checks)."""
        return {
            DrainNode: self._drain,
            ResumeNode: self._resume,
            DrainTicket: self._ticket,
            CheckNode: self._check,
            StopRanks: self._queue_command,
            PushInterval: self._queue_command,
            ValidateCheckpoints: self._validation,
            ShrinkAllocation: self._shrink,
            RequeueSmaller: self._requeue,
            Alert: self._alert,
            StopJob: self._stop_job,
            RelaunchStep: self._by_the_driver,
        }

    async def _drain(self, intent: DrainNode) -> _Result:
        await self._slurm.drain(intent.node, intent.slurm_reason)
        return {"node": intent.node, "reason": intent.slurm_reason}, []

    async def _resume(self, intent: ResumeNode) -> _Result:
        await self._slurm.resume(intent.node)
        return {"node": intent.node}, []

    async def _ticket(self, intent: DrainTicket) -> _Result:
        hook = "" if self._ticket_hook is None else await self._ticket_hook(ticket_doc(intent))
        return {"node": intent.node, "hook": hook}, []

    async def _check(self, intent: CheckNode) -> _Result:
        # Recorded in _finish; supervisor.act.node_checks submits it once the job
        # has left the node.
        return {"node": intent.node}, []

    async def _queue_command(self, intent: StopRanks | PushInterval) -> _Result:
        command = command_for(intent)
        new = self._store.queue_command(intent.job_id, None, command, self._clock())
        return {"command_id": command.command_id, "new": new}, []

    async def _validation(self, intent: ValidateCheckpoints) -> _Result:
        if intent.storage_probe:
            seen = await storage.look(
                self._checkpoint_root_of(intent.job_id), self._storage_min_free_bytes
            )
            log.info("job %s: storage look %d: %s", intent.job_id, intent.storage_probe,
                     seen.detail)  # fmt: skip
            if not seen.usable:
                unusable = StorageUnavailable(intent.attempt, seen.detail, seen.filesystem)
                return {"storage": seen.detail}, [unusable]
        checked, past = await self._validate_checkpoints(intent)
        result: dict[str, Any] = {"checked": [validated_doc(seen) for seen in checked]}
        if past:
            result["past_rollback"] = past
        return result, list(checked)

    async def _shrink(self, intent: ShrinkAllocation) -> _Result:
        await self._slurm.shrink(slurm_job_id(intent.job_id), intent.keep_nodes)
        return {"nodes": list(intent.keep_nodes)}, []

    async def _requeue(self, intent: RequeueSmaller) -> _Result:
        await self._slurm.requeue_smaller(
            slurm_job_id(intent.job_id), intent.n_nodes, intent.n_nodes, intent.exclude
        )
        return {"n_nodes": intent.n_nodes, "exclude": list(intent.exclude)}, []

    async def _alert(self, intent: Alert) -> _Result:
        level = logging.ERROR if intent.severity is Severity.CRITICAL else logging.WARNING
        log.log(level, "ALERT job=%s: %s", intent.job_id, intent.message)
        return {"severity": intent.severity.value}, []

    async def _raise_alert(self, intent: Alert, row: ActionRow, now_s: float) -> _Outcome:
        """An alert's whole effect is its log line and its stored row: started and done
        in one commit, not two, and that commit not fsynced. A straggler report raises
        one, and across thousands of nodes they come by the dozen a second. A
        supervisor that dies before the commit (or a power loss after it) leaves the
        alert planned, as its decision's durable commit stored it, and its reconcile
        raises it again."""
        result, observations = await self._carry_out(intent)
        with self._store.transaction(durable=False):
            self._store.mark_started(intent.action_id, now_s)
            self._finish(intent, result, observations)
        _log_transition(intent, row.state.value, "done", _brief(result))
        return _Outcome(observations)

    async def _stop_job(self, intent: StopJob) -> _Result:
        if intent.status is JobState.COMPLETED:
            # The run completed: its driver is told so and exits 0, and Slurm records
            # the job COMPLETED; a cancel would make it CANCELLED.
            return {"cancelled": False, "left_to_driver": True}, []
        job = await self._slurm.job(slurm_job_id(intent.job_id))
        if job is None or job.state.finished:
            state = "not listed" if job is None else job.state_raw
            return {"cancelled": False, "slurm": state}, []
        await self._slurm.cancel(slurm_job_id(intent.job_id))
        return {"cancelled": True, "slurm": job.state_raw}, []

    async def _by_the_driver(self, intent: RelaunchStep) -> _Result:
        # _run hands a relaunch to the in-job driver before it reaches the table.
        raise TypeError(f"the executor cannot carry out {intent!r}: the in-job driver does")

    def _finish(
        self, intent: Intent, result: dict[str, Any], observations: list[Observation]
    ) -> None:
        """Mark done together with the store rows that record the effect (one transaction)."""
        now_s = self._clock()
        with self._store.transaction():
            if isinstance(intent, DrainNode):
                self._store.record_drain(
                    intent.node,
                    cause=intent.cause,
                    job_id=intent.job_id,
                    reason=intent.slurm_reason,
                    now_s=now_s,
                    action_id=intent.action_id,
                )
            elif isinstance(intent, ResumeNode):
                self._store.record_undrain(intent.node, now_s=now_s)
            elif isinstance(intent, DrainTicket):
                self._store.record_ticket(
                    intent.node,
                    cause=intent.cause,
                    job_id=intent.job_id,
                    evidence=intent.evidence,
                    now_s=now_s,
                    hook=result.get("hook", ""),
                    action_id=intent.action_id,
                )
                alert = Alert(
                    intent.job_id, intent.attempt, Severity.WARNING, ticket_message(intent)
                )
                log.warning("ALERT job=%s: %s", alert.job_id, alert.message)
                self._record_alert(alert, intent.action_id, now_s)
            elif isinstance(intent, CheckNode):
                self._store.record_node_check(
                    intent.node,
                    job_id=intent.job_id,
                    attempt=intent.attempt,
                    cause=intent.cause,
                    evidence=intent.evidence,
                    now_s=now_s,
                    action_id=intent.action_id,
                )
            elif isinstance(intent, Alert):
                self._record_alert(intent, intent.action_id, now_s)
            self._store.mark_done(intent.action_id, result, now_s)

    def _would(self, intent: Intent, row: ActionRow, now_s: float) -> None:
        """Observe-only: the action done in the log and the store, with what it would
        have done; nothing reaches Slurm, the agents or the ticket hook."""
        would = would_do(intent)
        with self._store.transaction():
            if row.state is ActionState.PLANNED:
                self._store.mark_started(intent.action_id, now_s)
            self._store.record_observation(
                intent.job_id, WOULD_KIND, {"action": kind_of(intent), "would": would}, now_s,
                observation_id=intent.action_id,
            )  # fmt: skip
            self._store.mark_done(intent.action_id, {"observe_only": True, "would": would}, now_s)
        log.info(
            "action %s job=%s kind=%s: would %s (observe-only: not done)",
            intent.action_id, intent.job_id, kind_of(intent), would,
        )  # fmt: skip

    def _record_alert(self, alert: Alert, observation_id: str, now_s: float) -> None:
        """The alert in the job's events (``resurgo events``, the report)."""
        self._store.record_observation(
            alert.job_id,
            ALERT_KIND,
            {"severity": alert.severity.value, "message": alert.message},
            now_s,
            observation_id=observation_id,
        )

    async def _left_to_the_driver(self, intent: StopJob, row: ActionRow, now_s: float) -> bool:
        """Whether a stop for good still waits for the job's driver to end the job itself.

        A job that failed for good should end FAILED with exit code 93 (``do not
        requeue``), which only its driver can give it: ``scancel`` would make it
        CANCELLED. The driver is told at its next question; the job is cancelled
        once :data:`DRIVER_STOP_GRACE_S` passed since the stop was planned.
        """
        if intent.status is not JobState.FAILED:
            return False
        left_s = DRIVER_STOP_GRACE_S - (now_s - row.planned_s)
        if left_s <= 0:
            return False
        job = await self._slurm.job(slurm_job_id(intent.job_id))
        if job is None or job.state.finished:
            return False
        log.info(
            "action %s job=%s kind=stop_job: left %.0f s more to the job's driver, which ends "
            "it with exit code 93 (do not requeue); cancelled after that",
            intent.action_id, intent.job_id, left_s,
        )  # fmt: skip
        return True

    async def _validate_checkpoints(
        self, intent: ValidateCheckpoints
    ) -> tuple[list[CheckpointValidated], list[dict[str, Any]]]:
        """The checkpoints validated, newest first up to the first valid one; and, for a
        rollback, those passed over as past its point (path and step: the relaunch moves
        them aside, so that a framework's own "latest" does not resume past the anomaly)."""
        root = self._checkpoint_root_of(intent.job_id)
        if root is None:
            return [CheckpointValidated(None, None, False, "no checkpoint directory is known")], []
        if intent.settle_until_s is not None:
            await self._settle(intent.job_id, root, intent.settle_until_s)
        checked: list[CheckpointValidated] = []
        past: list[dict[str, Any]] = []
        for entry in await asyncio.to_thread(layouts.find_all, root):
            if entry.path in intent.skip:
                continue
            if intent.before_step is not None and (
                entry.step is None or entry.step > intent.before_step
            ):
                # A rollback: after the anomaly's onset (less the margin), or unknown.
                if entry.step is not None:
                    past.append({"path": entry.path, "step": entry.step})
                continue
            valid, reason = await self._validate(entry.path, intent.level)
            checked.append(CheckpointValidated(entry.step, entry.path, valid, reason))
            log.info(
                "job %s: checkpoint %s %s at %s%s",
                intent.job_id, entry.path, "valid" if valid else "rejected",
                intent.level.value, f": {reason}" if reason else "",
            )  # fmt: skip
            if valid:
                return checked, past
        before = "" if intent.before_step is None else f" at or before step {intent.before_step}"
        checked.append(
            CheckpointValidated(None, None, False, f"no valid checkpoint{before} left under {root}")
        )
        return checked, past

    async def _settle(self, job_id: str, root: Path, until_s: float) -> None:
        """Wait until ``until_s`` while the newest step directory under ``root`` is a save
        still being written (no commit marker yet): a planned stop's final checkpoint."""
        waited = False
        while (writing := await asyncio.to_thread(catalog.step_being_written, root)) is not None:
            left_s = until_s - self._clock()
            if left_s <= 0:
                if waited:
                    log.info("job %s: %s was not committed in time", job_id, writing)
                return
            if not waited:
                log.info("job %s: %s is still being written; waiting up to %.1f s for its "
                         "commit", job_id, writing, left_s)  # fmt: skip
                waited = True
            await asyncio.sleep(min(SETTLE_POLL_S, left_s))

    def note_checkpoint(self, job_id: str, path: str, level: ValidationLevel) -> None:
        """``path`` is ``job_id``'s newest checkpoint: validate it ahead of any fault."""
        if self.ahead is not None:
            self.ahead.note(job_id, path, level.value)

    async def _validate(self, path: str, level: ValidationLevel) -> tuple[bool, str]:
        if self.ahead is not None:
            known = await self.ahead.verdict(path, level.value)
            if known is not None:
                log.info("checkpoint %s: validated when it was reported, unchanged since", path)
                return known
        return await self._read(path, level.value, self.validation)

    async def _read(self, path: str, level: str, process: ValidationProcess) -> tuple[bool, str]:
        """Validate in ``process`` (the recovery's child or the background's), or with
        ``validate_fn`` when one was given."""
        if self._validate_fn is not None:
            return await asyncio.to_thread(self._validate_fn, path, ValidationLevel(level))
        return await process.validate(path, level)

    async def _record_requeue_baseline(self, intent: RequeueSmaller, now_s: float) -> None:
        # Reconciliation needs the restart count from before the requeue to tell
        # "requeued" from "not yet" when the size does not change. Recorded once:
        # a retry keeps the first baseline.
        if self._baseline(intent) is not None:
            return
        job = await self._slurm.job(slurm_job_id(intent.job_id))
        self._store.record_observation(
            intent.job_id,
            REQUEUE_BASELINE_KIND,
            {"restart_count": None if job is None else job.restart_count},
            now_s,
            observation_id=f"{intent.action_id}/baseline",
        )

    def _baseline(self, intent: Intent) -> dict[str, Any] | None:
        if not isinstance(intent, RequeueSmaller):
            return None
        baseline_id = f"{intent.action_id}/baseline"
        for event in self._store.events_for(intent.job_id, kinds=(REQUEUE_BASELINE_KIND,)):
            if event.event_id == baseline_id:
                return event.payload
        return None

    def _newest_attempt(self, job_id: str, cache: dict[str, int]) -> int:
        if job_id not in cache:
            attempts = [int(row.args.get("attempt", 0)) for row in self._store.list_actions(job_id)]
            cache[job_id] = max(attempts, default=0)
        return cache[job_id]


def _retryable(error: SlurmError) -> bool:
    if isinstance(error, SlurmRequeueFailed):
        # A job still COMPLETING after requeuehold is Slurm ending the old run (slow
        # under load, or with a stopped rank to kill): the requeue resumes there.
        return isinstance(error.error, (SlurmUnavailable, SlurmNotSettled))
    return isinstance(error, SlurmUnavailable)


def _brief(result: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sorted(result.items()))[:300]


def _log_transition(intent: Intent, before: str, after: str, detail: str) -> None:
    log.info(
        "action %s job=%s kind=%s: %s -> %s%s",
        intent.action_id, intent.job_id, kind_of(intent), before, after,
        f" ({detail})" if detail else "",
        extra={"job_id": intent.job_id, "action_id": intent.action_id,
               "action": kind_of(intent), "from_state": before, "to_state": after},
    )  # fmt: skip
