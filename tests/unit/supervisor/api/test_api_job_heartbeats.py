"""``POST /v1/job/heartbeats``: a job's aggregator speaks for the job's nodes, and no others."""

from __future__ import annotations

from agent.wire import protocol
from agent.wire.protocol import Command, CommandKind, JobHeartbeats, NodeBeat
from tests.unit.api_world import (
    INCARNATION,
    JOB,
    NOW,
    OTHER_JOB,
    OTHER_SECRET,
    Api,
    assert_refused,
    run,
    scenario,
)

PATH = protocol.JOB_HEARTBEATS_PATH


def batch(*nodes: str, job: str = JOB) -> bytes:
    beats = tuple(NodeBeat(node, INCARNATION, 1, NOW, 5) for node in nodes)
    return protocol.encode_job_heartbeats(JobHeartbeats(job, NOW, beats))


def test_a_jobs_heartbeats_are_taken_and_answered_with_each_agents_commands() -> None:
    stop = Command(CommandKind.STOP_RANKS, "c-9", {"grace_s": 30.0})

    async def test(api: Api) -> None:
        api.directory.queue_command(JOB, "node2", stop)
        answer = await api.send(PATH, batch("node1", "node2"))
        assert answer.status == 200, answer.body
        (agent,) = protocol.decode_job_reply(answer.body)
        assert (agent.node, agent.agent_incarnation, agent.commands) == (
            "node2",
            INCARNATION,
            (stop,),
        )
        (taken,) = api.directory._jobs[JOB].job_heartbeats
        assert [beat.node for beat in taken.beats] == ["node1", "node2"]

    run(scenario(test))


def test_a_jobs_heartbeats_about_other_nodes_other_jobs_or_malformed_are_refused() -> None:
    async def test(api: Api) -> None:
        assert_refused(await api.send(PATH, batch("node1", "node7")), 403, "foreign_node")
        assert_refused(await api.send(PATH, batch("node1", job=OTHER_JOB)), 403, "cross_job")
        assert_refused(
            await api.send(PATH, batch("node7", job=OTHER_JOB), secret=OTHER_SECRET, job=JOB),
            401,
            "bad_signature",
        )
        twice = batch("node1").replace(
            b"]]", b'],["node1","' + INCARNATION.encode() + b'",1,1.0,2]]'
        )
        assert_refused(await api.send(PATH, twice), 400, "malformed")
        assert_refused(await api.send(PATH, b'{"protocol":1}'), 400, "malformed")
        assert api.directory._jobs[JOB].job_heartbeats == []

    run(scenario(test))
