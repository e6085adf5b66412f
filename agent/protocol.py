"""The agent <-> supervisor wire protocol, version 1: messages, JSON and signing.

The node agent POSTs signed JSON to the supervisor: batches of events
(:data:`EVENTS_PATH`) and heartbeat summaries (:data:`HEARTBEAT_PATH`). Every
reply is a :class:`Reply` that acknowledges events by id and carries commands
back. Heartbeats may instead go over one long-lived WebSocket per agent
(:data:`HEARTBEAT_STREAM_PATH`): the upgrade request is signed like a POST,
each frame holds one heartbeat body, and each is answered by one frame, a
:class:`Reply` or a :class:`Refusal` (:func:`decode_stream_answer`).
``docs/protocol.md`` is the contract in prose; this module is the one
implementation of it that both sides import.

Decoding is strict: a wrong protocol version, an unknown event or command
kind, a missing field, a wrong type or an oversized collection raises
:class:`ProtocolError` naming the problem; nothing else escapes ``decode_*``.
Fields this version does not know are ignored (and dropped), so a newer peer
can add fields without a version bump; a new kind is a version bump.
Encoding validates with the same rules, so what one side encodes the other
side decodes.

This module is pure: values in, bytes out and back, and no clock — the
signing timestamp and ``now`` are arguments.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NoReturn, TypeVar

import msgspec

from agent.errors import ResurgoError

PROTOCOL_VERSION = 1

HEADER_JOB = "X-Resurgo-Job"
HEADER_TIMESTAMP = "X-Resurgo-Timestamp"
HEADER_SIGNATURE = "X-Resurgo-Signature"
HEADER_PROTOCOL = "X-Resurgo-Protocol"

METHOD = "POST"
EVENTS_PATH = "/v1/events"
HEARTBEAT_PATH = "/v1/heartbeat"
# GET, upgraded to a WebSocket: heartbeats without a request's cost each.
HEARTBEAT_STREAM_PATH = "/v1/heartbeat/stream"
DRIVER_PATH = "/v1/driver"

# Requests whose timestamp is further than this from the verifier's clock are
# refused: it bounds how long a captured request can be replayed. Events are
# idempotent by id, so a replay inside the window changes nothing.
REPLAY_WINDOW_S = 300

# The longest an agent waits between two tries to reach an unreachable
# supervisor: one that comes back hears from every agent within this much.
RETRY_MAX_S = 10.0

# Size limits. A hang event carries the stack dump of every local rank, so the
# text limit is generous; the body limit leaves room for a batch of them.
MAX_BODY_BYTES = 8 << 20
MAX_EVENT_BYTES = 4 << 20
MAX_EVENTS_PER_BATCH = 1000
MAX_RANKS = 1024
MAX_COMMANDS = 100
MAX_TEXT_CHARS = 256 << 10
MAX_SHORT_TEXT_CHARS = 4096
MAX_ARGV_ITEMS = 1024
MAX_STEPS_PER_EVENT = 4096
# Integers are 64-bit signed on the wire: SQLite stores them as such.
_INT_LIMIT = 1 << 63

_SIGNATURE_SCHEME = "RESURGO-HMAC-SHA256"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}")
_INCARNATION = re.compile(r"[0-9a-f]{8,64}")
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
# A heartbeat stream frame's first line: the timestamp (as the header's) and the signature.
# One spelling per timestamp (no leading zeros): int() would read "0017" as 17,
# so two spellings would share one canonical string and one signature.
_FRAME_HEAD = re.compile(rb"(0|[1-9][0-9]{0,11}) ([0-9a-f]{64})")
_FRAME_HEAD_BYTES = 12 + 1 + 64 + 1
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")
_SEQ = re.compile(r"[1-9][0-9]{0,18}")

_E = TypeVar("_E", bound=enum.Enum)


class ProtocolError(ResurgoError):
    """A message does not follow the wire protocol; the message names the field and the rule."""


class AuthError(ResurgoError):
    """A request's signature is wrong or its timestamp is outside the replay window."""


class StaleTimestamp(AuthError):
    """A request's timestamp is outside the replay window (its signature was not checked)."""


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


class HangDetector(enum.Enum):
    """Which detector declared a rank hung (``hung[].detector`` of a HANG event)."""

    HEARTBEAT = "heartbeat"  # the in-rank library stopped reporting progress
    STACK = "stack"  # uninstrumented: the sampled stack sat unchanged in a collective


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


def make_event(
    kind: EventKind,
    job_id: str,
    node: str,
    incarnation: str,
    seq: int,
    time_unix_s: float,
    payload: Mapping[str, Any],
) -> Event:
    """Build a valid :class:`Event` or raise :class:`ProtocolError` saying what is wrong.

    The payload is checked against ``kind``'s fields and returned in its wire
    shape (floats as float, unknown fields dropped), so an event that would be
    refused by the supervisor is refused here, before it is spooled.
    """
    _check_incarnation(incarnation, "incarnation")
    document = {
        "kind": kind.value,
        "job_id": job_id,
        "node": node,
        "event_id": event_id_for(job_id, node, incarnation, seq),
        "seq": seq,
        "time_unix_s": time_unix_s,
        "payload": dict(payload),
    }
    return _event_from_doc(_json_roundtrip(document, "event"), "event")


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a valid job id or node name, else raise :class:`ProtocolError`."""
    if type(value) is str and _NAME.fullmatch(value):
        return value
    return _name({what: value}, what, "name")


def check_incarnation(value: str) -> str:
    """Return ``value`` if it is a valid incarnation token (8-64 lowercase hex digits)."""
    _check_incarnation(value, "incarnation")
    return value


def clip_text(text: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """``text`` cut to its last ``max_chars`` characters (tails matter in dumps and logs)."""
    if len(text) <= max_chars:
        return text
    marker = "[...clipped...]\n"
    return marker + text[len(text) - max_chars + len(marker) :]


# ---------------------------------------------------------------------------
# Encoding and decoding.


def encode_event(event: Event) -> bytes:
    """One event as a single JSON line body (no newline inside); used by the spool."""
    document = {"protocol": PROTOCOL_VERSION, "type": "event", **_event_to_doc(event)}
    data = _dump(document)
    if len(data) > MAX_EVENT_BYTES:
        raise ProtocolError(
            f"event {event.event_id} is {len(data)} bytes encoded; the limit is "
            f"{MAX_EVENT_BYTES}: clip long texts with clip_text()"
        )
    _event_from_doc(_envelope(_load(data, "event"), "event"), "event")
    return data


def decode_event(data: bytes) -> Event:
    """Parse one event written by :func:`encode_event`."""
    return _event_from_doc(_envelope(_load(data, "event", MAX_EVENT_BYTES), "event"), "event")


def encode_events(events: Sequence[Event]) -> bytes:
    """The body of ``POST /v1/events``: a batch of events, in the order they happened."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "events",
        "events": [_event_to_doc(event) for event in events],
    }
    data = _dump(document)
    decode_events(data)
    return data


