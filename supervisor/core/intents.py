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
from typing import ClassVar

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
class _Action:
    """What every intent has: its job and attempt, and an idempotency key built from them.

    ``action_id`` is ``<job>/<attempt>/<KIND>/<target>``: planning the same
    intent twice gives the same id, so it is carried out once. ``KIND`` is
    also the action's kind in the store.
    """

    job_id: str
    attempt: int

    KIND: ClassVar[str]

    def target(self) -> str:
        """What, within the kind, tells this action from another of the same attempt."""
        raise NotImplementedError

    @property
    def action_id(self) -> str:
        """Idempotency key (the store's action id)."""
        return f"{self.job_id}/{self.attempt}/{self.KIND}/{self.target()}"


@dataclass(frozen=True)
class DrainNode(_Action):
    """Drain ``node`` in Slurm with reason ``resurgo: <cause> job=<id> user=<user> <reason>``.

    ``reason`` is the blame's evidence, which quotes what the job's agents
    reported (a culprit's reason, an error digest): in the Slurm reason it is
    one line of printable ASCII, at most :data:`MAX_DRAIN_DETAIL_CHARS`
    characters; the cause and job before it are the supervisor's own.
    """

    node: str
    cause: Cause
    reason: str
    user: str = ""  # the job's Slurm user (none in plans made before it was kept)

    @property
    def slurm_reason(self) -> str:
        """The reason string for ``scontrol update ... state=drain reason=...``."""
        detail = fragment(self.reason, MAX_DRAIN_DETAIL_CHARS)
        who = f" user={fragment(self.user, 32)}" if self.user else ""
        return f"{DRAIN_REASON_PREFIX} {self.cause.value} job={self.job_id}{who} {detail}".strip()

    KIND: ClassVar[str] = "drain"

    def target(self) -> str:
        """One drain of this node per job attempt."""
        return self.node


@dataclass(frozen=True)
class DrainTicket(_Action):
    """Ask the admins to drain ``node``: a supervisor without Slurm operator rights.

    The node is already out of the job (its relaunch and requeue exclude it);
    the ticket keeps it out of the user's later jobs until it expires or is
    forgiven, shows in ``resurgo nodes``, on ``/metrics`` and as an alert, and
    reaches the operator hook (``ticket_hook``) as JSON. ``evidence`` is the
    blame's, as a drain's reason would carry it.
    """

    node: str
    cause: Cause
    evidence: str
    user: str = ""  # the job's Slurm user

    KIND: ClassVar[str] = "ticket"

    def target(self) -> str:
        """One ticket for this node per job attempt."""
        return self.node


@dataclass(frozen=True)
class CheckNode(_Action):
    """Check ``node`` with a Slurm job of the supervisor's own before any drain.

    One job's evidence is its owner's word (a script can kill its own rank):
    the node is already out of that job, and the supervisor's own check, once
    the job has left the node, decides whether it is drained
    (:mod:`supervisor.core.drains`). ``evidence`` is the blame's.
    """

    node: str
    cause: Cause
    evidence: str
    user: str = ""  # the blaming job's Slurm user

    KIND: ClassVar[str] = "check"

    def target(self) -> str:
        """One check of this node per job attempt."""
        return self.node


@dataclass(frozen=True)
class ResumeNode(_Action):
    """Return ``node`` to service (``scontrol update state=resume``) after probation."""

    node: str

    KIND: ClassVar[str] = "resume"

    def target(self) -> str:
        """The node: one resume of it per attempt."""
        return self.node


@dataclass(frozen=True)
class StopRanks(_Action):
    """Tell every agent of the job to stop its ranks (SIGTERM, SIGKILL after ``grace_s``)."""

    grace_s: float

    KIND: ClassVar[str] = "stop_ranks"

    def target(self) -> str:
        """All ranks; the action id is also the command id the agents see."""
        return "all"


@dataclass(frozen=True)
class ValidateCheckpoints(_Action):
    """Validate the job's checkpoints newest first at ``level``.

    Report each as a :class:`~supervisor.core.observations.CheckpointValidated`,
    stopping at the first valid one; report ``path=None`` when none is left.
    ``skip`` lists paths already rejected in this recovery; ``before_step``
    (a rollback past a training anomaly) leaves out every checkpoint of a
    later step. ``storage_probe`` (after a storage failure, the how-manieth
    look): first check that the checkpoint root takes a checkpoint again, and
    report :class:`~supervisor.core.observations.StorageUnavailable` instead of
    validating if it does not (0: no check). ``settle_until_s`` (wall clock): a
    save still being written (the newest step directory has no commit marker
    yet) is awaited until then, so that a planned stop's final checkpoint,
    committed moments after the requeue was decided, is the one chosen.
    """

    level: ValidationLevel
    skip: tuple[str, ...] = ()
    before_step: int | None = None
    storage_probe: int = 0
    settle_until_s: float | None = None

    KIND: ClassVar[str] = "validate"

    def target(self) -> str:
        """How many paths are skipped: a retry after a rejection runs again; and each look
        at the storage is an action of its own."""
        skipped = str(len(self.skip))
        return skipped if not self.storage_probe else f"{skipped}.storage{self.storage_probe}"


@dataclass(frozen=True)
class ShrinkAllocation(_Action):
    """Shrink the running allocation to ``keep_nodes`` (``scontrol update NodeList=``)."""

    keep_nodes: tuple[str, ...]

    KIND: ClassVar[str] = "shrink"

    def target(self) -> str:
        """The nodes kept."""
        return ",".join(self.keep_nodes)


@dataclass(frozen=True)
class RelaunchStep(_Action):
    """Start a new srun step on ``nodes`` via the in-job driver (the fast path).

    ``resume_from`` becomes ``RESURGO_RESUME_FROM`` (None: start from scratch).
    The executor reports :class:`~supervisor.core.observations.RelaunchFinished`.
    """

    nodes: tuple[str, ...]
    resume_from: str | None

    KIND: ClassVar[str] = "relaunch"

    def target(self) -> str:
        """The size relaunched at: one relaunch per attempt."""
        return str(len(self.nodes))


@dataclass(frozen=True)
class RequeueSmaller(_Action):
    """Requeue the job with ``n_nodes`` excluding ``exclude`` (requeuehold, update, release).

    ``resume_from`` as for :class:`RelaunchStep`: the batch script reads it.
    """

    n_nodes: int
    exclude: tuple[str, ...]
    resume_from: str | None

    KIND: ClassVar[str] = "requeue"

    def target(self) -> str:
        """The size requeued at: one requeue per attempt."""
        return str(self.n_nodes)


@dataclass(frozen=True)
class Alert(_Action):
    """Tell a person; the core's way of saying "I will not do this by myself"."""

    severity: Severity
    message: str

    KIND: ClassVar[str] = "alert"

    def target(self) -> str:
        """The same message once per attempt."""
        return hashlib.sha256(self.message.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class StopJob(_Action):
    """End the job in Slurm (``scancel``) and record ``status`` with ``reason``."""

    status: JobState
    reason: str

    KIND: ClassVar[str] = "stop_job"

    def target(self) -> str:
        """The state the job ends in."""
        return self.status.value


@dataclass(frozen=True)
class PushInterval(_Action):
    """Send a new checkpoint interval to the job's agents."""

    interval_s: float

    KIND: ClassVar[str] = "interval"

    def target(self) -> str:
        """The interval, in whole seconds."""
        return f"{self.interval_s:.0f}"


Intent = (
    DrainNode
    | DrainTicket
    | CheckNode
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
