"""A job's heartbeats in one request: what the job's aggregator forwards, and the answer.

Every node agent sends a heartbeat a second. A job's agents send theirs to the
aggregator in the job's in-job driver (``agent/driver/aggregator.py``), over
the same signed heartbeat stream they would open to the supervisor, and the
aggregator forwards one ``POST`` of :data:`JOB_HEARTBEATS_PATH` a period for
the whole job, signed with the job's secret:

- ``beats``: one compact entry per node heard in the period (a JSON array:
  node, agent incarnation, attempt, the time of its newest heartbeat, its
  slowest loaded rank's step): what renews the agent's lease and moves the
  job's progress;
- ``reports``: the whole heartbeat of each node whose ranks changed in
  anything but their counters (a pid, a phase, a compute time) since its last
  whole report went out, and of each node due again; at most
  :data:`MAX_JOB_REPORTS` a request, the others in the next periods.

The answer, a ``job_reply``, lists each agent's commands, which the
aggregator hands to that agent with the answer to its next heartbeat.

Decoding is msgspec's, typed and bounded; a refusal names the field (its
JSON path). Pure: values in, bytes out and back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from agent.wire.datagram import Phase
from agent.wire.protocol.codec import command_documents, commands_from, decode_stream_answer
from agent.wire.protocol.constants import (
    _INCARNATION,
    _INT_LIMIT,
    _NAME,
    MAX_JOB_NODES,
    MAX_JOB_REPORTS,
    PROTOCOL_VERSION,
)
from agent.wire.protocol.errors import ProtocolError
from agent.wire.protocol.fields import _list, _name, _object, _str
from agent.wire.protocol.heartbeat import _WireHeartbeat, heartbeat_document, report_from_wire
from agent.wire.protocol.messages import AgentCommands, HeartbeatReport, RankStatus, Refusal
from agent.wire.protocol.strict_json import _dump, _envelope, _load

_Count = Annotated[int, msgspec.Meta(ge=0, le=_INT_LIMIT - 1)]
_WireName = Annotated[str, msgspec.Meta(pattern=rf"\A(?:{_NAME.pattern})\Z")]
_WireIncarnation = Annotated[str, msgspec.Meta(pattern=rf"\A(?:{_INCARNATION.pattern})\Z")]


class NodeBeat(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One node's newest heartbeat, as its job's aggregator forwards it: what renews
    the agent's lease and moves the job's progress (its slowest loaded rank's step).

    Its own wire form (a JSON array), decoded by msgspec without a copy: a
    supervisor takes thousands a second.
    """

    node: _WireName
    agent_incarnation: _WireIncarnation
    attempt: Annotated[int, msgspec.Meta(ge=1, le=_INT_LIMIT - 1)] | None
    time_unix_s: Annotated[float, msgspec.Meta(ge=0.0)]
    step: _Count | None


@dataclass(frozen=True)
class JobHeartbeats:
    """A job's heartbeats of one period, from its aggregator: a beat for every node
    heard, and the whole report of each node whose ranks changed (or due again)."""

    job_id: str
    time_unix_s: float
    beats: tuple[NodeBeat, ...]
    reports: tuple[HeartbeatReport, ...] = ()


class _WireJobHeartbeats(msgspec.Struct, kw_only=True):
    protocol: Literal[1]
    type: Literal["job_heartbeats"]
    job_id: _WireName
    time_unix_s: Annotated[float, msgspec.Meta(ge=0.0)]
    beats: Annotated[list[NodeBeat], msgspec.Meta(max_length=MAX_JOB_NODES)]
    reports: Annotated[list[_WireHeartbeat], msgspec.Meta(max_length=MAX_JOB_REPORTS)] = []


_DECODER = msgspec.json.Decoder(_WireJobHeartbeats)
_LOADING = Phase.INIT.value


def slowest_loaded_step(ranks: Sequence[RankStatus]) -> int | None:
    """The step of a node's slowest rank, leaving out ranks still loading (phase
    init reports step 0, which is not the job's progress); None: no such rank."""
    steps = [rank.step for rank in ranks if rank.step is not None and rank.phase != _LOADING]
    return min(steps) if steps else None


