"""The protocol's messages as values: events, heartbeats, commands, replies, the driver's.

Frozen dataclasses and enums only; their JSON forms are in
:mod:`agent.wire.protocol.codec` and :mod:`agent.wire.protocol.heartbeat`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class EventKind(enum.Enum):
    """What an event reports; the payload fields of each kind are in ``docs/protocol.md``."""

    RANK_EXITED = "rank_exited"  # one rank process ended (exit code or signal)
    LAUNCHER_EXITED = "launcher_exited"  # torchrun (or the user's command) itself ended
    HANG = "hang"  # ranks made no progress for longer than their timeout; stacks attached
    STRAGGLER = "straggler"  # one rank's step time is an outlier on this node
    HEALTH_CHECK_FAILED = "health_check_failed"  # the node health-check command failed
    CHECKPOINT_COMMITTED = "checkpoint_committed"  # a checkpoint's commit marker is durable
    # A script that imports nothing wrote its own checkpoint file (torch.save).
    CHECKPOINT_WRITTEN = "checkpoint_written"
    RANKS_STOPPED = "ranks_stopped"  # the agent stopped ranks (SIGTERM, then SIGKILL)
    AGENT_STARTED = "agent_started"  # an agent process started on the node
    AGENT_STOPPED = "agent_stopped"  # an agent process is about to exit
    STEP_LOSSES = "step_losses"  # per-step loss and data cursor, for resume verification
    # The time limit is near: the agent asks its ranks for a final checkpoint, then stops them.
    TIME_LIMIT_NEAR = "time_limit_near"
    # A rank's torchrun world is not the job's (nodes x ranks per node): a launch
    # inside a wrapper kept its own --nnodes or --standalone.
    WORLD_MISMATCH = "world_mismatch"


# What a job's aggregator may carry to the supervisor for its agents (agent.driver.eventrelay):
# nothing that starts or ends a recovery, which goes straight to the supervisor.
RELAYED_KINDS = frozenset({
    EventKind.STRAGGLER,
    EventKind.CHECKPOINT_COMMITTED,
    EventKind.CHECKPOINT_WRITTEN,
    EventKind.AGENT_STARTED,
    EventKind.STEP_LOSSES,
    EventKind.TIME_LIMIT_NEAR,
})  # fmt: skip


class HangDetector(enum.Enum):
    """Which detector declared a rank hung (``hung[].detector`` of a HANG event)."""

    HEARTBEAT = "heartbeat"  # the in-rank library stopped reporting progress
    STACK = "stack"  # uninstrumented: the sampled stack sat unchanged in a collective


class NonFinite(enum.Enum):
    """A rank's loss that was not a finite number (``steps[].non_finite`` of a
    STEP_LOSSES event, whose ``loss`` is then null)."""

    NAN = "nan"
    INF = "inf"
    NEG_INF = "-inf"

    @classmethod
    def of(cls, value: float) -> NonFinite:
        """The kind of a value that is not finite."""
        if value != value:  # NaN is the one float unequal to itself
            return cls.NAN
        return cls.INF if value > 0 else cls.NEG_INF


class StopMethod(enum.Enum):
    """How the agent ended a rank (``ranks[].method`` of a RANKS_STOPPED event)."""

    SIGTERM = "sigterm"  # exited within the grace period after SIGTERM
    SIGKILL = "sigkill"  # still alive after the grace period, killed
    ALREADY_EXITED = "already_exited"  # was gone before the agent signalled it


class CommandKind(enum.Enum):
    """What the supervisor asks an agent to do."""

    STOP_RANKS = "stop_ranks"  # SIGTERM every rank, SIGKILL after grace_s
    SET_CHECKPOINT_INTERVAL = "set_checkpoint_interval"  # new save interval for the job


@dataclass(frozen=True)
class Event:
    """One observation from a node agent, delivered at least once and applied once.

    ``event_id`` is the idempotency key, ``{job_id}/{node}/{incarnation}/{seq}``
    (see :func:`event_id_for`); the supervisor records an id once however often
    it arrives. ``seq`` counts from 1 within one agent incarnation. ``payload``
    is JSON-shaped (str keys; lists, not tuples) and its fields depend on
    ``kind``.
    """

    kind: EventKind
    job_id: str
    node: str
    event_id: str
    seq: int
    time_unix_s: float
    payload: dict[str, Any]

    @property
    def incarnation(self) -> str:
        """The token of the agent process run that emitted this event."""
        return self.event_id.split("/")[2]


@dataclass(frozen=True)
class RankStatus:
    """One rank as the agent sees it: progress and step-time statistics.

    ``step``, ``phase`` and ``last_progress_unix_s`` are None until the rank's
    first heartbeat; the step-time statistics are None until a step completed.
    ``compute_p50_s`` is the median of the rank's own measured compute time
    over its last ``compute_observed`` steps (None, 0: the rank measures none).
    """

    global_rank: int
    local_rank: int
    pid: int
    step: int | None
    phase: str | None
    last_progress_unix_s: float | None
    step_time_p50_s: float | None
    step_time_p99_s: float | None
    step_time_mean_s: float | None
    steps_observed: int
    compute_p50_s: float | None = None
    compute_observed: int = 0


@dataclass(frozen=True)
class HeartbeatReport:
    """The agent's periodic summary of every local rank; best effort, only the newest matters."""

    job_id: str
    node: str
    time_unix_s: float
    ranks: tuple[RankStatus, ...]
    agent_incarnation: str
    attempt: int | None = None  # the launch the agent belongs to (given by the in-job driver)