def decode_events(data: bytes) -> tuple[Event, ...]:
    """Parse the body of ``POST /v1/events``; the order of the batch is kept."""
    document = _envelope(_load(data, "events"), "events")
    raw = _list(document, "events", "events", max_items=MAX_EVENTS_PER_BATCH, min_items=1)
    events = tuple(_event_from_doc(item, f"events[{index}]") for index, item in enumerate(raw))
    ids = [event.event_id for event in events]
    if len(set(ids)) != len(ids):
        raise ProtocolError("events: the batch lists the same event_id twice")
    return events


def encode_heartbeat(report: HeartbeatReport) -> bytes:
    """The body of ``POST /v1/heartbeat``."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "heartbeat",
        "job_id": report.job_id,
        "node": report.node,
        "time_unix_s": report.time_unix_s,
        "agent_incarnation": report.agent_incarnation,
        **({} if report.attempt is None else {"attempt": report.attempt}),
        "ranks": [
            {
                "global_rank": rank.global_rank,
                "local_rank": rank.local_rank,
                "pid": rank.pid,
                "step": rank.step,
                "phase": rank.phase,
                "last_progress_unix_s": rank.last_progress_unix_s,
                "step_time_p50_s": rank.step_time_p50_s,
                "step_time_p99_s": rank.step_time_p99_s,
                "step_time_mean_s": rank.step_time_mean_s,
                "steps_observed": rank.steps_observed,
                # Only from ranks that measure their compute time (older agents never).
                **(
                    {}
                    if rank.compute_p50_s is None and rank.compute_observed == 0
                    else {
                        "compute_p50_s": rank.compute_p50_s,
                        "compute_observed": rank.compute_observed,
                    }
                ),
            }
            for rank in report.ranks
        ],
    }
    data = _dump(document)
    decode_heartbeat(data)
    return data


def decode_heartbeat(data: bytes) -> HeartbeatReport:
    """Parse the body of ``POST /v1/heartbeat`` (and of each heartbeat stream frame)."""
    report = _canonical_heartbeat(data)
    return report if report is not None else _checked_heartbeat(data)


def _checked_heartbeat(data: bytes) -> HeartbeatReport:
    document = _envelope(_load(data, "heartbeat"), "heartbeat")
    ranks = [
        _plain_rank(item) or _checked_rank(item, f"heartbeat.ranks[{index}]")
        for index, item in enumerate(_list(document, "ranks", "heartbeat", max_items=MAX_RANKS))
    ]
    global_ranks = [rank.global_rank for rank in ranks]
    if len(set(global_ranks)) != len(global_ranks):
        raise ProtocolError("heartbeat.ranks lists the same global_rank twice")
    incarnation = _str(document, "agent_incarnation", "heartbeat")
    _check_incarnation(incarnation, "heartbeat.agent_incarnation")
    attempt = None
    if document.get("attempt") is not None:
        attempt = _int(document, "attempt", "heartbeat", minimum=1)
    return HeartbeatReport(
        job_id=_name(document, "job_id", "heartbeat"),
        node=_name(document, "node", "heartbeat"),
        time_unix_s=_float(document, "time_unix_s", "heartbeat"),
        ranks=tuple(ranks),
        agent_incarnation=incarnation,
        attempt=attempt,
    )


# The heartbeat as :func:`encode_heartbeat` writes it, for msgspec: field
# order, omitted defaults and every bound as the checked path's.
_Count = Annotated[int, msgspec.Meta(ge=0, le=_INT_LIMIT - 1)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
_WireName = Annotated[str, msgspec.Meta(pattern=rf"\A(?:{_NAME.pattern})\Z")]


class _WireRank(msgspec.Struct, kw_only=True, omit_defaults=True):
    global_rank: _Count
    local_rank: _Count
    pid: Annotated[int, msgspec.Meta(ge=1, le=_INT_LIMIT - 1)]
    step: _Count | None
    phase: Annotated[str, msgspec.Meta(max_length=MAX_SHORT_TEXT_CHARS)] | None
    last_progress_unix_s: _Seconds | None
    step_time_p50_s: _Seconds | None
    step_time_p99_s: _Seconds | None
    step_time_mean_s: _Seconds | None
    steps_observed: _Count
    compute_p50_s: _Seconds | None = None
    compute_observed: _Count = 0


class _WireHeartbeat(msgspec.Struct, kw_only=True, omit_defaults=True):
    protocol: Literal[1]
    type: Literal["heartbeat"]
    job_id: _WireName
    node: _WireName
    time_unix_s: _Seconds
    agent_incarnation: Annotated[str, msgspec.Meta(pattern=rf"\A(?:{_INCARNATION.pattern})\Z")]
    attempt: Annotated[int, msgspec.Meta(ge=1, le=_INT_LIMIT - 1)] | None = None
    ranks: Annotated[list[_WireRank], msgspec.Meta(max_length=MAX_RANKS)]


_WIRE_HEARTBEAT = msgspec.json.Decoder(_WireHeartbeat)
_WIRE_ENCODER = msgspec.json.Encoder()


def _canonical_heartbeat(data: bytes) -> HeartbeatReport | None:
    """The report, if ``data`` is byte for byte what :func:`encode_heartbeat` makes of one.

    A supervisor decodes thousands of heartbeats a second; this is about ten
    times cheaper than the checked path. It takes a body only if msgspec
    decodes it under the checked path's bounds *and* encodes the result back
    to the very same bytes: so no duplicate or unknown key, no integer where
    a float belongs, no escaped text, nothing the checked path could read
    differently. Anything else returns None, and the checked path decides,
    naming the field when it refuses.
    """
    if type(data) is not bytes or len(data) > MAX_BODY_BYTES:
        return None
    try:
        wire = _WIRE_HEARTBEAT.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None
    try:
        canonical = _WIRE_ENCODER.encode(wire)
    except UnicodeEncodeError:  # a lone surrogate from a \uXXXX escape
        return None
    if canonical != data:
        return None
    ranks = tuple(
        RankStatus(
            rank.global_rank,
            rank.local_rank,
            rank.pid,
            rank.step,
            rank.phase,
            rank.last_progress_unix_s,
            rank.step_time_p50_s,
            rank.step_time_p99_s,
            rank.step_time_mean_s,
            rank.steps_observed,
            rank.compute_p50_s,
            rank.compute_observed,
        )
        for rank in wire.ranks
    )
    if len({rank.global_rank for rank in ranks}) != len(ranks):
        return None
    return HeartbeatReport(
        wire.job_id, wire.node, wire.time_unix_s, ranks, wire.agent_incarnation, wire.attempt
    )


def _checked_rank(item: Any, where: str) -> RankStatus:
    """One heartbeat rank, checked field by field: the error names the field and the rule."""
    rank = _object(item, where)
    return RankStatus(
        global_rank=_int(rank, "global_rank", where),
        local_rank=_int(rank, "local_rank", where),
        pid=_int(rank, "pid", where, minimum=1),
        step=_optional(rank, "step", where, _int),
        phase=_optional(rank, "phase", where, _str),
        last_progress_unix_s=_optional(rank, "last_progress_unix_s", where, _float),
        step_time_p50_s=_optional(rank, "step_time_p50_s", where, _float),
        step_time_p99_s=_optional(rank, "step_time_p99_s", where, _float),
        step_time_mean_s=_optional(rank, "step_time_mean_s", where, _float),
        steps_observed=_int(rank, "steps_observed", where),
        # Absent from agents that measure no compute time (or predate it).
        compute_p50_s=(
            _optional(rank, "compute_p50_s", where, _float) if "compute_p50_s" in rank else None
        ),
        compute_observed=(
            _int(rank, "compute_observed", where) if "compute_observed" in rank else 0
        ),
    )


def _plain_rank(item: Any) -> RankStatus | None:
    """One heartbeat rank as every agent sends it, checked without a call per field.

    A supervisor decodes thousands of heartbeats a second, each with a rank per
    local GPU. This accepts only what :func:`_checked_rank` accepts, with the
    same values: counts as JSON integers in range, times as finite JSON floats
    >= 0, or null where allowed. Anything else (a time written as an integer,
    a missing field, a value out of range) returns None, and the checked path
    decides, naming the field when it refuses.
    """
    if type(item) is not dict:
        return None
    try:
        global_rank, local_rank = item["global_rank"], item["local_rank"]
        pid, steps_observed = item["pid"], item["steps_observed"]
        step, phase = item["step"], item["phase"]
        last_progress, p50 = item["last_progress_unix_s"], item["step_time_p50_s"]
        p99, mean = item["step_time_p99_s"], item["step_time_mean_s"]
    except KeyError:
        return None
    compute_p50 = item.get("compute_p50_s")
    compute_observed = item.get("compute_observed", 0)
    # type() is: bool is an int subclass, and true/false are not counts.
    for count in (global_rank, local_rank, steps_observed, compute_observed):
        if type(count) is not int or not 0 <= count < _INT_LIMIT:
            return None
    if type(pid) is not int or not 1 <= pid < _INT_LIMIT:
        return None
    if step is not None and (type(step) is not int or not 0 <= step < _INT_LIMIT):
        return None
    if phase is not None and (type(phase) is not str or len(phase) > MAX_SHORT_TEXT_CHARS):
        return None
    for seconds in (last_progress, p50, p99, mean, compute_p50):
        # NaN fails the comparison and infinity the bound: both go the checked way.
        if seconds is not None and (type(seconds) is not float or not 0.0 <= seconds < math.inf):
            return None
    return RankStatus(
        global_rank, local_rank, pid, step, phase, last_progress, p50, p99, mean,
        steps_observed, compute_p50, compute_observed,
    )  # fmt: skip


def encode_reply(reply: Reply) -> bytes:
    """The body of every 200 answer from the supervisor."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "reply",
        "accepted_event_ids": list(reply.accepted_event_ids),
        "commands": [
            {"kind": command.kind.value, "command_id": command.command_id, "args": command.args}
            for command in reply.commands
        ],
    }
    data = _dump(document)
    decode_reply(data)
    return data


