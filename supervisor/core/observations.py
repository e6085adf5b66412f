"""What the decision core consumes: observations, each a frozen value.

The daemon turns what it hears into these: agent events (:func:`from_event`,
one type per kind the core decides on, each with only that kind's fields),
Slurm polls, lease expiries, the executor's reports (a checkpoint validated, a
relaunch started) and a periodic :class:`Tick` that releases waits (hang and
rank exit evidence windows, restart backoff). Pure: no clock, no OS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from agent.wire.protocol import Event, EventKind


@dataclass(frozen=True)
class Culprit:
    """One hung rank from a HANG event's ``culprits`` (most suspect first on its node)."""

    global_rank: int
    last_step: int | None
    in_collective: bool | None
    seconds_since_progress: float | None
    reason: str = ""


@dataclass(frozen=True)
class AgentReport:
    """What every agent report the core decides on carries: the reporting node, the
    event's id, and when it was sent (``time_s``, by the node's clock).

    Each kind of report is a subclass naming its :class:`EventKind` (``KIND``)
    and holding only the fields that kind has; :func:`from_event` builds the
    right one from a decoded event.
    """

    KIND: ClassVar[EventKind]

    node: str
    event_id: str
    time_s: float


@dataclass(frozen=True, kw_only=True)
class RankExited(AgentReport):
    """One rank process ended (``rank_exited``).

    ``step`` is the rank's last step. ``error_digest`` is a hash of the
    exception type and message when the agent sent one. ``exit_time_s`` is when
    the rank died (payload ``exit_time_unix_s``, by the clock of its node; None
    when not sent). ``raised``/``raised_time_s``: the rank's uncaught exception
    type and when it reached the top (agent.wire.raised), if it raised one.
    ``script_ended``: the rank's script ran to its end before it exited (a
    signal after that came in its teardown). The evidence of what failed, each
    "" or None when not sent: ``message`` and ``errno`` of the exception,
    ``stderr_tail`` (its last lines on standard error), ``oom_kill`` and ``xid``
    (the kernel's lines), as :mod:`supervisor.core.failure_rules` reads them.
    ``ranks_left``: the node's ranks still running after this one (None: the agent
    did not know them all), 0 when this was the node's last.
    """

    KIND: ClassVar[EventKind] = EventKind.RANK_EXITED

    global_rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    step: int | None = None
    error_digest: str | None = None
    exit_time_s: float | None = None
    raised: str | None = None
    raised_time_s: float | None = None
    script_ended: bool = False
    message: str = ""
    errno: int | None = None
    stderr_tail: str = ""
    oom_kill: str | None = None
    xid: str | None = None
    ranks_left: int | None = None


@dataclass(frozen=True, kw_only=True)
class HangReported(AgentReport):
    """A node's ranks made no progress for longer than their timeout (``hang``);
    ``culprits`` most suspect first. ``stalled``: evidence only, none of the
    node's ranks waits in a collective (they are what peers elsewhere may wait
    for); such a report never starts a recovery by itself."""

    KIND: ClassVar[EventKind] = EventKind.HANG

    culprits: tuple[Culprit, ...] = ()
    stalled: bool = False


@dataclass(frozen=True, kw_only=True)
class HealthCheckFailed(AgentReport):
    """The node failed its health gate before a launch (``health_check_failed``).

    ``detail``: the output's tail; ``failed_checks``: the checks that failed
    (the operator's command, or ``builtin:NAME`` for the agent's own,
    agent.node.healthchecks).
    """

    KIND: ClassVar[EventKind] = EventKind.HEALTH_CHECK_FAILED

    detail: str = ""
    failed_checks: tuple[str, ...] = ()


@dataclass(frozen=True, kw_only=True)
class StragglerReported(AgentReport):
    """One rank's step time is an outlier (``straggler``); ``detail`` its numbers."""

    KIND: ClassVar[EventKind] = EventKind.STRAGGLER

    global_rank: int | None = None
    detail: str = ""


@dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(AgentReport):
    """A checkpoint's commit marker is durable (``checkpoint_committed``)."""

    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT_COMMITTED

    step: int | None = None
    path: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointWritten(AgentReport):
    """A checkpoint a script wrote itself is complete (``checkpoint_written``): a
    ``torch.save`` file, a DCP directory, a framework's checkpoint; its step when
    the agent could tell it."""

    KIND: ClassVar[EventKind] = EventKind.CHECKPOINT_WRITTEN

    step: int | None = None
    path: str | None = None


@dataclass(frozen=True)
class LauncherExited(AgentReport):
    """torchrun (or the user's command) ended on the node (``launcher_exited``): every
    exit of its ranks is reported."""

    KIND: ClassVar[EventKind] = EventKind.LAUNCHER_EXITED


@dataclass(frozen=True)
class AgentStopped(AgentReport):
    """The node's agent is about to exit (``agent_stopped``)."""

    KIND: ClassVar[EventKind] = EventKind.AGENT_STOPPED


@dataclass(frozen=True, kw_only=True)
class TimeLimitNoticed(AgentReport):
    """An agent's word that the time limit is near (``time_limit_near``); ``time_left_s``
    until Slurm ends the job (None: unknown). The driver's is :class:`TimeLimitNear`."""

    KIND: ClassVar[EventKind] = EventKind.TIME_LIMIT_NEAR

    time_left_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class WorldMismatched(AgentReport):
    """A rank's torchrun world is not the job's (``world_mismatch``); ``detail`` says how."""

    KIND: ClassVar[EventKind] = EventKind.WORLD_MISMATCH

    detail: str = ""


AgentObservation = (
    RankExited
    | HangReported
    | HealthCheckFailed
    | StragglerReported
    | CheckpointCommitted
    | CheckpointWritten
    | LauncherExited
    | AgentStopped
    | TimeLimitNoticed
    | WorldMismatched
)
"""An agent report the core decides on, one type per :class:`EventKind`."""


@dataclass(frozen=True)
class LeaseExpired:
    """The node's agent stopped calling in for longer than its lease."""

    node: str


@dataclass(frozen=True)
class SilenceShared:
    """The agents on ``nodes`` stopped calling in together with others: a common
    cause (:mod:`supervisor.core.silence`), no node fault; ``reason`` says why."""

    nodes: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class StepEnded:
    """The in-job driver's word: the srun step of ``attempt`` ended with ``exit_code``,
    and no agent of the attempt has reported since (supervisor.intake)."""

    attempt: int | None
    exit_code: int | None


@dataclass(frozen=True)
class SlurmJobSeen:
    """The job as ``squeue --json`` showed it (a failed poll is no observation at all).

    ``state`` is Slurm's job state name (RUNNING, PENDING, PREEMPTED, TIMEOUT,
    NODE_FAIL, COMPLETED, FAILED, CANCELLED, ...); ``reason`` Slurm's reason text.
    """

    state: str
    nodes: tuple[str, ...]
    restart_count: int
    reason: str = ""


@dataclass(frozen=True)
class SlurmNodeSeen:
    """One node as ``sinfo --json`` showed it."""

    node: str
    down: bool = False
    not_responding: bool = False
    drained: bool = False


@dataclass(frozen=True)
class SpareCheckFailed:
    """An idle hot spare failed the health gate the driver ran on it; ``detail``: the
    failing checks' lines."""

    node: str
    detail: str


@dataclass(frozen=True)
class CheckpointValidated:
    """The executor validated one candidate, newest first; ``path`` None: none left."""

    step: int | None
    path: str | None
    valid: bool
    reason: str = ""


@dataclass(frozen=True)
class StorageUnavailable:
    """A look at the checkpoint root during the storage wait of ``attempt``'s recovery
    found it unusable; ``detail`` says what was seen (full, read-only, ...),
    ``filesystem`` the root's mount point ("" unknown)."""

    attempt: int
    detail: str
    filesystem: str = ""


@dataclass(frozen=True)
class RelaunchFinished:
    """The executor's report on a :class:`~supervisor.core.intents.RelaunchStep` of ``attempt``."""

    attempt: int
    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class RequeueFailed:
    """Slurm refused the requeue of ``attempt`` for good (the job left slurmctld)."""

    attempt: int
    reason: str


