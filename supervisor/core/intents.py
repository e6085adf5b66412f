"""What the decision core emits: intents the executor carries out exactly once.

Every intent names its job and the attempt it belongs to, and has a
deterministic :attr:`action_id` (``job/attempt/kind/target``): the executor
records the id before acting and after, so a supervisor restarted halfway
finishes each action once and never twice (DESIGN §3). Pure values.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from supervisor.core.model import Cause, JobState
from supervisor.text import fragment

# The executor writes this prefix into every drain reason, so an operator (and
# reconciliation) can tell Resurgo's drains from everybody else's in sinfo.
DRAIN_REASON_PREFIX = "resurgo:"
# The evidence after the structured part of a drain reason (what `sinfo -R` shows).
MAX_DRAIN_DETAIL_CHARS = 160


class Severity(enum.Enum):
    """How urgently a person should look at an :class:`Alert`."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class ValidationLevel(enum.Enum):
    """The checkpoint validation depth; the same values as agent.checkpoint.validate.Level.

    Repeated here by value because that module reads files and imports torch,
    and the decision core stays pure; the executor maps it by value.
    """

    QUICK = "quick"
    FULL = "full"
    LOAD = "load"


@dataclass(frozen=True)
class DrainNode:
    """Drain ``node`` in Slurm with reason ``resurgo: <cause> job=<id> <reason>``.

    ``reason`` is the blame's evidence, which quotes what the job's agents
    reported (a culprit's reason, an error digest): in the Slurm reason it is
    one line of printable ASCII, at most :data:`MAX_DRAIN_DETAIL_CHARS`
    characters; the cause and job before it are the supervisor's own.
    """

    job_id: str
    attempt: int
    node: str
    cause: Cause
    reason: str

    @property
    def slurm_reason(self) -> str:
        """The reason string for ``scontrol update ... state=drain reason=...``."""
        detail = fragment(self.reason, MAX_DRAIN_DETAIL_CHARS)
        return f"{DRAIN_REASON_PREFIX} {self.cause.value} job={self.job_id} {detail}".strip()

    @property
    def action_id(self) -> str:
        """Idempotency key: one drain of this node per job attempt."""
        return f"{self.job_id}/{self.attempt}/drain/{self.node}"


@dataclass(frozen=True)
class DrainTicket:
    """Ask the admins to drain ``node``: a supervisor without Slurm operator rights.

    The node is already out of the job (its relaunch and requeue exclude it);
    the ticket keeps it out of the user's later jobs until it expires or is
    forgiven, shows in ``resurgo nodes``, on ``/metrics`` and as an alert, and
    reaches the operator hook (``ticket_hook``) as JSON. ``evidence`` is the
    blame's, as a drain's reason would carry it.
    """

    job_id: str
    attempt: int
    node: str
    cause: Cause
    evidence: str

    @property
    def action_id(self) -> str:
        """Idempotency key: one ticket for this node per job attempt."""
        return f"{self.job_id}/{self.attempt}/ticket/{self.node}"


@dataclass(frozen=True)
class ResumeNode:
    """Return ``node`` to service (``scontrol update state=resume``) after probation."""

    job_id: str
    attempt: int
    node: str

    @property
    def action_id(self) -> str:
        """Idempotency key."""
        return f"{self.job_id}/{self.attempt}/resume/{self.node}"


@dataclass(frozen=True)
class StopRanks:
    """Tell every agent of the job to stop its ranks (SIGTERM, SIGKILL after ``grace_s``)."""

    job_id: str
    attempt: int
    grace_s: float

    @property
    def action_id(self) -> str:
        """Idempotency key; also the protocol command id the agents see."""
        return f"{self.job_id}/{self.attempt}/stop_ranks/all"


@dataclass(frozen=True)
class ValidateCheckpoints:
    """Validate the job's checkpoints newest first at ``level``.

    Report each as a :class:`~supervisor.core.observations.CheckpointValidated`,
    stopping at the first valid one; report ``path=None`` when none is left.
    ``skip`` lists paths already rejected in this recovery.
    """

    job_id: str
    attempt: int
    level: ValidationLevel
    skip: tuple[str, ...] = ()

    @property
    def action_id(self) -> str:
        """Idempotency key; ``skip`` in it, so a retry after a rejection runs again."""
        return f"{self.job_id}/{self.attempt}/validate/{len(self.skip)}"


@dataclass(frozen=True)
class ShrinkAllocation:
    """Shrink the running allocation to ``keep_nodes`` (``scontrol update NodeList=``)."""

    job_id: str
    attempt: int
    keep_nodes: tuple[str, ...]

    @property
    def action_id(self) -> str:
        """Idempotency key."""
        return f"{self.job_id}/{self.attempt}/shrink/{','.join(self.keep_nodes)}"


@dataclass(frozen=True)
class RelaunchStep:
    """Start a new srun step on ``nodes`` via the in-job driver (the fast path).

    ``resume_from`` becomes ``RESURGO_RESUME_FROM`` (None: start from scratch).
    The executor reports :class:`~supervisor.core.observations.RelaunchFinished`.
    """

    job_id: str
    attempt: int
    nodes: tuple[str, ...]
    resume_from: str | None

    @property
    def action_id(self) -> str:
        """Idempotency key: one relaunch per attempt."""
        return f"{self.job_id}/{self.attempt}/relaunch/{len(self.nodes)}"


@dataclass(frozen=True)
class RequeueSmaller:
    """Requeue the job with ``n_nodes`` excluding ``exclude`` (requeuehold, update, release).

    ``resume_from`` as for :class:`RelaunchStep`: the batch script reads it.
    """

    job_id: str
    attempt: int
    n_nodes: int
    exclude: tuple[str, ...]
    resume_from: str | None

    @property
    def action_id(self) -> str:
        """Idempotency key: one requeue per attempt."""
        return f"{self.job_id}/{self.attempt}/requeue/{self.n_nodes}"


@dataclass(frozen=True)
class Alert:
    """Tell a person; the core's way of saying "I will not do this by myself"."""

    job_id: str
    attempt: int
    severity: Severity
    message: str

    @property
    def action_id(self) -> str:
        """Idempotency key: the same message once per attempt."""
        digest = hashlib.sha256(self.message.encode()).hexdigest()[:12]
        return f"{self.job_id}/{self.attempt}/alert/{digest}"


@dataclass(frozen=True)
class StopJob:
    """End the job in Slurm (``scancel``) and record ``status`` with ``reason``."""

    job_id: str
    attempt: int
    status: JobState
    reason: str

    @property
    def action_id(self) -> str:
        """Idempotency key."""
        return f"{self.job_id}/{self.attempt}/stop_job/{self.status.value}"


@dataclass(frozen=True)
class PushInterval:
    """Send a new checkpoint interval to the job's agents."""

    job_id: str
    attempt: int
    interval_s: float

    @property
    def action_id(self) -> str:
        """Idempotency key."""
        return f"{self.job_id}/{self.attempt}/interval/{self.interval_s:.0f}"


Intent = (
    DrainNode
    | DrainTicket
    | ResumeNode
    | StopRanks
    | ValidateCheckpoints
    | ShrinkAllocation
    | RelaunchStep
    | RequeueSmaller
    | Alert
    | StopJob
    | PushInterval
)
