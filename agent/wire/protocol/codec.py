"""Events, replies, stream refusals and the driver's messages: to JSON bytes and back.

Encoding validates with the same rules as decoding, so what one side encodes
the other side decodes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from agent.wire.protocol.constants import (
    MAX_COMMANDS,
    MAX_EVENT_BYTES,
    MAX_EVENTS_PER_BATCH,
    MAX_QUARANTINE,
    MAX_RANKS,
    MAX_SHORT_TEXT_CHARS,
    MAX_SKIP_RANGES,
    MAX_SPARE_DETAIL_CHARS,
    MAX_TEXT_CHARS,
    PROTOCOL_VERSION,
)
from agent.wire.protocol.errors import ProtocolError
from agent.wire.protocol.fields import (
    _bool,
    _check_event_id_shape,
    _check_fields,
    _check_incarnation,
    _enum,
    _fail,
    _field,
    _float,
    _int,
    _list,
    _name,
    _object,
    _optional,
    _signed_int,
    _str,
    check_name,
)
from agent.wire.protocol.messages import (
    Command,
    CommandKind,
    DriverAction,
    DriverAnswer,
    DriverPhase,
    DriverRequest,
    Event,
    EventKind,
    Refusal,
    Reply,
    event_id_for,
)
from agent.wire.protocol.payloads import _COMMAND_ARGS, _COMMAND_EXTRA_CHECKS, _PAYLOADS
from agent.wire.protocol.strict_json import _dump, _envelope, _json_roundtrip, _load


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


def clip_text(text: str, max_chars: int = MAX_TEXT_CHARS) -> str:
    """``text`` cut to its last ``max_chars`` characters (tails matter in dumps and logs)."""
    if len(text) <= max_chars:
        return text
    marker = "[...clipped...]\n"
    return marker + text[len(text) - max_chars + len(marker) :]


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


def encode_reply(reply: Reply) -> bytes:
    """The body of every 200 answer from the supervisor."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "reply",
        "accepted_event_ids": list(reply.accepted_event_ids),
        "commands": command_documents(reply.commands),
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
    return Reply(commands=commands_from(document, "reply"), accepted_event_ids=accepted)


def command_documents(commands: Sequence[Command]) -> list[dict[str, Any]]:
    """The JSON of commands, as every reply carries them."""
    return [
        {"kind": command.kind.value, "command_id": command.command_id, "args": command.args}
        for command in commands
    ]


def commands_from(document: dict[str, Any], where_from: str) -> tuple[Command, ...]:
    """The checked ``commands`` list of a reply's document (``where_from`` names it)."""
    commands = []
    for index, item in enumerate(_list(document, "commands", where_from, max_items=MAX_COMMANDS)):
        where = f"{where_from}.commands[{index}]"
        command = _object(item, where)
        kind = _enum(command, "kind", where, CommandKind)
        args = _object(_field(command, "args", where), f"{where}.args")
        checked = _check_fields(args, _COMMAND_ARGS[kind], f"{where}.args")
        for check in _COMMAND_EXTRA_CHECKS.get(kind, ()):
            check(checked, f"{where}.args")
        commands.append(
            Command(kind=kind, command_id=_name(command, "command_id", where), args=checked)
        )
    return tuple(commands)


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
    if request.checked or request.unhealthy:
        # Absent otherwise: supervisors older than spare checks refuse no request they read.
        document["checked"] = list(request.checked)
        document["unhealthy"] = [[node, detail] for node, detail in request.unhealthy]
    if request.quarantined:
        document["quarantined"] = [list(pair) for pair in request.quarantined]
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
        checked=_node_names(document, "checked", where) if "checked" in document else (),
        unhealthy=_unhealthy(document, where) if "unhealthy" in document else (),
        quarantined=_text_pairs(document, "quarantined", where),
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
    if answer.skip_samples:
        # Absent when empty: drivers older than skips refuse no answer they used to read.
        document["skip_samples"] = [[start, end] for start, end in answer.skip_samples]
    if answer.check_spares:
        document["check_spares"] = list(answer.check_spares)
    if answer.quarantine:
        document["quarantine"] = [list(pair) for pair in answer.quarantine]
    if answer.aside_after_step is not None:
        document["aside_after_step"] = answer.aside_after_step
    data = _dump(document)
    decode_driver_answer(data)
    return data


