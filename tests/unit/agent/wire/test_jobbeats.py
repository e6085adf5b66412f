"""A job's heartbeats on the wire: what the aggregator encodes the supervisor decodes, and
what no aggregator sends is refused with the field named."""

from __future__ import annotations

import json

import msgspec
import pytest

from agent.wire import protocol
from agent.wire.protocol import (
    AgentCommands,
    Command,
    CommandKind,
    HeartbeatReport,
    JobHeartbeats,
    NodeBeat,
    ProtocolError,
    RankStatus,
    Refusal,
)

INCARNATION = "9f2c1ab04d7e3310"


def rank(global_rank: int, step: int | None, phase: str | None = "train") -> RankStatus:
    return RankStatus(global_rank, global_rank % 8, 100 + global_rank, step, phase, 1.0,
                      0.5, 0.6, 0.5, 10, 0.4, 10)  # fmt: skip


def batch() -> JobHeartbeats:
    report = HeartbeatReport("4711", "node2", 5.0, (rank(8, 12), rank(9, 11)), INCARNATION, 2)
    beats = (NodeBeat("node1", INCARNATION, 2, 5.5, 12), protocol.beat_of(report))
    return JobHeartbeats("4711", 6.0, beats, (report,))


def test_a_jobs_heartbeats_round_trip_and_a_beat_is_its_nodes_slowest_loaded_step() -> None:
    sent = batch()
    assert protocol.decode_job_heartbeats(protocol.encode_job_heartbeats(sent)) == sent
    assert sent.beats[1] == NodeBeat("node2", INCARNATION, 2, 5.0, 11)
    # A rank still loading (phase init, step 0) is not the node's progress.
    loading = (rank(0, 0, "init"), rank(1, 7))
    assert protocol.slowest_loaded_step(loading) == 7
    assert protocol.slowest_loaded_step((rank(0, 0, "init"), rank(1, None))) is None


@pytest.mark.parametrize(
    ("change", "names"),
    [
        (lambda d: d["beats"].append(d["beats"][0]), "lists a node twice"),
        (lambda d: d["reports"].append(d["reports"][0]), "lists a node twice"),
        (lambda d: d["reports"][0].update(job_id="4712"), "is about job '4712'"),
        (
            lambda d: d["reports"][0]["ranks"].append(d["reports"][0]["ranks"][0]),
            "global_rank twice",
        ),
        (lambda d: d["beats"][0].__setitem__(1, "not-hex"), "$.beats[0][1]"),
        (lambda d: d["beats"][0].__setitem__(4, -1), "$.beats[0][4]"),
        (lambda d: d["beats"][0].append(1), "at most length 5"),
        (lambda d: d.update(protocol=2), "$.protocol"),
        (lambda d: d.update(beats=d["beats"] * (protocol.MAX_JOB_NODES + 1)), "$.beats"),
    ],
)
def test_what_no_aggregator_sends_is_refused_naming_where(change, names) -> None:  # type: ignore[no-untyped-def]
    document = json.loads(protocol.encode_job_heartbeats(batch()))
    change(document)
    with pytest.raises(ProtocolError) as refused:
        protocol.decode_job_heartbeats(json.dumps(document).encode())
    assert names in str(refused.value)


def test_a_job_reply_and_a_refusal_read_from_the_stream() -> None:
    stop = Command(CommandKind.STOP_RANKS, "c-3", {"grace_s": 30.0})
    agents = (AgentCommands("node2", INCARNATION, (stop,)),)
    assert protocol.decode_job_stream_answer(protocol.encode_job_reply(agents)) == agents
    refusal = Refusal(403, "foreign_node", "node 'node9' is not in job 4711")
    assert protocol.decode_job_stream_answer(protocol.encode_refusal(refusal)) == refusal
    with pytest.raises(ProtocolError):
        protocol.decode_job_reply(msgspec.json.encode({"protocol": 1, "type": "job_reply"}))
