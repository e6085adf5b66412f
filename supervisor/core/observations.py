"""What the decision core consumes: observations, each a frozen value.

The daemon turns what it hears into these: agent events (:func:`from_event`),
Slurm polls, lease expiries, the executor's reports (a checkpoint validated, a
relaunch started) and a periodic :class:`Tick` that releases waits (hang and
rank exit evidence windows, restart backoff). Pure: no clock, no OS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
class AgentEvent:
    """An :class:`agent.wire.protocol.Event` reduced to the fields the core decides on.

    ``step`` is the rank's last step (RANK_EXITED), the committed step
    (CHECKPOINT_COMMITTED) or None. ``error_digest`` is a hash of the exception
    type and message when the agent sent one (payload ``error_digest``).
    ``detail`` is human text for explanations (health-check output tail,
    straggler numbers). ``exit_time_s`` is when a rank died (RANK_EXITED
    payload ``exit_time_unix_s``, by the clock of its node; None when not sent).
    """

    kind: EventKind
    node: str
    event_id: str
    time_s: float
    global_rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    step: int | None = None
    path: str | None = None
    culprits: tuple[Culprit, ...] = ()
    error_digest: str | None = None
    detail: str = ""
    exit_time_s: float | None = None
    time_left_s: float | None = None  # TIME_LIMIT_NEAR: until Slurm ends the job
    # HEALTH_CHECK_FAILED: the checks that failed (the operator's command, or
    # ``builtin:NAME`` for the agent's own, agent.node.healthchecks).
    failed_checks: tuple[str, ...] = ()
    # RANK_EXITED: the rank's uncaught exception type and when it reached the top
    # (payload ``raised``/``raised_time_unix_s``, agent.wire.raised), if it raised one.
    raised: str | None = None
    raised_time_s: float | None = None
    # RANK_EXITED: the rank's script ran to its end before it exited (a signal after
    # that came in its teardown).
    script_ended: bool = False


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
    AgentEvent
    | LeaseExpired
    | SilenceShared
    | StepEnded
    | SlurmJobSeen
    | SlurmNodeSeen
    | SpareCheckFailed
    | CheckpointValidated
    | RelaunchFinished
    | RequeueFailed
    | StepProgress
    | CancelRequested
    | TimeLimitNear
    | TrainingAnomaly
    | Tick
)


def _opt_int(payload: dict[str, Any], key: str) -> int | None:
    value = payload.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


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


def from_event(event: Event) -> AgentEvent:
    """The observation for a decoded, valid agent event."""
    payload = event.payload
    detail = ""
    if event.kind is EventKind.HEALTH_CHECK_FAILED:
        detail = str(payload.get("output_tail", ""))[-500:]
    elif event.kind is EventKind.WORLD_MISMATCH:
        nnodes, local = payload.get("nnodes"), payload.get("local_world_size")
        detail = (
            f"rank {payload.get('global_rank')} on {event.node} is in a world of "
            f"{payload.get('world_size')} ranks; the job's is {nnodes} nodes x {local} = "
            f"{nnodes * local if isinstance(nnodes, int) and isinstance(local, int) else '?'}"
        )
    elif event.kind is EventKind.STRAGGLER:
        detail = (
            f"rank {payload.get('global_rank')} p50 {payload.get('step_time_p50_s')}s vs "
            f"node median {payload.get('node_median_step_time_s')}s"
        )
    step = _opt_int(payload, "last_step")
    if event.kind is EventKind.CHECKPOINT_COMMITTED:
        step = _opt_int(payload, "step")
    digest = payload.get("error_digest")
    return AgentEvent(
        kind=event.kind,
        node=event.node,
        event_id=event.event_id,
        time_s=event.time_unix_s,
        global_rank=_opt_int(payload, "global_rank"),
        exit_code=_opt_int(payload, "exit_code"),
        signal=_opt_int(payload, "signal"),
        step=step,
        path=payload.get("path") if isinstance(payload.get("path"), str) else None,
        culprits=_culprits(payload) if event.kind is EventKind.HANG else (),
        error_digest=digest if isinstance(digest, str) else None,
        detail=detail,
        exit_time_s=_opt_float(payload, "exit_time_unix_s"),
        time_left_s=_time_left(event),
        failed_checks=_failed_checks(event),
        raised=payload.get("raised") if isinstance(payload.get("raised"), str) else None,
        raised_time_s=_opt_float(payload, "raised_time_unix_s"),
        script_ended=payload.get("script_ended") is True,
    )


def _failed_checks(event: Event) -> tuple[str, ...]:
    """A failed health gate's checks, by name (payload ``command``)."""
    names = event.payload.get("command")
    if event.kind is not EventKind.HEALTH_CHECK_FAILED or not isinstance(names, list):
        return ()
    return tuple(str(name) for name in names)


def _time_left(event: Event) -> float | None:
    """Seconds from the event to the job's end, both by the agent's clock (so the
    supervisor's own clock needs no agreement with the node's)."""
    end = _opt_float(event.payload, "end_unix_s")
    if event.kind is not EventKind.TIME_LIMIT_NEAR or end is None:
        return None
    return max(0.0, end - event.time_unix_s)