def decode_reply(data: bytes) -> Reply:
    """Parse a supervisor's 200 answer."""
    return _reply_from(_envelope(_load(data, "reply"), "reply"))


def encode_refusal(refusal: Refusal) -> bytes:
    """A heartbeat stream's answer to a frame the supervisor refused."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "refusal",
        "status": refusal.status,
        "error": refusal.cause,
        "reason": refusal.reason,
    }
    data = _dump(document)
    decode_stream_answer(data)
    return data


def decode_stream_answer(data: bytes) -> Reply | Refusal:
    """Parse one frame the supervisor sent on the heartbeat stream: a reply or a refusal."""
    document = _object(_load(data, "stream answer"), "stream answer")
    if document.get("type") != "refusal":
        return _reply_from(_envelope(document, "reply"))
    document = _envelope(document, "refusal")
    status = _int(document, "status", "refusal", minimum=400)
    if status > 599:
        _fail(f"refusal.status {status} is not an HTTP error status")
    return Refusal(
        status=status,
        cause=_name(document, "error", "refusal"),
        reason=_str(document, "reason", "refusal"),
    )


def _reply_from(document: dict[str, Any]) -> Reply:
    accepted = tuple(
        _check_event_id_shape(value, f"reply.accepted_event_ids[{index}]")
        for index, value in enumerate(
            _list(document, "accepted_event_ids", "reply", max_items=MAX_EVENTS_PER_BATCH)
        )
    )
    commands = []
    for index, item in enumerate(_list(document, "commands", "reply", max_items=MAX_COMMANDS)):
        where = f"reply.commands[{index}]"
        command = _object(item, where)
        kind = _enum(command, "kind", where, CommandKind)
        args = _object(_field(command, "args", where), f"{where}.args")
        checked = _check_fields(args, _COMMAND_ARGS[kind], f"{where}.args")
        for check in _COMMAND_EXTRA_CHECKS.get(kind, ()):
            check(checked, f"{where}.args")
        commands.append(
            Command(kind=kind, command_id=_name(command, "command_id", where), args=checked)
        )
    return Reply(commands=tuple(commands), accepted_event_ids=accepted)


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


class DriverAction(enum.Enum):
    """What the supervisor tells the driver."""

    LAUNCH = "launch"  # start the agents on the current allocation
    RELAUNCH = "relaunch"  # start the agents on ``nodes``; confirm with RELAUNCHED
    WAIT = "wait"  # ask again after ``retry_after_s`` (a recovery is under way)
    STOP = "stop"  # the job ends: exit with a failure, saying ``reason``


@dataclass(frozen=True)
class DriverRequest:
    """The driver's question; ``exit_code`` with ENDED, ``action_id``/``ok`` with RELAUNCHED."""

    job_id: str
    phase: DriverPhase
    attempt: int | None = None
    exit_code: int | None = None
    action_id: str | None = None
    ok: bool | None = None
    reason: str = ""
    time_left_s: float | None = None  # with TIME_LIMIT: seconds until Slurm ends the job