def decode_driver_answer(data: bytes) -> DriverAnswer:
    """Parse the supervisor's answer to ``POST /v1/driver``."""
    where = "driver_answer"
    document = _envelope(_load(data, where), where)
    nodes = _node_names(document, "nodes", where) if document.get("nodes") is not None else None
    answer = DriverAnswer(
        action=_enum(document, "action", where, DriverAction),
        attempt=_int(document, "attempt", where, minimum=1),
        nodes=nodes,
        resume_from=_optional(document, "resume_from", where, _str),
        action_id=_optional(document, "action_id", where, _str),
        reason=_optional(document, "reason", where, _str) or "",
        retry_after_s=_float(document, "retry_after_s", where),
        skip_samples=_skip_samples(document, where) if "skip_samples" in document else (),
        check_spares=(
            _node_names(document, "check_spares", where) if "check_spares" in document else ()
        ),
        quarantine=_text_pairs(document, "quarantine", where),
        aside_after_step=(
            _int(document, "aside_after_step", where, minimum=0)
            if document.get("aside_after_step") is not None
            else None
        ),
    )
    if answer.action is DriverAction.RELAUNCH and (not answer.nodes or answer.action_id is None):
        _fail(f"{where}: a relaunch names its nodes and action_id")
    return answer


def _node_names(document: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    """A list of node names (each a checked name), at most one per rank."""
    return tuple(
        check_name(node, "node") if isinstance(node, str) else _fail(
            f"{where}.{key} must hold strings")
        for node in _list(document, key, where, max_items=MAX_RANKS)
    )  # fmt: skip


def _unhealthy(document: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """``[[node, what failed], ...]``: the spares whose health checks failed."""
    found = []
    for index, item in enumerate(_list(document, "unhealthy", where, max_items=MAX_RANKS)):
        at = f"{where}.unhealthy[{index}]"
        pair = isinstance(item, list) and len(item) == 2
        if not (pair and all(isinstance(part, str) for part in item)):
            _fail(f"{at} must be a [node, detail] pair of strings")
        found.append((check_name(item[0], "node"), clip_text(item[1], MAX_SPARE_DETAIL_CHARS)))
    return tuple(found)


def _text_pairs(document: Mapping[str, Any], key: str, where: str) -> tuple[tuple[str, str], ...]:
    """``[[text, text], ...]`` (absent: none): checkpoint paths and what goes with each."""
    if key not in document:
        return ()
    pairs = []
    for index, item in enumerate(_list(document, key, where, max_items=MAX_QUARANTINE)):
        pair = isinstance(item, list) and len(item) == 2
        if not (pair and all(isinstance(part, str) and part for part in item)):
            _fail(f"{where}.{key}[{index}] must be a pair of non-empty strings")
        if any(len(part) > MAX_SHORT_TEXT_CHARS for part in item):
            # A path cut short names another file: refused, never clipped.
            _fail(f"{where}.{key}[{index}] is longer than {MAX_SHORT_TEXT_CHARS} characters")
        pairs.append((item[0], item[1]))
    return tuple(pairs)


def _skip_samples(document: Mapping[str, Any], where: str) -> tuple[tuple[int, int], ...]:
    """``[[start, end], ...]``: half-open ranges of the ranks' global sample cursor."""
    ranges = []
    for index, item in enumerate(_list(document, "skip_samples", where, MAX_SKIP_RANGES)):
        at = f"{where}.skip_samples[{index}]"
        if not isinstance(item, list) or len(item) != 2:
            _fail(f"{at} must be a [start, end] pair")
        start = _int({"start": item[0]}, "start", at)
        end = _int({"end": item[1]}, "end", at, minimum=start + 1)
        ranges.append((start, end))
    return tuple(ranges)


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
