"""The agent <-> supervisor wire protocol, version 1: messages, JSON and signing.

The node agent POSTs signed JSON to the supervisor: batches of events
(:data:`EVENTS_PATH`) and heartbeat summaries (:data:`HEARTBEAT_PATH`). Every
reply is a :class:`Reply` that acknowledges events by id and carries commands
back. Heartbeats may instead go over one long-lived WebSocket per agent
(:data:`HEARTBEAT_STREAM_PATH`): the upgrade request is signed like a POST,
each frame holds one heartbeat body, and each is answered by one frame, a
:class:`Reply` or a :class:`Refusal` (:func:`decode_stream_answer`).
``docs/protocol.md`` is the contract in prose; this package is the one
implementation of it that both sides import, through the names below.

Decoding is strict: a wrong protocol version, an unknown event or command
kind, a missing field, a wrong type or an oversized collection raises
:class:`ProtocolError` naming the problem; nothing else escapes ``decode_*``.
Fields this version does not know are ignored (and dropped), so a newer peer
can add fields without a version bump; a new kind is a version bump.
Encoding validates with the same rules, so what one side encodes the other
side decodes.

The package is pure: values in, bytes out and back, and no clock — the
signing timestamp and ``now`` are arguments. Its modules, in the order they
build on each other:

- :mod:`~agent.wire.protocol.constants`: version, headers, paths, windows, limits
- :mod:`~agent.wire.protocol.errors`: :class:`ProtocolError`, :class:`AuthError`
- :mod:`~agent.wire.protocol.messages`: the message types (events, heartbeats,
  commands, replies, the in-job driver's request and answer)
- :mod:`~agent.wire.protocol.fields`: one checker per JSON field
- :mod:`~agent.wire.protocol.strict_json`: strict JSON load/dump and the envelope
- :mod:`~agent.wire.protocol.payloads`: the fields of each event and command kind
- :mod:`~agent.wire.protocol.codec`: events, replies, refusals, driver messages
- :mod:`~agent.wire.protocol.heartbeat`: heartbeats, with a msgspec fast path
- :mod:`~agent.wire.protocol.jobbeats`: a job's heartbeats at once, from its aggregator
- :mod:`~agent.wire.protocol.signing`: HMAC signing of requests and stream frames
"""

from __future__ import annotations

from agent.wire.protocol.codec import (
    clip_text,
    decode_driver_answer,
    decode_driver_request,
    decode_event,
    decode_events,
    decode_reply,
    decode_stream_answer,
    encode_driver_answer,
    encode_driver_request,
    encode_event,
    encode_events,
    encode_refusal,
    encode_reply,
    make_event,
)
from agent.wire.protocol.constants import (
    DRIVER_PATH,
    EVENTS_PATH,
    HEADER_JOB,
    HEADER_PROTOCOL,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    HEARTBEAT_PATH,
    HEARTBEAT_STREAM_PATH,
    JOB_HEARTBEATS_PATH,
    JOB_HEARTBEATS_STREAM_PATH,
    MAX_ARGV_ITEMS,
    MAX_BODY_BYTES,
    MAX_COMMANDS,
    MAX_EVENT_BYTES,
    MAX_EVENTS_PER_BATCH,
    MAX_JOB_NODES,
    MAX_JOB_REPORTS,
    MAX_RANKS,
    MAX_SHORT_TEXT_CHARS,
    MAX_SKIP_RANGES,
    MAX_SPARE_DETAIL_CHARS,
    MAX_STEPS_PER_EVENT,
    MAX_TEXT_CHARS,
    METHOD,
    PROTOCOL_VERSION,
    REPLAY_WINDOW_S,
    RETRY_MAX_S,
)
from agent.wire.protocol.errors import AuthError, ProtocolError, StaleTimestamp
from agent.wire.protocol.fields import check_incarnation, check_name