def beat_of(report: HeartbeatReport) -> NodeBeat:
    """A node's heartbeat as its job's aggregator forwards it every period."""
    return NodeBeat(
        report.node,
        report.agent_incarnation,
        report.attempt,
        report.time_unix_s,
        slowest_loaded_step(report.ranks),
    )


_ENCODER = msgspec.json.Encoder()


def encode_job_heartbeats(batch: JobHeartbeats) -> bytes:
    """The body of ``POST`` :data:`JOB_HEARTBEATS_PATH`; checked as the supervisor will."""
    document = {
        "protocol": PROTOCOL_VERSION,
        "type": "job_heartbeats",
        "job_id": batch.job_id,
        "time_unix_s": batch.time_unix_s,
        "beats": batch.beats,
        "reports": [heartbeat_document(report) for report in batch.reports],
    }
    data = _ENCODER.encode(document)
    decode_job_heartbeats(data)
    return data


def decode_job_heartbeats(data: bytes) -> JobHeartbeats:
    """Parse a job's heartbeats; :class:`ProtocolError` names what is wrong.

    Besides the types and bounds: every whole report is about the batch's
    job, no node has two beats or two reports, no report lists a global rank
    twice.
    """
    try:
        wire = _DECODER.decode(data)
    except (msgspec.DecodeError, RecursionError) as error:
        raise ProtocolError(f"job_heartbeats: {error}") from None
    beats = tuple(wire.beats)
    if len({beat.node for beat in beats}) != len(beats):
        raise ProtocolError("job_heartbeats.beats lists a node twice")
    reports = []
    for index, item in enumerate(wire.reports):
        report = report_from_wire(item)
        if report is None:
            raise ProtocolError(f"job_heartbeats.reports[{index}] lists a global_rank twice")
        if report.job_id != wire.job_id:
            raise ProtocolError(
                f"job_heartbeats.reports[{index}] is about job {report.job_id!r}, "
                f"not {wire.job_id!r}"
            )
        reports.append(report)
    if len({report.node for report in reports}) != len(reports):
        raise ProtocolError("job_heartbeats.reports lists a node twice")
    return JobHeartbeats(wire.job_id, wire.time_unix_s, beats, tuple(reports))


def encode_job_reply(agents: Sequence[AgentCommands]) -> bytes:
    """The supervisor's answer to a job's heartbeats: each agent's commands."""
    document: dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "type": "job_reply",
        "agents": [
            {
                "node": agent.node,
                "agent_incarnation": agent.agent_incarnation,
                "commands": command_documents(agent.commands),
            }
            for agent in agents
        ],
    }
    data = _dump(document)
    decode_job_reply(data)
    return data


def decode_job_stream_answer(data: bytes) -> tuple[AgentCommands, ...] | Refusal:
    """Parse one frame of a job's heartbeat stream (or a POST's 200 answer): the
    agents' commands, or the refusal the request would have had."""
    if _object(_load(data, "stream answer"), "stream answer").get("type") == "refusal":
        refusal = decode_stream_answer(data)  # read as every stream's refusal
        if isinstance(refusal, Refusal):
            return refusal
        raise ProtocolError("stream answer: a refusal that reads as a reply")
    return decode_job_reply(data)


def decode_job_reply(data: bytes) -> tuple[AgentCommands, ...]:
    """Parse the supervisor's answer to a job's heartbeats."""
    document = _envelope(_load(data, "job_reply"), "job_reply")
    agents = []
    for index, item in enumerate(_list(document, "agents", "job_reply", max_items=MAX_JOB_NODES)):
        where = f"job_reply.agents[{index}]"
        entry = _object(item, where)
        agents.append(
            AgentCommands(
                node=_name(entry, "node", where),
                agent_incarnation=_str(entry, "agent_incarnation", where),
                commands=commands_from(entry, where),
            )
        )
    return tuple(agents)