@dataclass(frozen=True)
class StepProgress:
    """Heartbeats show the job made a training step (``step``)."""

    step: int


@dataclass(frozen=True)
class CancelRequested:
    """An operator or the user asked to cancel the job."""

    reason: str = ""


@dataclass(frozen=True)
class TimeLimitNear:
    """The in-job driver's word: the time limit is ``time_left_s`` away (None: unknown);
    with ``stopped``, the ranks stopped for it (the step of ``attempt`` ended)."""

    time_left_s: float | None
    stopped: bool = False
    attempt: int | None = None


@dataclass(frozen=True)
class TrainingAnomaly:
    """The training signal of ``attempt`` went bad without an error (supervisor.intake,
    from :class:`supervisor.core.anomaly.LossWatch`).

    ``kind``: the :class:`~supervisor.core.anomaly.AnomalyKind` value;
    ``onset_step`` its first bad step; ``ranks`` the ranks bad at that step and
    ``nodes`` their nodes when they alone were (empty: no node can be told
    apart); ``cursor`` the global sample cursor before the onset step and
    ``batch`` the global batch size, where the script reports a cursor.
    """

    kind: str
    onset_step: int
    attempt: int
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    cursor: int | None
    batch: int | None
    detail: str


@dataclass(frozen=True)
class Tick:
    """Time passed; closes the hang and rank exit evidence windows, releases the backoff."""


Observation = (
    AgentObservation
    | LeaseExpired
    | SilenceShared
    | StepEnded
    | SlurmJobSeen
    | SlurmNodeSeen
    | SpareCheckFailed
    | CheckpointValidated
    | RelaunchFinished
    | StorageUnavailable
    | RequeueFailed
    | StepProgress
    | CancelRequested
    | TimeLimitNear
    | TrainingAnomaly
    | Tick
    # A kind decided through its entry in supervisor.core.faults alone (its own
    # type, reading and decision there): the last case of decide.
    | AgentReport
)


def _opt_int(payload: dict[str, Any], key: str) -> int | None:
    value = payload.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _opt_str(payload: dict[str, Any], key: str) -> str | None:
    value = payload.get(key)
    return value if isinstance(value, str) else None


def _opt_float(payload: dict[str, Any], key: str) -> float | None:
    value = payload.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _culprits(payload: dict[str, Any]) -> tuple[Culprit, ...]:
    # Seconds since progress sit in ``hung``, the order in ``culprits``; join them by rank.
    since = {h["global_rank"]: float(h["seconds_since_progress"]) for h in payload.get("hung", [])}
    return tuple(
        Culprit(
            global_rank=c["global_rank"],
            last_step=c.get("last_step"),
            in_collective=c.get("in_collective"),
            seconds_since_progress=since.get(c["global_rank"]),
            reason=c.get("reason", ""),
        )
        for c in payload.get("culprits", [])
    )


def from_event(event: Event) -> AgentObservation:
    """The observation for a decoded, valid agent event of a kind the core decides on.

    Raises :class:`ValueError` for any other kind (``agent_started``,
    ``step_losses``, ...): the daemon keeps those and decides nothing on them.
    """
    reading = _READINGS.get(event.kind)
    if reading is None:
        raise ValueError(f"the decision core takes no {event.kind.value} event")
    return reading(event)


def _rank_exited(event: Event) -> RankExited:
    payload = event.payload
    digest, raised = payload.get("error_digest"), payload.get("raised")
    return RankExited(
        event.node,
        event.event_id,
        event.time_unix_s,
        global_rank=_opt_int(payload, "global_rank"),
        exit_code=_opt_int(payload, "exit_code"),
        signal=_opt_int(payload, "signal"),
        step=_opt_int(payload, "last_step"),
        error_digest=digest if isinstance(digest, str) else None,
        exit_time_s=_opt_float(payload, "exit_time_unix_s"),
        raised=raised if isinstance(raised, str) else None,
        raised_time_s=_opt_float(payload, "raised_time_unix_s"),
        script_ended=payload.get("script_ended") is True,
        ranks_left=_opt_int(payload, "ranks_left"),
        message=_opt_str(payload, "raised_message") or "",
        errno=_opt_int(payload, "errno"),
        stderr_tail=_opt_str(payload, "stderr_tail") or "",
        oom_kill=_opt_str(payload, "oom_kill"),
        xid=_opt_str(payload, "xid"),
    )