@dataclass(frozen=True)
class AgentCommands:
    """The commands for one agent (``node``, ``agent_incarnation``) in a job's reply."""

    node: str
    agent_incarnation: str
    commands: tuple[Command, ...]


@dataclass(frozen=True)
class Command:
    """An intent from the supervisor; the agent applies each ``command_id`` at most once."""

    kind: CommandKind
    command_id: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    """The supervisor's answer to any request: acknowledged event ids and commands."""

    commands: tuple[Command, ...] = ()
    accepted_event_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refusal:
    """A heartbeat refused on the stream: what the HTTP answer would have said.

    ``status`` is the HTTP status a POST of the same body would get, ``cause``
    the refusal's code (as in an HTTP answer's ``error``), ``reason`` for humans.
    """

    status: int
    cause: str
    reason: str


def event_id_for(job_id: str, node: str, incarnation: str, seq: int) -> str:
    """The idempotency key of the ``seq``-th event of one agent incarnation."""
    return f"{job_id}/{node}/{incarnation}/{seq}"


# ---------------------------------------------------------------------------
# The in-job driver's conversation: "what now?" and its answer.


class DriverPhase(enum.Enum):
    """Why the in-job driver asks (``POST /v1/driver``)."""

    START = "start"  # the batch script (re)started: how to launch?
    ENDED = "ended"  # the agents' srun step ended with a failure: what now?
    RUNNING = "running"  # the step of ``attempt`` still runs: has the supervisor moved on?
    RELAUNCHED = "relaunched"  # the outcome of starting a relaunch the supervisor ordered
    # The time limit is near (``time_left_s``); with ``exit_code``, the step stopped for it.
    TIME_LIMIT = "time_limit"
    # The idle hot spares' health checks ran: ``checked`` answered, ``unhealthy`` failed.
    SPARE_CHECK = "spare_check"


class DriverAction(enum.Enum):
    """What the supervisor tells the driver."""

    LAUNCH = "launch"  # start the agents on the current allocation
    RELAUNCH = "relaunch"  # start the agents on ``nodes``; confirm with RELAUNCHED
    WAIT = "wait"  # ask again after ``retry_after_s`` (a recovery is under way)
    STOP = "stop"  # the job ends: exit with a failure, saying ``reason``
    DONE = "done"  # the run completed (a rank died in its teardown only): exit 0


@dataclass(frozen=True)
class DriverRequest:
    """The driver's question; ``exit_code`` with ENDED, ``action_id``/``ok`` with RELAUNCHED,
    ``checked``/``unhealthy`` (node, what failed) with SPARE_CHECK; ``quarantined`` with the
    first question after a launch that moved checkpoints aside."""

    job_id: str
    phase: DriverPhase
    attempt: int | None = None
    exit_code: int | None = None
    action_id: str | None = None
    ok: bool | None = None
    reason: str = ""
    time_left_s: float | None = None  # with TIME_LIMIT: seconds until Slurm ends the job
    checked: tuple[str, ...] = ()
    unhealthy: tuple[tuple[str, str], ...] = ()
    # Checkpoints the driver moved into quarantine for the launch: (from, to), root-relative.
    quarantined: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class DriverAnswer:
    """The supervisor's instruction; ``nodes`` None means the current allocation.

    ``skip_samples``: half-open ``[start, end)`` ranges of the global sample
    cursor the ranks must not train on (after a rollback past a loss anomaly;
    :mod:`agent.skips`). ``check_spares``: idle hot spares whose health checks
    are due; the driver runs them beside the step and reports with SPARE_CHECK.
    ``quarantine``: see :mod:`agent.checkpoint.quarantine`.
    """

    action: DriverAction
    attempt: int
    nodes: tuple[str, ...] | None = None
    resume_from: str | None = None
    action_id: str | None = None
    reason: str = ""
    retry_after_s: float = 2.0
    skip_samples: tuple[tuple[int, int], ...] = ()
    check_spares: tuple[str, ...] = ()
    # With LAUNCH/RELAUNCH: checkpoints newer than ``resume_from`` that failed validation
    # (path, why); the driver moves them into quarantine before the launch.
    quarantine: tuple[tuple[str, str], ...] = ()
    # With LAUNCH/RELAUNCH after a rollback past a training anomaly: the step of
    # ``resume_from``. Every checkpoint of a later step is moved aside too, as the
    # driver finds them at the launch (a save the stopped run made after the validation).
    aside_after_step: int | None = None
