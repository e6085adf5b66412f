"""The heartbeat's JSON: a msgspec fast path for canonical bodies, a checked path for the rest.

A supervisor decodes thousands of heartbeats a second. A body byte for byte as
:func:`encode_heartbeat` writes it is decoded by msgspec; any other is checked
field by field, and a refusal names the field.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import msgspec

from agent.wire.protocol.constants import (
    _INCARNATION,
    _INT_LIMIT,
    _NAME,
    MAX_BODY_BYTES,
    MAX_RANKS,
    MAX_SHORT_TEXT_CHARS,
    PROTOCOL_VERSION,
)
from agent.wire.protocol.errors import ProtocolError
from agent.wire.protocol.fields import (
    _check_incarnation,
    _float,
    _int,
    _list,
    _name,
    _object,
    _optional,
    _str,
)
from agent.wire.protocol.messages import HeartbeatReport, RankStatus
from agent.wire.protocol.strict_json import _dump, _envelope, _load


def encode_heartbeat(report: HeartbeatReport) -> bytes:
    """The body of ``POST /v1/heartbeat``."""
    data = _dump(heartbeat_document(report))
    decode_heartbeat(data)
    return data


def heartbeat_document(report: HeartbeatReport) -> dict[str, Any]:
    """The heartbeat's JSON document (also each whole report in a job's heartbeats)."""
    return {
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
    return report_from_wire(wire)


def report_from_wire(wire: _WireHeartbeat) -> HeartbeatReport | None:
    """The report msgspec decoded, or None when it lists a global rank twice."""
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