def _hang(event: Event) -> HangReported:
    return HangReported(
        event.node,
        event.event_id,
        event.time_unix_s,
        culprits=_culprits(event.payload),
        stalled=event.payload.get("stalled") is True,
    )


def _health_check_failed(event: Event) -> HealthCheckFailed:
    names = event.payload.get("command")
    return HealthCheckFailed(
        event.node,
        event.event_id,
        event.time_unix_s,
        detail=str(event.payload.get("output_tail", ""))[-500:],
        # The failed checks, by name (payload ``command``).
        failed_checks=tuple(str(name) for name in names) if isinstance(names, list) else (),
    )


def _straggler(event: Event) -> StragglerReported:
    payload = event.payload
    detail = (
        f"rank {payload.get('global_rank')} p50 {payload.get('step_time_p50_s')}s vs "
        f"node median {payload.get('node_median_step_time_s')}s"
    )
    return StragglerReported(
        event.node,
        event.event_id,
        event.time_unix_s,
        global_rank=_opt_int(payload, "global_rank"),
        detail=detail,
    )


def _checkpoint(
    kind: type[CheckpointCommitted | CheckpointWritten],
) -> Callable[[Event], AgentObservation]:
    def read(event: Event) -> AgentObservation:
        path = event.payload.get("path")
        return kind(
            event.node,
            event.event_id,
            event.time_unix_s,
            step=_opt_int(event.payload, "step"),
            path=path if isinstance(path, str) else None,
        )

    return read


def _time_limit_noticed(event: Event) -> TimeLimitNoticed:
    # Seconds from the event to the job's end, both by the agent's clock (so the
    # supervisor's own clock needs no agreement with the node's).
    end = _opt_float(event.payload, "end_unix_s")
    left = None if end is None else max(0.0, end - event.time_unix_s)
    return TimeLimitNoticed(event.node, event.event_id, event.time_unix_s, time_left_s=left)


def _world_mismatched(event: Event) -> WorldMismatched:
    payload = event.payload
    nnodes, local = payload.get("nnodes"), payload.get("local_world_size")
    detail = (
        f"rank {payload.get('global_rank')} on {event.node} is in a world of "
        f"{payload.get('world_size')} ranks; the job's is {nnodes} nodes x {local} = "
        f"{nnodes * local if isinstance(nnodes, int) and isinstance(local, int) else '?'}"
    )
    return WorldMismatched(event.node, event.event_id, event.time_unix_s, detail=detail)


def _bare(kind: type[LauncherExited | AgentStopped]) -> Callable[[Event], AgentObservation]:
    def read(event: Event) -> AgentObservation:
        return kind(event.node, event.event_id, event.time_unix_s)

    return read


# How each kind the core decides on is read from its event; a kind added to
# AgentObservation needs its reading here (tests/unit/test_faults.py checks).
_READINGS: dict[EventKind, Callable[[Event], AgentObservation]] = {
    EventKind.RANK_EXITED: _rank_exited,
    EventKind.HANG: _hang,
    EventKind.HEALTH_CHECK_FAILED: _health_check_failed,
    EventKind.STRAGGLER: _straggler,
    EventKind.CHECKPOINT_COMMITTED: _checkpoint(CheckpointCommitted),
    EventKind.CHECKPOINT_WRITTEN: _checkpoint(CheckpointWritten),
    EventKind.LAUNCHER_EXITED: _bare(LauncherExited),
    EventKind.AGENT_STOPPED: _bare(AgentStopped),
    EventKind.TIME_LIMIT_NEAR: _time_limit_noticed,
    EventKind.WORLD_MISMATCH: _world_mismatched,
}