@dataclass(frozen=True)
class DriverAnswer:
    """The supervisor's instruction; ``nodes`` None means the current allocation."""

    action: DriverAction
    attempt: int
    nodes: tuple[str, ...] | None = None
    resume_from: str | None = None
    action_id: str | None = None
    reason: str = ""
    retry_after_s: float = 2.0


def encode_driver_request(request: DriverRequest) -> bytes:
    """The body of ``POST /v1/driver``."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "driver_request",
        "job_id": request.job_id,
        "phase": request.phase.value,
        "attempt": request.attempt,
        "exit_code": request.exit_code,
        "action_id": request.action_id,
        "ok": request.ok,
        "reason": request.reason,
    }
    if request.time_left_s is not None:
        document["time_left_s"] = request.time_left_s
    data = _dump(document)
    decode_driver_request(data)
    return data


def decode_driver_request(data: bytes) -> DriverRequest:
    """Parse the body of ``POST /v1/driver``."""
    where = "driver_request"
    document = _envelope(_load(data, where, limit=64 << 10), where)
    request = DriverRequest(
        job_id=_name(document, "job_id", where),
        phase=_enum(document, "phase", where, DriverPhase),
        attempt=_optional(document, "attempt", where, lambda d, k, w: _int(d, k, w, minimum=1)),
        exit_code=_optional(document, "exit_code", where, _signed_int),
        action_id=_optional(document, "action_id", where, _str),
        ok=_optional(document, "ok", where, _bool),
        reason=_optional(document, "reason", where, _str) or "",
        # Newer than the first drivers: absent means unknown.
        time_left_s=(
            _optional(document, "time_left_s", where, _float) if "time_left_s" in document else None
        ),
    )
    if request.phase is DriverPhase.RELAUNCHED and (
        request.action_id is None or request.ok is None
    ):
        _fail(f"{where}: phase relaunched needs action_id and ok")
    return request


def encode_driver_answer(answer: DriverAnswer) -> bytes:
    """The body of the supervisor's answer to ``POST /v1/driver``."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "driver_answer",
        "action": answer.action.value,
        "attempt": answer.attempt,
        "nodes": None if answer.nodes is None else list(answer.nodes),
        "resume_from": answer.resume_from,
        "action_id": answer.action_id,
        "reason": answer.reason,
        "retry_after_s": answer.retry_after_s,
    }
    data = _dump(document)
    decode_driver_answer(data)
    return data


def decode_driver_answer(data: bytes) -> DriverAnswer:
    """Parse the supervisor's answer to ``POST /v1/driver``."""
    where = "driver_answer"
    document = _envelope(_load(data, where), where)
    nodes = _optional(document, "nodes", where, lambda d, k, w: _list(d, k, w, max_items=MAX_RANKS))
    if nodes is not None:
        nodes = tuple(check_name(node, "node") if isinstance(node, str) else _fail(
            f"{where}.nodes must hold strings") for node in nodes)  # fmt: skip
    answer = DriverAnswer(
        action=_enum(document, "action", where, DriverAction),
        attempt=_int(document, "attempt", where, minimum=1),
        nodes=nodes,
        resume_from=_optional(document, "resume_from", where, _str),
        action_id=_optional(document, "action_id", where, _str),
        reason=_optional(document, "reason", where, _str) or "",
        retry_after_s=_float(document, "retry_after_s", where),
    )
    if answer.action is DriverAction.RELAUNCH and (not answer.nodes or answer.action_id is None):
        _fail(f"{where}: a relaunch names its nodes and action_id")
    return answer