# The heartbeat decoder's two paths, for the tests that hold them to one answer.
from agent.wire.protocol.heartbeat import _canonical_heartbeat as _canonical_heartbeat
from agent.wire.protocol.heartbeat import _checked_heartbeat as _checked_heartbeat
from agent.wire.protocol.heartbeat import _checked_rank as _checked_rank
from agent.wire.protocol.heartbeat import _plain_rank as _plain_rank
from agent.wire.protocol.heartbeat import decode_heartbeat, encode_heartbeat
from agent.wire.protocol.jobbeats import (
    JobHeartbeats,
    NodeBeat,
    beat_of,
    decode_job_heartbeats,
    decode_job_reply,
    decode_job_stream_answer,
    encode_job_heartbeats,
    encode_job_reply,
    slowest_loaded_step,
)
from agent.wire.protocol.messages import (
    RELAYED_KINDS,
    AgentCommands,
    Command,
    CommandKind,
    DriverAction,
    DriverAnswer,
    DriverPhase,
    DriverRequest,
    Event,
    EventKind,
    HangDetector,
    HeartbeatReport,
    NonFinite,
    RankStatus,
    Refusal,
    Reply,
    StopMethod,
    event_id_for,
)
from agent.wire.protocol.signing import (
    canonical_string,
    check_fresh,
    is_signature,
    open_frame,
    sign,
    sign_frame,
    signed_headers,
    verify,
    verify_hashed,
)
from agent.wire.protocol.strict_json import is_unicode

__all__ = [
    "DRIVER_PATH",
    "EVENTS_PATH",
    "HEADER_JOB",
    "HEADER_PROTOCOL",
    "HEADER_SIGNATURE",
    "HEADER_TIMESTAMP",
    "HEARTBEAT_PATH",
    "HEARTBEAT_STREAM_PATH",
    "JOB_HEARTBEATS_PATH",
    "JOB_HEARTBEATS_STREAM_PATH",
    "MAX_ARGV_ITEMS",
    "MAX_BODY_BYTES",
    "MAX_COMMANDS",
    "MAX_EVENTS_PER_BATCH",
    "MAX_EVENT_BYTES",
    "MAX_JOB_NODES",
    "MAX_JOB_REPORTS",
    "MAX_RANKS",
    "MAX_SHORT_TEXT_CHARS",
    "MAX_SKIP_RANGES",
    "MAX_SPARE_DETAIL_CHARS",
    "MAX_STEPS_PER_EVENT",
    "MAX_TEXT_CHARS",
    "METHOD",
    "PROTOCOL_VERSION",
    "RELAYED_KINDS",
    "REPLAY_WINDOW_S",
    "RETRY_MAX_S",
    "AgentCommands",
    "AuthError",
    "Command",
    "CommandKind",
    "DriverAction",
    "DriverAnswer",
    "DriverPhase",
    "DriverRequest",
    "Event",
    "EventKind",
    "HangDetector",
    "HeartbeatReport",
    "JobHeartbeats",
    "NodeBeat",
    "NonFinite",
    "ProtocolError",
    "RankStatus",
    "Refusal",
    "Reply",
    "StaleTimestamp",
    "StopMethod",
    "beat_of",
    "canonical_string",
    "check_fresh",
    "check_incarnation",
    "check_name",
    "clip_text",
    "decode_driver_answer",
    "decode_driver_request",
    "decode_event",
    "decode_events",
    "decode_heartbeat",
    "decode_job_heartbeats",
    "decode_job_reply",
    "decode_job_stream_answer",
    "decode_reply",
    "decode_stream_answer",
    "encode_driver_answer",
    "encode_driver_request",
    "encode_event",
    "encode_events",
    "encode_heartbeat",
    "encode_job_heartbeats",
    "encode_job_reply",
    "encode_refusal",
    "encode_reply",
    "event_id_for",
    "is_signature",
    "is_unicode",
    "make_event",
    "open_frame",
    "sign",
    "sign_frame",
    "signed_headers",
    "slowest_loaded_step",
    "verify",
    "verify_hashed",
]
