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
    SECRET,
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


def test_a_jobs_heartbeats_stream_takes_frames_signed_for_it_and_no_others() -> None:
    async def test(api: Api) -> None:
        path = protocol.JOB_HEARTBEATS_STREAM_PATH
        headers = protocol.signed_headers(SECRET, "GET", path, JOB, NOW, b"")
        async with api.session.ws_connect(api.url + path, headers=headers) as stream:
            body = batch("node1", "node2")
            await stream.send_bytes(protocol.sign_frame(SECRET, JOB, NOW, body, path))
            answer = protocol.decode_job_stream_answer((await stream.receive(timeout=10)).data)
            assert answer == ()
            # A frame signed for the agents' heartbeat stream is not one of this stream's.
            await stream.send_bytes(protocol.sign_frame(SECRET, JOB, NOW, body))
            refused = protocol.decode_job_stream_answer((await stream.receive(timeout=10)).data)
            assert isinstance(refused, protocol.Refusal) and refused.status == 401
            # Nor is a frame of another job's stream.
            await stream.send_bytes(protocol.sign_frame(SECRET, JOB, NOW, batch("node7"), path))
            refused = protocol.decode_job_stream_answer((await stream.receive(timeout=10)).data)
            assert isinstance(refused, protocol.Refusal) and refused.cause == "foreign_node"
        assert len(api.directory._jobs[JOB].job_heartbeats) == 1

    run(scenario(test))
