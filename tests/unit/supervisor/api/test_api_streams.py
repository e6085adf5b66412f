"""The supervisor's heartbeat stream: signed frames over one WebSocket per reporter.

The upgrade and every frame are signed and inside the replay window, a refused frame
is answered and the stream goes on, oversized frames, re-keyed jobs and shutdown
close it, and the real Reporter keeps one stream and replaces a broken or silent one.

Each test starts the real server (``serve`` on a free loopback port) over a
:class:`MemoryDirectory` and talks HTTP to it with aiohttp's client; the clock
is fixed at ``NOW`` so the replay window is exact (``api_world``).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import WSCloseCode, WSMsgType, web

from agent.node.client import Reporter
from agent.wire import protocol
from agent.wire.auth import new_secret
from agent.wire.protocol import Command, CommandKind, HeartbeatReport
from supervisor.api import bound_port, build_app, open_streams, serve, shutdown
from tests.unit.api_world import (
    JOB,
    NODES,
    NOW,
    OTHER_JOB,
    OTHER_SECRET,
    SECRET,
    Api,
    event,
    heartbeat,
    make_directory,
    run,
    scenario,
)

# -- the heartbeat stream ------------------------------------------------------------------


async def open_stream(
    api: Api, *, job: str = JOB, secret: bytes = SECRET, timestamp: int = NOW
) -> aiohttp.ClientWebSocketResponse:
    headers = protocol.signed_headers(
        secret, "GET", protocol.HEARTBEAT_STREAM_PATH, job, timestamp, b""
    )
    return await api.session.ws_connect(api.url + protocol.HEARTBEAT_STREAM_PATH, headers=headers)


async def streams_closed(app: web.Application) -> bool:
    """Whether the server let go of every stream within a few seconds (it closes them async)."""
    for _ in range(100):
        if open_streams(app) == 0:
            return True
        await asyncio.sleep(0.05)
    return False


def frame(body: bytes, *, secret: bytes = SECRET, job: str = JOB, timestamp: int = NOW) -> bytes:
    return protocol.sign_frame(secret, job, timestamp, body)


async def exchange(
    stream: aiohttp.ClientWebSocketResponse, body: bytes, *, signed: bool = True
) -> protocol.Reply | protocol.Refusal:
    await stream.send_bytes(frame(body) if signed else body)
    message = await stream.receive(timeout=10)
    assert message.type is WSMsgType.BINARY, message
    return protocol.decode_stream_answer(message.data)


def test_heartbeats_on_one_stream_are_taken_and_answered_with_their_commands() -> None:
    stop = Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 30.0})

    async def test(api: Api) -> None:
        async with await open_stream(api) as stream:
            assert open_streams(api.app) == 1
            assert await exchange(stream, heartbeat(time_unix_s=NOW - 2)) == protocol.Reply()
            api.directory.queue_command(JOB, "node1", stop)
            assert await exchange(stream, heartbeat(time_unix_s=NOW)) == protocol.Reply((stop,))
            assert await exchange(stream, heartbeat(time_unix_s=NOW)) == protocol.Reply()
            # A text frame holding the same JSON is taken as well.
            await stream.send_str(frame(heartbeat(node="node2")).decode())
            answer = protocol.decode_stream_answer((await stream.receive(timeout=10)).data)
            assert answer == protocol.Reply()
        assert api.directory.heartbeats(JOB)["node1"].time_unix_s == NOW
        assert set(api.directory.heartbeats(JOB)) == {"node1", "node2"}

    run(scenario(test))


@pytest.mark.parametrize(
    ("alteration", "status"),
    [
        ({"secret": OTHER_SECRET}, 401),  # signed with another job's secret
        ({"timestamp": NOW - protocol.REPLAY_WINDOW_S - 1}, 401),  # stale: a replayed upgrade
        ({"job": "9999"}, 401),  # a job the supervisor does not know
    ],
)
def test_an_upgrade_that_is_not_properly_signed_is_refused_and_opens_no_stream(
    alteration: dict[str, Any], status: int
) -> None:
    async def test(api: Api) -> None:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await open_stream(api, **alteration)
        assert refused.value.status == status
        unsigned = api.session.ws_connect(api.url + protocol.HEARTBEAT_STREAM_PATH)
        with pytest.raises(aiohttp.WSServerHandshakeError) as bare:
            await unsigned
        assert bare.value.status == 401
        assert open_streams(api.app) == 0
        assert api.directory.heartbeats(JOB) == {}

    run(scenario(test))


def test_a_refused_frame_is_answered_with_the_https_status_and_the_stream_goes_on() -> None:
    async def test(api: Api) -> None:
        async with await open_stream(api) as stream:
            refusals = [
                (b"{not json", 400, "malformed"),
                (heartbeat(job=OTHER_JOB, node="node7"), 403, "cross_job"),
                (heartbeat(node="node9"), 403, "foreign_node"),
                (protocol.encode_events([event(1)]), 400, "malformed"),
            ]
            for body, status, cause in refusals:
                answer = await exchange(stream, body)
                assert isinstance(answer, protocol.Refusal), answer
                assert (answer.status, answer.cause) == (status, cause)
                assert answer.reason and SECRET.hex() not in answer.reason
            assert api.directory.heartbeats(JOB) == {}
            assert api.directory.heartbeats(OTHER_JOB) == {}
            assert await exchange(stream, heartbeat()) == protocol.Reply()
        assert list(api.directory.heartbeats(JOB)) == ["node1"]

    run(scenario(test))


def test_every_frame_is_signed_and_inside_the_replay_window_like_a_request() -> None:
    """A captured upgrade or frame lets nobody speak for the job without its secret."""
    body = heartbeat()
    post_signature = protocol.sign(SECRET, "POST", protocol.HEARTBEAT_PATH, JOB, NOW, body)
    refused = [
        (body, "bad_signature"),  # no signing line
        (frame(body, secret=OTHER_SECRET), "bad_signature"),
        (frame(body, job=OTHER_JOB), "bad_signature"),  # signed as another job
        (frame(body)[:-2] + b"9}", "bad_signature"),  # altered after signing
        (f"{NOW} {post_signature}\n".encode() + body, "bad_signature"),  # a POST's signature
        (frame(body, timestamp=NOW - protocol.REPLAY_WINDOW_S - 1), "stale_timestamp"),
        (frame(body, timestamp=NOW + protocol.REPLAY_WINDOW_S + 1), "stale_timestamp"),
    ]

    async def test(api: Api) -> None:
        async with await open_stream(api) as stream:
            for data, cause in refused:
                answer = await exchange(stream, data, signed=False)
                assert isinstance(answer, protocol.Refusal), data[:90]
                assert (answer.status, answer.cause) == (401, cause), data[:90]
            assert api.directory.heartbeats(JOB) == {}
            edge = frame(body, timestamp=NOW - protocol.REPLAY_WINDOW_S)
            assert await exchange(stream, edge, signed=False) == protocol.Reply()

    run(scenario(test))


def test_a_frame_over_the_size_limit_closes_the_stream_unread() -> None:
    async def test(api: Api) -> None:
        async with await open_stream(api) as stream:
            await stream.send_bytes(b" " * 4097)
            message = await stream.receive(timeout=10)
            assert message.type is WSMsgType.CLOSE
            assert stream.close_code == WSCloseCode.MESSAGE_TOO_BIG
        assert await streams_closed(api.app)

    run(scenario(test, max_body_bytes=4096))


def test_the_stream_is_closed_when_its_job_id_now_has_another_secret() -> None:
    async def test(api: Api) -> None:
        async with await open_stream(api) as stream:
            assert await exchange(stream, heartbeat(time_unix_s=NOW - 1)) == protocol.Reply()
            # Slurm reused the job id for another job: the old stream speaks for nobody.
            api.directory.add_job(JOB, new_secret(), NODES)
            await stream.send_bytes(frame(heartbeat()))
            message = await stream.receive(timeout=10)
            assert message.type is WSMsgType.CLOSE
            assert stream.close_code == WSCloseCode.POLICY_VIOLATION
        assert api.directory.heartbeats(JOB) == {}
        assert await streams_closed(api.app)

    run(scenario(test))


def test_shutdown_closes_open_streams_without_waiting_out_its_timeout() -> None:
    async def test() -> None:
        directory = make_directory()
        app = build_app(directory, clock=lambda: NOW)
        runner = await serve(app, "127.0.0.1", 0, shutdown_timeout_s=30.0)
        async with aiohttp.ClientSession() as session:
            api = Api(f"http://127.0.0.1:{bound_port(runner)}", session, directory, app)
            streams = [await open_stream(api) for _ in range(3)]
            assert open_streams(app) == 3
            started = asyncio.get_running_loop().time()
            await shutdown(runner)
            assert asyncio.get_running_loop().time() - started < 5.0
            for stream in streams:
                message = await stream.receive(timeout=5)
                assert message.type in (WSMsgType.CLOSE, WSMsgType.CLOSED)
                await stream.close()

    run(test)


def test_the_reporter_keeps_one_stream_and_opens_another_after_it_broke(tmp_path: Path) -> None:
    stop = Command(CommandKind.STOP_RANKS, "c-7", {"grace_s": 5.0})
    received: list[Command] = []

    async def test(api: Api) -> None:
        reporter = Reporter(
            api.url, JOB, "node2", SECRET, tmp_path / "spool", clock=lambda: NOW,
            on_command=received.append,
        )  # fmt: skip
        async with reporter:
            report = HeartbeatReport(JOB, "node2", NOW, (), reporter.incarnation)
            for _ in range(3):
                assert await reporter.heartbeat(report)
            assert (reporter.streams_opened, open_streams(api.app)) == (1, 1)
            # The server side goes away (as at a supervisor restart).
            await api.app.shutdown()
            await asyncio.sleep(0.1)
            api.directory.queue_command(JOB, "node2", stop)
            assert not await reporter.heartbeat(report)  # found the stream closed
            assert await reporter.heartbeat(report)
            assert reporter.streams_opened == 2
            assert (reporter.heartbeats_sent, reporter.heartbeat_failures) == (4, 1)
        assert received == [stop]

    run(scenario(test))


def test_a_refused_heartbeat_fails_alone_and_keeps_the_reporters_stream(tmp_path: Path) -> None:
    async def test(api: Api) -> None:
        reporter = Reporter(api.url, JOB, "node9", SECRET, tmp_path / "spool", clock=lambda: NOW)
        async with reporter:
            report = HeartbeatReport(JOB, "node9", NOW, (), reporter.incarnation)
            assert not await reporter.heartbeat(report)  # node9 is not in the job
            api.directory.set_allocation(JOB, (*NODES, "node9"))
            assert await reporter.heartbeat(report)
            assert (reporter.streams_opened, reporter.heartbeat_failures) == (1, 1)

    run(scenario(test))


def test_a_stream_that_does_not_answer_times_out_and_is_replaced(tmp_path: Path) -> None:
    """A supervisor stalled mid-stream: the heartbeat fails in its timeout, the next reconnects."""
    opened: list[web.WebSocketResponse] = []

    async def silent(request: web.Request) -> web.WebSocketResponse:
        stream = web.WebSocketResponse()
        await stream.prepare(request)
        opened.append(stream)
        if len(opened) == 1:
            async for _ in stream:
                pass  # never answers
        else:
            async for _ in stream:
                await stream.send_bytes(protocol.encode_reply(protocol.Reply()))
        return stream

    async def test() -> None:
        app = web.Application()
        app.router.add_get(protocol.HEARTBEAT_STREAM_PATH, silent)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        try:
            reporter = Reporter(
                f"http://127.0.0.1:{bound_port(runner)}", JOB, "node1", SECRET,
                tmp_path / "spool", clock=lambda: NOW, heartbeat_timeout_s=0.5,
            )  # fmt: skip
            async with reporter:
                report = HeartbeatReport(JOB, "node1", NOW, (), reporter.incarnation)
                started = asyncio.get_running_loop().time()
                assert not await reporter.heartbeat(report)
                assert asyncio.get_running_loop().time() - started < 2.0
                assert await reporter.heartbeat(report)
                assert reporter.streams_opened == 2
                await reporter.close(drain_timeout_s=0.1)
        finally:
            await runner.cleanup()

    run(test)


def test_an_agent_going_away_mid_answer_is_not_an_error(caplog: pytest.LogCaptureFixture) -> None:
    """Upgrades and frames whose sender hung up before the answer: nothing logged as an error."""

    async def abandon(api: Api, *, upgraded: bool) -> None:
        host, port = api.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        path = protocol.HEARTBEAT_STREAM_PATH
        headers = protocol.signed_headers(SECRET, "GET", path, JOB, NOW, b"")
        lines = [f"GET {path} HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket",
                 "Connection: Upgrade", "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
                 "Sec-WebSocket-Version: 13",
                 *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        if upgraded:  # the stream is open: a frame (masked with a zero key), then gone
            assert b" 101 " in await reader.readuntil(b"\r\n\r\n")
            payload = frame(heartbeat())
            writer.write(bytes((0x82, 0x80 | 126)) + len(payload).to_bytes(2) + bytes(4) + payload)
        await writer.drain()
        writer.transport.abort()  # gone before any answer is written

    async def test(api: Api) -> None:
        for attempt in range(40):
            await abandon(api, upgraded=attempt % 2 == 1)
        assert await streams_closed(api.app)
        async with await open_stream(api) as stream:  # and the server serves on
            assert await exchange(stream, heartbeat()) == protocol.Reply()

    with caplog.at_level(logging.DEBUG, logger="supervisor.api"):
        run(scenario(test))
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert errors == [], [record.getMessage() for record in errors]
    left = [record.getMessage() for record in caplog.records]
    assert any("before its stream was opened" in message for message in left)