# ---------------------------------------------------------------------------
# Signing.


def canonical_string(method: str, path: str, job_id: str, timestamp_s: int, body: bytes) -> str:
    """The exact text that is signed: scheme, method, path, job, timestamp, body SHA-256.

    One field per line, ``\\n``-separated, no trailing newline; the body hash
    is lowercase hex. Newlines inside a field are refused so that no two
    different requests share a canonical string.
    """
    for name, value in (("method", method), ("path", path), ("job_id", job_id)):
        if not value or "\n" in value or "\r" in value:
            raise ProtocolError(f"{name} {value!r} cannot be signed: empty or has a newline")
    return "\n".join(
        (
            _SIGNATURE_SCHEME,
            method.upper(),
            path,
            job_id,
            str(int(timestamp_s)),
            hashlib.sha256(body).hexdigest(),
        )
    )


def sign(secret: bytes, method: str, path: str, job_id: str, timestamp_s: int, body: bytes) -> str:
    """HMAC-SHA256 of :func:`canonical_string` under the job's secret, lowercase hex."""
    message = canonical_string(method, path, job_id, timestamp_s, body).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(
    secret: bytes,
    method: str,
    path: str,
    job_id: str,
    timestamp_s: int,
    body: bytes,
    signature: str,
    now_s: int,
    window_s: int = REPLAY_WINDOW_S,
) -> None:
    """Return if ``signature`` signs this request and the timestamp is fresh; else raise.

    Raises :class:`StaleTimestamp` (an :class:`AuthError`) when the timestamp
    is more than ``window_s`` away from ``now_s`` (either direction: clocks
    drift both ways), :class:`AuthError` when the signature does not match
    (compared in constant time).
    """
    check_fresh(timestamp_s, now_s, window_s)
    verify_hashed(secret, method, path, job_id, timestamp_s, hashlib.sha256(body), signature)


def check_fresh(timestamp_s: int, now_s: int, window_s: int = REPLAY_WINDOW_S) -> None:
    """Raise :class:`StaleTimestamp` unless ``timestamp_s`` is within ``window_s`` of ``now_s``.

    It needs no body: a server can refuse a stale request before reading one.
    """
    skew = int(timestamp_s) - int(now_s)
    if abs(skew) > window_s:
        raise StaleTimestamp(
            f"request timestamp {timestamp_s} is {skew:+d} s from the verifier's clock "
            f"{now_s}; the window is ±{window_s} s: check the node's clock (NTP)"
        )


def verify_hashed(
    secret: bytes,
    method: str,
    path: str,
    job_id: str,
    timestamp_s: int,
    body_hash: Any,
    signature: str,
) -> None:
    """:func:`verify` without the window, given the body's SHA-256 object (``hashlib.sha256``)
    fed while the body streamed in; raise :class:`AuthError` when the signature is wrong."""
    if not _SIGNATURE.fullmatch(signature):
        # Refused before compare_digest, which raises TypeError on non-ASCII text.
        raise AuthError(
            f"bad signature for job {job_id!r}: {HEADER_SIGNATURE} is 64 lowercase hex digits"
        )
    try:
        head = canonical_string(method, path, job_id, timestamp_s, b"")
    except ProtocolError as error:
        raise AuthError(f"request cannot be verified: {error}") from error
    # The canonical string ends with the body's hash: the same text sign() makes.
    message = head[: -len(_EMPTY_SHA256)] + body_hash.hexdigest()
    expected = hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, expected):
        raise AuthError(
            f"bad signature for job {job_id!r}: the agent and the supervisor do not share "
            "the same job secret, or the request was altered"
        )


def is_signature(text: str) -> bool:
    """Whether ``text`` is spelled as a signature (64 lowercase hex digits)."""
    return _SIGNATURE.fullmatch(text) is not None


_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def sign_frame(secret: bytes, job_id: str, timestamp_s: int, body: bytes) -> bytes:
    """One heartbeat stream frame: ``<timestamp> <signature>\\n`` and the heartbeat body.

    The signature is the one a ``POST`` of ``body`` to
    :data:`HEARTBEAT_STREAM_PATH` would carry, so each frame is authenticated
    and bounded by the replay window exactly like a request, and a frame can
    never pass for a request to another path, nor a request for a frame.
    """
    signature = sign(secret, METHOD, HEARTBEAT_STREAM_PATH, job_id, timestamp_s, body)
    return f"{timestamp_s} {signature}\n".encode() + body


def open_frame(
    secret: bytes, job_id: str, frame: bytes, now_s: int, window_s: int = REPLAY_WINDOW_S
) -> bytes:
    """The heartbeat body of a frame :func:`sign_frame` made for ``job_id``; else raise.

    Raises :class:`AuthError` (a missing or malformed signing line, a stale
    timestamp, a bad signature), as :func:`verify` does for a request.
    """
    end = frame.find(b"\n", 0, _FRAME_HEAD_BYTES)
    match = None if end < 0 else _FRAME_HEAD.fullmatch(frame, 0, end)
    if match is None:
        raise AuthError(
            "a heartbeat frame starts with a line '<timestamp> <signature>' "
            "(protocol.sign_frame; docs/protocol.md, Heartbeat stream)"
        )
    body = frame[end + 1 :]
    timestamp_s = int(match[1])
    verify(secret, METHOD, HEARTBEAT_STREAM_PATH, job_id, timestamp_s, body,
           match[2].decode("ascii"), now_s=now_s, window_s=window_s)  # fmt: skip
    return body


def signed_headers(
    secret: bytes, method: str, path: str, job_id: str, timestamp_s: int, body: bytes
) -> dict[str, str]:
    """Every header a request needs: job, timestamp, signature and protocol version."""
    return {
        HEADER_JOB: job_id,
        HEADER_TIMESTAMP: str(int(timestamp_s)),
        HEADER_SIGNATURE: sign(secret, method, path, job_id, timestamp_s, body),
        HEADER_PROTOCOL: str(PROTOCOL_VERSION),
    }


