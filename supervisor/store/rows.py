"""What the store returns: frozen rows, the enums the store owns, JSON column helpers.

States, causes and kinds owned by other modules (the decision core's job state,
an observation kind) are stored by their enum value and returned as that text;
the owner converts back. The enums here are the store's own vocabulary.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from agent.wire.protocol import Event, EventKind


class ActionState(enum.Enum):
    """Where an action is in the exactly-once protocol.

    ``PLANNED`` -> ``STARTED`` -> ``DONE`` | ``FAILED``. A ``STARTED`` action
    may have been carried out or not (the supervisor can die in between): it
    is reconciled against Slurm before it is run again. ``FAILED`` with
    ``retryable`` may be started again; ``DONE`` and non-retryable ``FAILED``
    are final.
    """

    PLANNED = "planned"
    STARTED = "started"
    DONE = "done"
    FAILED = "failed"


class EventSource(enum.Enum):
    """Who observed an event."""

    AGENT = "agent"  # a node agent reported it over the wire protocol
    SUPERVISOR = "supervisor"  # the supervisor saw it (Slurm state, lease expiry)


class Actor(enum.Enum):
    """Who drained or resumed a node."""

    SUPERVISOR = "supervisor"
    OPERATOR = "operator"
    OUTSIDE = "outside"  # outside Resurgo: seen in sinfo, done by no Resurgo command


# Anything stored "by value": an enum member or its text.
Label = str | enum.Enum


def label(value: Label) -> str:
    """The text stored for ``value``: an enum's value, or the string itself."""
    if isinstance(value, enum.Enum):
        if not isinstance(value.value, str):
            raise ValueError(f"{value!r}: only enums with text values can be stored")
        return value.value
    return value


def dumps(document: Any, what: str) -> str:
    """``document`` as canonical JSON (sorted keys, finite numbers) for a JSON column."""
    try:
        return json.dumps(document, sort_keys=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{what} cannot be stored as JSON ({error}): pass JSON types "
            "(enums by .value, lists not sets, finite numbers)"
        ) from error


def loads(text: str | None) -> Any:
    """The document of a JSON column; None stays None."""
    return None if text is None else json.loads(text)


@dataclass(frozen=True)
class JobRow:
    """One training job as the supervisor tracks it.

    ``state`` is the decision core's job-state value, stored as given;
    ``record`` is the core's full job record (a JSON document) whose layout
    version is ``record_version``.
    """

    job_id: str
    name: str
    state: str
    original_nodes: int
    world_size: int
    min_nodes: int
    record: dict[str, Any]
    record_version: int
    secret_path: str | None
    created_s: float
    updated_s: float
    slurm_user: str | None = None  # whose job, as Slurm said (None: registered before v5)


@dataclass(frozen=True)
class AttemptRow:
    """One (re)launch of a job: where it ran, what it resumed from, how it ended."""

    job_id: str
    attempt: int
    nodes: tuple[str, ...]
    resumed_from: str | None
    started_s: float
    ended_s: float | None
    end_cause: str | None


@dataclass(frozen=True)
class EventRow:
    """One stored event; ``seq`` is the arrival order across the whole store.

    ``agent_seq`` is the agent's own per-incarnation counter (None for
    supervisor observations); ``time_s`` is when it happened by the
    observer's clock, ``received_s`` when the supervisor stored it.
    """

    seq: int
    event_id: str
    job_id: str
    node: str | None
    kind: str
    source: EventSource
    agent_seq: int | None
    time_s: float
    received_s: float
    payload: dict[str, Any]

    def agent_event(self) -> Event:
        """The wire :class:`Event` this row stores; only for rows from an agent."""
        if self.source is not EventSource.AGENT or self.node is None or self.agent_seq is None:
            raise ValueError(f"event {self.event_id} is a supervisor observation, not an agent's")
        return Event(
            kind=EventKind(self.kind),
            job_id=self.job_id,
            node=self.node,
            event_id=self.event_id,
            seq=self.agent_seq,
            time_unix_s=self.time_s,
            payload=self.payload,
        )


@dataclass(frozen=True)
class DecisionRow:
    """What the decision core decided for a job, on which event, and why."""

    decision_id: int
    job_id: str
    event_id: str | None
    from_state: str
    to_state: str
    cause: str
    detail: dict[str, Any]
    decided_s: float


@dataclass(frozen=True)
class ActionRow:
    """One intent of the executor and its outcome; ``seq`` is the plan order.

    ``starts`` counts how often it was started (more than one means it was
    reconciled after a restart, or retried after a retryable failure).
    """

    seq: int
    action_id: str
    job_id: str
    kind: str
    args: dict[str, Any]
    state: ActionState
    starts: int
    planned_s: float
    started_s: float | None
    finished_s: float | None
    result: dict[str, Any] | None
    error: str | None
    retryable: bool | None


@dataclass(frozen=True)
class DrainRow:
    """One drain of a node (the audit trail); open while ``undrained_s`` is None."""

    drain_id: int
    node: str
    cause: str
    job_id: str | None
    reason: str
    drained_by: Actor
    drained_s: float
    undrained_s: float | None
    undrained_by: Actor | None
    action_id: str | None
    withdrawn_s: float | None = None  # the verdict withdrawn: its blame counts no more
    withdrawn_by: Actor | None = None

    @property
    def counts_as_blame(self) -> bool:
        """Resurgo's own drain whose verdict stands (a lemon mark)."""
        return self.drained_by is Actor.SUPERVISOR and self.withdrawn_s is None


@dataclass(frozen=True)
class TicketRow:
    """A drain ticket: Resurgo asked the admins to drain ``node``; open until ``closed_s``."""

    ticket_id: int
    node: str
    cause: str
    job_id: str | None
    evidence: str
    raised_s: float
    closed_s: float | None
    closed_by: Actor | None
    hook: str
    action_id: str | None
    # The user of the job whose blame raised it, as Slurm said (None: not known).
    slurm_user: str | None = None

    def document(self) -> dict[str, Any]:
        """The ticket as the operator hook and ``resurgo nodes --json`` get it."""
        return {
            "ticket_id": self.ticket_id,
            "node": self.node,
            "cause": self.cause,
            "job_id": self.job_id,
            "evidence": self.evidence,
            "raised_s": self.raised_s,
            "closed_s": self.closed_s,
            "closed_by": None if self.closed_by is None else self.closed_by.value,
            "hook": self.hook,
        }


class CheckResult(enum.Enum):
    """How the supervisor's own check of a blamed node ended."""

    PASSED = "passed"  # the node is healthy: it stays in service
    FAILED = "failed"  # the node is not: drained (or ticketed, or everyone avoids it)
    EXPIRED = "expired"  # no verdict (never started in time, cancelled, forgotten)


@dataclass(frozen=True)
class NodeCheckRow:
    """The supervisor's check of ``node``, raised by ``job_id``'s blame at ``attempt``.

    Open (``ended_s`` None) until it ends with ``result``; ``slurm_job_id`` is
    the check's own Slurm job once submitted. ``slurm_user`` is the blaming
    job's user, as Slurm said (None: not known).
    """

    check_id: int
    node: str
    job_id: str
    attempt: int
    cause: str
    evidence: str
    raised_s: float
    slurm_job_id: int | None
    submitted_s: float | None
    ended_s: float | None
    result: CheckResult | None
    detail: str
    action_id: str | None
    slurm_user: str | None = None

    def document(self) -> dict[str, Any]:
        """The check as ``resurgo nodes --json`` gives it."""
        return {
            "check_id": self.check_id,
            "node": self.node,
            "job_id": self.job_id,
            "user": self.slurm_user,
            "cause": self.cause,
            "evidence": self.evidence,
            "raised_s": self.raised_s,
            "slurm_job_id": self.slurm_job_id,
            "submitted_s": self.submitted_s,
            "ended_s": self.ended_s,
            "result": None if self.result is None else self.result.value,
            "detail": self.detail,
        }


class BlameOutcome(enum.Enum):
    """What was done about a node a decision blamed."""

    DRAINED = "drained"  # drained in Slurm
    TICKETED = "ticketed"  # a drain ticket for the admins (no operator rights)
    EXCLUDED = "excluded"  # only kept out of the job (the hourly share was used)
    STORM = "storm"  # only kept out of the job: the storm brake held
    FLAGGED = "flagged"  # only kept out of the job: its user's jobs blamed too many nodes
    SLURM = "slurm"  # Slurm had already taken the node out of service
    USER_SHARE = "user_share"  # only kept out of the job: its user's share of drains was used
    CHECKING = "checking"  # kept out of the job; the supervisor's own check decides a drain
    # Observe-only mode: what would have been done, and was not.
    WOULD_DRAIN = "would_drain"
    WOULD_TICKET = "would_ticket"
    WOULD_CHECK = "would_check"


@dataclass(frozen=True)
class BlameRow:
    """A node blamed by one attempt of one job, whose user is ``slurm_user``."""

    blame_id: int
    node: str
    job_id: str
    attempt: int
    slurm_user: str | None
    cause: str
    outcome: BlameOutcome
    blamed_s: float

    def document(self) -> dict[str, Any]:
        """The blame as ``resurgo nodes --json`` gives it."""
        return {
            "node": self.node,
            "job_id": self.job_id,
            "attempt": self.attempt,
            "user": self.slurm_user,
            "cause": self.cause,
            "outcome": self.outcome.value,
            "blamed_s": self.blamed_s,
        }


@dataclass(frozen=True)
class Lemon:
    """A node the supervisor drained at least a threshold of times within a window."""

    node: str
    drains: int
    last_drained_s: float
    users: int = 1  # distinct users whose jobs blamed it (a job of unknown user: one)


class LeaseRow(msgspec.Struct, frozen=True, gc=False):
    """The newest sign of life of one job's agent on one node.

    Renewed by every beat of every node: untracked by the garbage collector
    (``gc=False``; it holds no container), as :class:`~supervisor.core.hang_hold.Heard`.
    """

    job_id: str
    node: str
    incarnation: str
    last_seen_s: float


@dataclass(frozen=True)
class CheckpointRow:
    """A checkpoint a job committed (raw data for goodput accounting)."""

    job_id: str
    step: int
    path: str
    committed_s: float


@dataclass(frozen=True)
class ProgressRow:
    """A job reached ``step`` at ``time_s`` (raw data for goodput accounting)."""

    job_id: str
    step: int
    time_s: float


@dataclass(frozen=True)
class StepRow:
    """What ``global_rank`` reported for ``step`` in launch ``attempt`` of a job.

    ``loss`` is None when the rank reported no finite loss, ``cursor`` (global
    samples consumed before the step) when it was unknown; ``received_s`` is
    when the supervisor first stored it.
    """

    job_id: str
    attempt: int
    step: int
    global_rank: int
    loss: float | None
    cursor: int | None
    received_s: float