# ---------------------------------------------------------------------------
# Field checkers. Each takes the containing object, the key and where it sits
# (for the message), and returns the value in its wire shape.

_Check = Callable[[Mapping[str, Any], str, str], Any]


def _fail(message: str) -> NoReturn:
    raise ProtocolError(message)


def _field(document: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in document:
        _fail(f"{where}: missing field {key!r}")
    return document[key]


def _int(document: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = _field(document, key, where)
    # bool is an int subclass; true/false are not counts.
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(f"{where}.{key} must be an integer, got {type(value).__name__}")
    if value < minimum or value >= _INT_LIMIT:
        _fail(f"{where}.{key} must be an integer in [{minimum}, 2**63), got {value}")
    return value


def _signed_int(document: Mapping[str, Any], key: str, where: str) -> int:
    return _int(document, key, where, minimum=-(1 << 63))


def _float(document: Mapping[str, Any], key: str, where: str) -> float:
    value = _field(document, key, where)
    if not isinstance(value, int | float) or isinstance(value, bool):
        _fail(f"{where}.{key} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        _fail(f"{where}.{key} is too large for a double")
    if not math.isfinite(number) or number < 0:
        _fail(f"{where}.{key} must be a finite number >= 0, got {value}")
    return number


def _finite_float(document: Mapping[str, Any], key: str, where: str) -> float:
    value = _field(document, key, where)
    if not isinstance(value, int | float) or isinstance(value, bool):
        _fail(f"{where}.{key} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        _fail(f"{where}.{key} is too large for a double")
    if not math.isfinite(number):
        _fail(f"{where}.{key} must be a finite number, got {value}")
    return number


def _positive_float(document: Mapping[str, Any], key: str, where: str) -> float:
    number = _float(document, key, where)
    if number <= 0:
        _fail(f"{where}.{key} must be > 0, got {number}")
    return number


def _bool(document: Mapping[str, Any], key: str, where: str) -> bool:
    value = _field(document, key, where)
    if not isinstance(value, bool):
        _fail(f"{where}.{key} must be true or false, got {type(value).__name__}")
    return value


def _str(
    document: Mapping[str, Any], key: str, where: str, max_chars: int = MAX_SHORT_TEXT_CHARS
) -> str:
    value = _field(document, key, where)
    if not isinstance(value, str):
        _fail(f"{where}.{key} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        _fail(f"{where}.{key} has {len(value)} characters; the limit is {max_chars}")
    return value


def _text(document: Mapping[str, Any], key: str, where: str) -> str:
    return _str(document, key, where, max_chars=MAX_TEXT_CHARS)


def _name(document: Mapping[str, Any], key: str, where: str) -> str:
    value = _str(document, key, where)
    if not _NAME.fullmatch(value):
        _fail(
            f"{where}.{key} {value[:64]!r} is not a name: 1-128 characters of "
            "letters, digits and ._:@+-, starting with a letter or digit"
        )
    return value


def _list(
    document: Mapping[str, Any], key: str, where: str, max_items: int, min_items: int = 0
) -> list[Any]:
    value = _field(document, key, where)
    if not isinstance(value, list):
        _fail(f"{where}.{key} must be a list, got {type(value).__name__}")
    if not min_items <= len(value) <= max_items:
        _fail(f"{where}.{key} has {len(value)} items; allowed {min_items} to {max_items}")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(f"{where} must be an object, got {type(value).__name__}")
    return value


def _argv(document: Mapping[str, Any], key: str, where: str) -> list[str]:
    items = _list(document, key, where, max_items=MAX_ARGV_ITEMS)
    for index, item in enumerate(items):
        if not isinstance(item, str) or len(item) > MAX_SHORT_TEXT_CHARS:
            _fail(f"{where}.{key}[{index}] must be a string of at most {MAX_SHORT_TEXT_CHARS}")
    return list(items)


def _enum(document: Mapping[str, Any], key: str, where: str, kind: type[_E]) -> _E:
    value = _field(document, key, where)
    try:
        return kind(value)
    except (ValueError, TypeError):
        known = ", ".join(repr(member.value) for member in kind)
        _fail(f"{where}.{key}: unknown {kind.__name__} {value!r}; this version knows {known}")


def _enum_value(kind: type[enum.Enum]) -> _Check:
    def check(document: Mapping[str, Any], key: str, where: str) -> Any:
        return _enum(document, key, where, kind).value

    return check


def _optional(document: Mapping[str, Any], key: str, where: str, check: _Check) -> Any:
    if _field(document, key, where) is None:
        return None
    return check(document, key, where)


def _nullable(check: _Check) -> _Check:
    def nullable(document: Mapping[str, Any], key: str, where: str) -> Any:
        return _optional(document, key, where, check)

    return nullable


def _objects(fields: tuple[_Spec, ...], max_items: int = MAX_RANKS) -> _Check:
    def check(document: Mapping[str, Any], key: str, where: str) -> list[dict[str, Any]]:
        items = _list(document, key, where, max_items=max_items)
        return [
            _check_fields(
                _object(item, f"{where}.{key}[{index}]"), fields, f"{where}.{key}[{index}]"
            )
            for index, item in enumerate(items)
        ]

    return check


def _stacks(document: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    stacks = _object(_field(document, key, where), f"{where}.{key}")
    if len(stacks) > MAX_RANKS:
        _fail(f"{where}.{key} has {len(stacks)} entries; the limit is {MAX_RANKS}")
    for rank in stacks:
        # JSON object keys are strings: global ranks go as decimal strings.
        if not _DECIMAL.fullmatch(rank):
            _fail(f"{where}.{key}: key {rank[:32]!r} is not a global rank as a decimal string")
        _text(stacks, rank, f"{where}.{key}")
    return dict(stacks)


@dataclass(frozen=True)
class _Spec:
    """One payload or argument field: its name, its check, and whether it may be absent."""

    name: str
    check: _Check
    required: bool = True


def _check_fields(
    document: Mapping[str, Any], specs: tuple[_Spec, ...], where: str
) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for spec in specs:
        if spec.name in document:
            checked[spec.name] = spec.check(document, spec.name, where)
        elif spec.required:
            _fail(f"{where}: missing field {spec.name!r}")
    return checked


_RANK_IDENTITY = (
    _Spec("global_rank", _int),
    _Spec("local_rank", _int),
    _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1)),
)
_EXIT_STATUS = (
    _Spec("exit_code", _nullable(_signed_int)),
    _Spec("signal", _nullable(lambda d, k, w: _int(d, k, w, minimum=1))),
)

_PAYLOADS: dict[EventKind, tuple[_Spec, ...]] = {
    EventKind.RANK_EXITED: (
        *_RANK_IDENTITY,
        *_EXIT_STATUS,
        _Spec("signal_name", _nullable(_str)),
        _Spec("last_step", _nullable(_int)),
        _Spec("phase", _nullable(_str)),
        # When the rank died by the shim's clock: the earliest death of a job is
        # its root cause, the others' exits follow from it.
        _Spec("exit_time_unix_s", _nullable(_float), required=False),
    ),
    EventKind.LAUNCHER_EXITED: (
        *_EXIT_STATUS,
        _Spec("signal_name", _nullable(_str), required=False),
        _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1), required=False),
    ),
    EventKind.HANG: (
        _Spec(
            "hung",
            _objects(
                (
                    *_RANK_IDENTITY,
                    _Spec("last_step", _nullable(_int)),
                    _Spec("phase", _nullable(_str)),
                    _Spec("seconds_since_progress", _float),
                    _Spec("timeout_s", _float),
                    _Spec("detector", _enum_value(HangDetector)),
                )
            ),
        ),
        _Spec("stacks", _stacks),
        # Most suspect first (agent.hang.culprit_hints): the rank behind, or
        # one whose stack is outside the collective everyone else waits in.
        _Spec(
            "culprits",
            _objects(
                (
                    _Spec("global_rank", _int),
                    _Spec("last_step", _nullable(_int)),
                    _Spec("in_collective", _nullable(_bool)),
                    _Spec("reason", _str),
                )
            ),
            required=False,
        ),
    ),
    EventKind.STRAGGLER: (
        _Spec("global_rank", _int),
        _Spec("local_rank", _int),
        _Spec("step_time_p50_s", _float),
        _Spec("step_time_p99_s", _float),
        _Spec("step_time_mean_s", _float),
        _Spec("steps_observed", _int),
        _Spec("node_median_step_time_s", _float),
    ),
    EventKind.HEALTH_CHECK_FAILED: (
        _Spec("command", _argv),
        _Spec("exit_code", _nullable(_signed_int)),
        _Spec("output_tail", _text),
        _Spec("timed_out", _bool, required=False),
    ),
    EventKind.CHECKPOINT_COMMITTED: (
        _Spec("step", _int),
        _Spec("path", _str),
        _Spec("global_rank", _int, required=False),
    ),
    EventKind.CHECKPOINT_WRITTEN: (
        _Spec("step", _int),
        _Spec("path", _str),
        _Spec("global_rank", _int),
        _Spec("total_bytes", _nullable(_int)),
        # Seconds from the rank's first beat in phase checkpoint to its first out of it.
        _Spec("duration_s", _nullable(_float), required=False),
    ),
    EventKind.RANKS_STOPPED: (
        _Spec("reason", _str),
        _Spec("command_id", _nullable(_name)),
        _Spec("grace_s", _float),
        _Spec(
            "ranks",
            _objects((*_RANK_IDENTITY, _Spec("method", _enum_value(StopMethod)), *_EXIT_STATUS)),
        ),
    ),
    EventKind.AGENT_STARTED: (
        _Spec("agent_version", _str),
        _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("argv", _argv),
        _Spec("nnodes", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("node_rank", _int),
        # The job's launch number the in-job driver gave this agent: the
        # supervisor ignores reports of agents from an earlier launch.
        _Spec("attempt", lambda d, k, w: _int(d, k, w, minimum=1), required=False),
    ),
    EventKind.AGENT_STOPPED: (_Spec("reason", _str),),
    EventKind.TIME_LIMIT_NEAR: (
        _Spec("end_unix_s", _float),
        _Spec("save_by_unix_s", _float),
        _Spec("attempt", _int),
        _Spec("final_checkpoint_requested", _bool, required=False),
    ),
    EventKind.WORLD_MISMATCH: (
        _Spec("global_rank", _int),
        _Spec("pid", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("world_size", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("local_world_size", lambda d, k, w: _int(d, k, w, minimum=1)),
        _Spec("nnodes", lambda d, k, w: _int(d, k, w, minimum=1)),
    ),
    EventKind.STEP_LOSSES: (
        _Spec("global_rank", _int),
        _Spec(
            "steps",
            _objects(
                (
                    _Spec("step", _int),
                    _Spec("loss", _nullable(_finite_float)),
                    _Spec("cursor", _nullable(_int)),
                ),
                max_items=MAX_STEPS_PER_EVENT,
            ),
        ),
    ),
}

_COMMAND_ARGS: dict[CommandKind, tuple[_Spec, ...]] = {
    CommandKind.STOP_RANKS: (
        _Spec("grace_s", _float),
        _Spec("reason", _str, required=False),
    ),
    CommandKind.SET_CHECKPOINT_INTERVAL: (
        _Spec("interval_s", _nullable(_positive_float)),
        _Spec("every_steps", _nullable(lambda d, k, w: _int(d, k, w, minimum=1))),
    ),
}


def _interval_is_set(args: Mapping[str, Any], where: str) -> None:
    if args["interval_s"] is None and args["every_steps"] is None:
        _fail(f"{where}: set interval_s, every_steps or both; both are null")


_COMMAND_EXTRA_CHECKS: dict[CommandKind, tuple[Callable[[Mapping[str, Any], str], None], ...]] = {
    CommandKind.SET_CHECKPOINT_INTERVAL: (_interval_is_set,),
}


def _check_incarnation(value: str, where: str) -> None:
    if not isinstance(value, str) or not _INCARNATION.fullmatch(value):
        _fail(f"{where} {str(value)[:80]!r} must be 8-64 lowercase hex digits")


def _check_event_id_shape(value: Any, where: str) -> str:
    if not isinstance(value, str):
        _fail(f"{where} must be a string, got {type(value).__name__}")
    parts = value.split("/")
    if (
        len(parts) != 4
        or not _NAME.fullmatch(parts[0])
        or not _NAME.fullmatch(parts[1])
        or not _INCARNATION.fullmatch(parts[2])
        or not _SEQ.fullmatch(parts[3])
    ):
        _fail(f"{where} {value[:200]!r} is not an event id job/node/incarnation/seq")
    return value


def _event_to_doc(event: Event) -> dict[str, Any]:
    return {
        "kind": event.kind.value,
        "job_id": event.job_id,
        "node": event.node,
        "event_id": event.event_id,
        "seq": event.seq,
        "time_unix_s": event.time_unix_s,
        "payload": event.payload,
    }


def _event_from_doc(value: Any, where: str) -> Event:
    document = _object(value, where)
    kind = _enum(document, "kind", where, EventKind)
    job_id = _name(document, "job_id", where)
    node = _name(document, "node", where)
    seq = _int(document, "seq", where, minimum=1)
    event_id = _check_event_id_shape(_field(document, "event_id", where), f"{where}.event_id")
    incarnation = event_id.split("/")[2]
    if event_id != event_id_for(job_id, node, incarnation, seq):
        _fail(f"{where}.event_id {event_id!r} does not match job_id, node and seq")
    payload = _object(_field(document, "payload", where), f"{where}.payload")
    return Event(
        kind=kind,
        job_id=job_id,
        node=node,
        event_id=event_id,
        seq=seq,
        time_unix_s=_float(document, "time_unix_s", where),
        payload=_check_fields(payload, _PAYLOADS[kind], f"{where}.payload"),
    )


def _reject_constant(name: str) -> NoReturn:
    _fail(f"JSON constant {name} is not allowed: numbers must be finite")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        keys = [key for key, _ in pairs]
        duplicate = next(key for key in keys if keys.count(key) > 1)
        _fail(f"JSON object has the key {duplicate[:64]!r} twice")
    return document


def _load(data: bytes, what: str, limit: int = MAX_BODY_BYTES) -> Any:
    if not isinstance(data, bytes | bytearray):
        _fail(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        _fail(f"{what}: {len(data)} bytes; the limit is {limit}")
    try:
        document = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
        )
    # ValueError covers JSONDecodeError and integers longer than Python's digit
    # limit; RecursionError, nesting deeper than the parser's stack.
    # The hooks' own ProtocolError is not a ValueError and passes through.
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ProtocolError(f"{what}: not valid UTF-8 JSON: {error}") from error
    if _holds_lone_surrogate(document):
        _fail(
            f"{what}: {_surrogate_place(document, what)} holds a lone surrogate (a "
            "\\ud800-\\udfff escape without its pair): text must be valid Unicode"
        )
    return document


def _strings(document: Any) -> Iterator[str]:
    """Every string of a decoded document, keys included."""
    pending = [document]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, value in item.items():
                yield key
                pending.append(value)
        elif isinstance(item, list):
            pending.extend(item)


def _holds_lone_surrogate(document: Any) -> bool:
    # Strict UTF-8 decoding already refused encoded surrogates; only JSON's
    # \uXXXX escapes can make one, and no UTF-8 writer (a log, a terminal,
    # the store's readers) can write it out again.
    return any(not text.isascii() and not is_unicode(text) for text in _strings(document))


def is_unicode(text: str) -> bool:
    """False for text the protocol cannot carry: a lone surrogate (e.g. undecodable
    bytes of a path kept by ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_place(document: Any, what: str) -> str:
    """Where the first lone surrogate is, as ``what.key[index]``, for the refusal."""
    pending: list[tuple[Any, str]] = [(document, what)]
    while pending:
        item, where = pending.pop(0)
        if isinstance(item, str) and not is_unicode(item):
            return where
        if isinstance(item, dict):
            for key, value in item.items():
                if not is_unicode(key):
                    return f"a key of {where}"
                pending.append((value, f"{where}.{key[:64]}"))
        elif isinstance(item, list):
            pending.extend((value, f"{where}[{index}]") for index, value in enumerate(item))
    return what


def _envelope(value: Any, message_type: str) -> dict[str, Any]:
    document = _object(value, message_type)
    version = _field(document, "protocol", message_type)
    # Only the integer: 1.0 and true compare equal to 1 but are other spellings.
    if type(version) is not int or version != PROTOCOL_VERSION:
        _fail(
            f"{message_type}: protocol version {version!r} is not supported; this "
            f"Resurgo speaks {PROTOCOL_VERSION}: run the same Resurgo version on "
            "agents and supervisor"
        )
    found = _field(document, "type", message_type)
    if found != message_type:
        _fail(f"{message_type}: message type is {found!r}, expected {message_type!r}")
    return document


def _dump(document: Mapping[str, Any]) -> bytes:
    try:
        # ensure_ascii keeps every line pure ASCII, so a spool line never
        # contains a raw newline or invalid UTF-8 whatever the stack text holds.
        return json.dumps(document, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as error:
        raise ProtocolError(
            f"cannot encode as JSON ({error}): values must be JSON types and numbers finite"
        ) from error


def _json_roundtrip(document: Mapping[str, Any], what: str) -> Any:
    """``document`` as a peer would read it: tuples become lists, keys strings."""
    return _load(_dump(document), what, limit=MAX_EVENT_BYTES)
