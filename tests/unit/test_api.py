"""The supervisor's HTTP API on 127.0.0.1: every answer it can give, and a real agent round trip.

Each test starts the real server (``serve`` on a free loopback port) over a
:class:`MemoryDirectory` and talks HTTP to it with aiohttp's client; the clock
is fixed at ``NOW`` so the replay window is exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tenacity
from aiohttp import WSCloseCode, WSMsgType, web
from aiohttp.web_protocol import RequestHandler

from agent.node.client import Reporter
from agent.wire import protocol
from agent.wire.auth import new_secret
from agent.wire.protocol import (
    Command,
    CommandKind,
    Event,
    EventKind,
    HeartbeatReport,
    RankStatus,
)
from supervisor.api import (
    MemoryDirectory,
    RefusalLog,
    bound_port,
    build_app,
    open_streams,
    serve,
    shutdown,
)
from supervisor.api.app import INTAKE_AT_ONCE

NOW = 1_760_000_000
JOB = "4711"
OTHER_JOB = "4712"
NODES = ("node1", "node2")
SECRET = new_secret()
OTHER_SECRET = new_secret()
INCARNATION = "9f2c1ab04d7e3310"


def make_directory() -> MemoryDirectory:
    directory = MemoryDirectory()
    directory.add_job(JOB, SECRET, NODES)
    directory.add_job(OTHER_JOB, OTHER_SECRET, ("node7",))
    return directory


def event(seq: int, *, job: str = JOB, node: str = "node1") -> Event:
    return protocol.make_event(
        EventKind.CHECKPOINT_COMMITTED,
        job,
        node,
        INCARNATION,
        seq,
        NOW,
        {"step": seq, "path": "/c"},
    )


def heartbeat(*, job: str = JOB, node: str = "node1", time_unix_s: float = NOW) -> bytes:
    rank = RankStatus(0, 0, 4242, 10, "train", NOW - 1.0, 0.5, 0.9, 0.55, 10)
    return protocol.encode_heartbeat(HeartbeatReport(job, node, time_unix_s, (rank,), INCARNATION))


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class Api:
    url: str
    session: aiohttp.ClientSession
    directory: MemoryDirectory
    app: web.Application

    async def send(
        self,
        path: str,
        body: bytes = b"",
        *,
        method: str = "POST",
        job: str = JOB,
        secret: bytes = SECRET,
        timestamp: int = NOW,
        signed_path: str | None = None,
        signed_body: bytes | None = None,
        headers: dict[str, str] | None = None,
        drop: Sequence[str] = (),
    ) -> Answer:
        """Send a request signed like an agent would, with the given alterations."""
        signed = protocol.signed_headers(
            secret,
            method,
            signed_path or path,
            job,
            timestamp,
            body if signed_body is None else signed_body,
        )
        for name in drop:
            signed.pop(name)
        signed.update(headers or {})
        async with self.session.request(
            method, self.url + path, data=body, headers=signed
        ) as response:
            return Answer(response.status, await response.read(), dict(response.headers))


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 30.0) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario(), timeout_s)

    asyncio.run(bounded())


@contextlib.asynccontextmanager
async def running(directory: MemoryDirectory | None = None, **settings: Any) -> AsyncIterator[Api]:
    directory = make_directory() if directory is None else directory
    app = build_app(directory, clock=lambda: NOW, **settings)
    runner = await serve(app, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            yield Api(f"http://127.0.0.1:{bound_port(runner)}", session, directory, app)
    finally:
        await shutdown(runner)


def scenario(
    test: Callable[[Api], Awaitable[None]], **settings: Any
) -> Callable[[], Awaitable[None]]:
    async def wrapped() -> None:
        async with running(**settings) as api:
            await test(api)

    return wrapped


def assert_refused(answer: Answer, status: int, cause: str) -> dict[str, Any]:
    assert answer.status == status, answer.body
    document = answer.json()
    assert document["error"] == cause
    assert document["reason"]
    assert SECRET.hex() not in answer.body.decode()
    assert "Traceback" not in answer.body.decode()
    return document


# -- 200 ---------------------------------------------------------------------


def test_healthz_answers_without_credentials() -> None:
    async def test(api: Api) -> None:
        async with api.session.get(api.url + "/healthz") as response:
            assert response.status == 200
            document = await response.json()
        assert document["status"] == "ok"
        assert SECRET.hex() not in json.dumps(document)

    run(scenario(test))


def test_signed_events_are_recorded_once_and_acknowledged() -> None:
    async def test(api: Api) -> None:
        events = [event(1), event(2)]
        answer = await api.send(protocol.EVENTS_PATH, protocol.encode_events(events))
        assert answer.status == 200
        reply = protocol.decode_reply(answer.body)
        assert reply.accepted_event_ids == tuple(e.event_id for e in events)
        assert api.directory.events(JOB) == events

    run(scenario(test))


def test_replay_inside_the_window_is_acknowledged_again_and_recorded_once() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1)])
        first = await api.send(protocol.EVENTS_PATH, body)
        again = await api.send(protocol.EVENTS_PATH, body)
        assert first.status == again.status == 200
        assert first.body == again.body
        assert api.directory.events(JOB) == [event(1)]

    run(scenario(test))


def test_heartbeat_is_taken_and_an_older_one_does_not_replace_it() -> None:
    async def test(api: Api) -> None:
        newer = await api.send(protocol.HEARTBEAT_PATH, heartbeat(time_unix_s=NOW))
        older = await api.send(protocol.HEARTBEAT_PATH, heartbeat(time_unix_s=NOW - 5))
        assert newer.status == older.status == 200
        assert protocol.decode_reply(newer.body).accepted_event_ids == ()
        assert api.directory.heartbeats(JOB)["node1"].time_unix_s == NOW

    run(scenario(test))


def test_commands_ride_on_the_reply_to_their_node_once() -> None:
    async def test(api: Api) -> None:
        stop = Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 30.0})
        api.directory.queue_command(JOB, "node2", stop)
        other_node = await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node1"))
        assert protocol.decode_reply(other_node.body).commands == ()
        first = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1, node="node2")])
        )
        second = await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node2"))
        assert protocol.decode_reply(first.body).commands == (stop,)
        assert protocol.decode_reply(second.body).commands == ()

    run(scenario(test))


def test_a_batch_mixing_nodes_gets_no_commands() -> None:
    async def test(api: Api) -> None:
        api.directory.queue_command(
            JOB, "node1", Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 1.0})
        )
        body = protocol.encode_events([event(1, node="node1"), event(1, node="node2")])
        answer = await api.send(protocol.EVENTS_PATH, body)
        assert answer.status == 200
        assert protocol.decode_reply(answer.body).commands == ()

    run(scenario(test))


def test_job_status_is_signed_with_the_jobs_secret() -> None:
    async def test(api: Api) -> None:
        await api.send(protocol.EVENTS_PATH, protocol.encode_events([event(1)]))
        answer = await api.send(f"/v1/jobs/{JOB}", method="GET")
        assert answer.status == 200
        document = answer.json()
        assert document["job_id"] == JOB
        assert document["status"]["nodes"] == list(NODES)
        assert document["status"]["events"] == 1
        unsigned = await api.send(f"/v1/jobs/{JOB}", method="GET", drop=[protocol.HEADER_SIGNATURE])
        assert_refused(unsigned, 401, "missing_auth")

    run(scenario(test))


# -- 401 ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "header", [protocol.HEADER_JOB, protocol.HEADER_TIMESTAMP, protocol.HEADER_SIGNATURE]
)
def test_unauthenticated_request_is_refused_401(header: str) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), drop=[header]
        )
        assert_refused(answer, 401, "missing_auth")
        assert api.directory.events(JOB) == []

    run(scenario(test))


@pytest.mark.parametrize(
    "headers",
    [
        # Fullwidth digits: int() would take them.
        {protocol.HEADER_TIMESTAMP: "\uff11\uff17\uff16\uff10"},
        {protocol.HEADER_TIMESTAMP: "1_760_000_000"},
        {protocol.HEADER_TIMESTAMP: "-1"},
        {protocol.HEADER_TIMESTAMP: "9" * 5000},
        {protocol.HEADER_JOB: "../4711"},
    ],
)
def test_malformed_signing_headers_are_refused_401(headers: dict[str, str]) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), headers=headers
        )
        assert_refused(answer, 401, "malformed_auth")

    run(scenario(test))


def test_request_for_an_unknown_job_is_refused_401() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1, job="9999")]), job="9999"
        )
        assert_refused(answer, 401, "unknown_job")

    run(scenario(test))


def test_wrongly_signed_request_is_refused_401() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1)])
        wrong_secret = await api.send(protocol.EVENTS_PATH, body, secret=OTHER_SECRET)
        altered_body = await api.send(protocol.EVENTS_PATH, body, signed_body=body + b" ")
        other_path = await api.send(protocol.EVENTS_PATH, body, signed_path=protocol.HEARTBEAT_PATH)
        for answer in (wrong_secret, altered_body, other_path):
            assert_refused(answer, 401, "bad_signature")
        assert api.directory.events(JOB) == []

    run(scenario(test))


@pytest.mark.parametrize("skew_s", [-301, 301, -(10**9)])
def test_request_outside_the_replay_window_is_refused_401(skew_s: int) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), timestamp=max(0, NOW + skew_s)
        )
        document = assert_refused(answer, 401, "stale_timestamp")
        assert "NTP" in document["reason"]

    run(scenario(test))


def test_request_at_the_edge_of_the_window_is_accepted() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), timestamp=NOW - 300
        )
        assert answer.status == 200

    run(scenario(test))


# -- 403 ---------------------------------------------------------------------


def test_events_about_another_job_are_refused_403() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1), event(1, job=OTHER_JOB, node="node7")])
        assert_refused(await api.send(protocol.EVENTS_PATH, body), 403, "cross_job")
        assert api.directory.events(JOB) == []
        assert api.directory.events(OTHER_JOB) == []

    run(scenario(test))


def test_heartbeat_about_another_job_is_refused_403() -> None:
    async def test(api: Api) -> None:
        body = heartbeat(job=OTHER_JOB, node="node7")
        assert_refused(await api.send(protocol.HEARTBEAT_PATH, body), 403, "cross_job")
        assert api.directory.heartbeats(OTHER_JOB) == {}

    run(scenario(test))


def test_job_status_of_another_job_is_refused_403() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(f"/v1/jobs/{OTHER_JOB}", method="GET")
        assert_refused(answer, 403, "cross_job")

    run(scenario(test))


def test_event_about_a_node_outside_the_allocation_is_refused_403() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(1), event(1, node="node7")])
        assert_refused(await api.send(protocol.EVENTS_PATH, body), 403, "foreign_node")
        assert api.directory.events(JOB) == []

    run(scenario(test))


def test_a_node_shrunk_out_of_the_job_is_refused_403() -> None:
    async def test(api: Api) -> None:
        assert (await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node2"))).status == 200
        api.directory.set_allocation(JOB, ["node1"])
        answer = await api.send(protocol.HEARTBEAT_PATH, heartbeat(node="node2"))
        assert_refused(answer, 403, "foreign_node")

    run(scenario(test))


# -- 400, 405, 413 -----------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "in_reason"),
    [
        (b"{not json", "not valid UTF-8 JSON"),
        (b"\xff\xfe", "not valid UTF-8 JSON"),
        (b'{"protocol": 1, "type": "events", "events": []}', "events.events has 0 items"),
        (b'{"protocol": 2, "type": "events", "events": []}', "protocol version 2"),
        (b'{"protocol": 1, "type": "heartbeat"}', "expected 'events'"),
    ],
)
def test_malformed_body_is_refused_400_with_protocols_reason(body: bytes, in_reason: str) -> None:
    async def test(api: Api) -> None:
        document = assert_refused(await api.send(protocol.EVENTS_PATH, body), 400, "malformed")
        assert in_reason in document["reason"]

    run(scenario(test))


def test_wrong_protocol_header_is_refused_400() -> None:
    async def test(api: Api) -> None:
        answer = await api.send(
            protocol.EVENTS_PATH,
            protocol.encode_events([event(1)]),
            headers={protocol.HEADER_PROTOCOL: "2"},
        )
        assert_refused(answer, 400, "unsupported_protocol")

    run(scenario(test))


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", protocol.EVENTS_PATH), ("PUT", protocol.HEARTBEAT_PATH), ("POST", "/healthz")],
)
def test_wrong_method_is_refused_405(method: str, path: str) -> None:
    async def test(api: Api) -> None:
        answer = await api.send(path, method=method)
        assert_refused(answer, 405, "method_not_allowed")
        assert answer.headers["Allow"]

    run(scenario(test))


def test_oversized_body_is_refused_413() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(seq) for seq in range(1, 40)])
        assert len(body) > 1024
        answer = await api.send(protocol.EVENTS_PATH, body)
        assert_refused(answer, 413, "too_large")

    run(scenario(test, max_body_bytes=1024))


def test_oversized_chunked_body_without_length_is_refused_413() -> None:
    async def test(api: Api) -> None:
        body = protocol.encode_events([event(seq) for seq in range(1, 40)])

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 100):
                yield body[start : start + 100]

        headers = protocol.signed_headers(SECRET, "POST", protocol.EVENTS_PATH, JOB, NOW, body)
        async with api.session.post(
            api.url + protocol.EVENTS_PATH, data=chunks(), headers=headers
        ) as response:
            assert response.status == 413
            assert (await response.json())["error"] == "too_large"

    run(scenario(test, max_body_bytes=1024))


# -- 500 ---------------------------------------------------------------------


class BrokenDirectory(MemoryDirectory):
    def accept_events(self, job_id: str, events: Sequence[Event]) -> Sequence[str]:
        raise RuntimeError(f"store exploded; secret {SECRET.hex()}")


def test_a_bug_behind_a_handler_is_a_logged_500_without_details(
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = BrokenDirectory()
    directory.add_job(JOB, SECRET, NODES)

    async def test(api: Api) -> None:
        answer = await api.send(protocol.EVENTS_PATH, protocol.encode_events([event(1)]))
        assert_refused(answer, 500, "internal")
        assert "exploded" not in answer.body.decode()
        health = await api.session.get(api.url + "/healthz")
        assert health.status == 200

    with caplog.at_level(logging.ERROR, logger="supervisor.api"):
        run(scenario(test, directory=directory))
    [record] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.exc_info is not None


# -- the intake gate ---------------------------------------------------------


class SlowDirectory(MemoryDirectory):
    """Takes each batch with a stop of the loop, as store writes do, and counts who is inside."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.most_inside = 0

    async def refuse_events(self, job_id: str, events: Sequence[Event]) -> str | None:
        self.inside += 1
        self.most_inside = max(self.most_inside, self.inside)
        await asyncio.sleep(0.001)  # the disk check, in a worker thread
        self.inside -= 1
        return None

    def accept_events(self, job_id: str, events: Sequence[Event]) -> Sequence[str]:
        time.sleep(0.005)
        return super().accept_events(job_id, events)


def test_a_probe_after_a_burst_of_reports_is_answered_before_the_burst_is_taken() -> None:
    directory = SlowDirectory()
    directory.add_job(JOB, SECRET, NODES)
    done: list[str] = []

    async def test(api: Api) -> None:
        async def report(seq: int) -> None:
            answer = await api.send(protocol.EVENTS_PATH, protocol.encode_events([event(seq)]))
            assert answer.status == 200, answer.body
            done.append(f"event {seq}")

        async def probe() -> None:
            async with api.session.get(api.url + "/healthz") as answer:
                assert answer.status == 200
            done.append("healthz")

        burst = [asyncio.create_task(report(seq)) for seq in range(1, 41)]
        await asyncio.sleep(0.05)  # every report's connection is open and sent
        await asyncio.gather(*burst, probe())

    run(scenario(test, directory=directory))
    assert len(done) == 41
    # Without the gate each batch is taken whole on arrival, and the probe comes last.
    assert done.index("healthz") < 20, done
    assert directory.most_inside == INTAKE_AT_ONCE


# -- logging -----------------------------------------------------------------


def test_refusals_are_logged_at_most_n_per_window_then_summarised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = RefusalLog(logging.getLogger("test.refusals"), lambda: now[0], per_window=3, window_s=60)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(1000):
            log.record(401, "bad_signature", "bad\nsignature", "4711\nforged line")
        log.record(403, "cross_job", "other job", "4711")
        now[0] = 61.0
        log.record(401, "bad_signature", "again", None)
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 3 + 1 + 1 + 1
    assert "refused 997 more requests with cause=bad_signature" in messages[4]
    assert all("\n" not in message for message in messages)
    assert log.totals == {"bad_signature": 1001, "cross_job": 1}


def test_refused_requests_are_logged_with_job_status_and_cause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def test(api: Api) -> None:
        await api.send(
            protocol.EVENTS_PATH, protocol.encode_events([event(1)]), secret=OTHER_SECRET
        )

    with caplog.at_level(logging.WARNING, logger="supervisor.api"):
        run(scenario(test))
    [message] = [r.getMessage() for r in caplog.records if r.name.startswith("supervisor.api")]
    assert "job='4711'" in message and "status=401" in message and "cause=bad_signature" in message


def test_an_upload_aborted_mid_body_is_freed_without_the_garbage_collector() -> None:
    """What a reset connection held (request, handler, chunks) goes with it, by reference
    counting: the daemon runs the cycle collector rarely, and a burst of aborted
    uploads once kept ~1-2 MiB each until it did (docs/security.md, 7)."""

    async def abort_mid_body(api: Api) -> None:
        host, port = api.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        head = [f"POST {protocol.EVENTS_PATH} HTTP/1.1", f"Host: {host}",
                f"Content-Length: {4 << 20}", f"{protocol.HEADER_JOB}: {JOB}",
                f"{protocol.HEADER_TIMESTAMP}: {NOW}", f"{protocol.HEADER_SIGNATURE}: {'0' * 64}",
                f"{protocol.HEADER_PROTOCOL}: 1"]  # fmt: skip
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + b"x" * (1 << 20))
        await writer.drain()
        await asyncio.sleep(0.2)  # the server reads what came
        # A reset, not a close: SO_LINGER with a zero timeout.
        writer.get_extra_info("socket").setsockopt(
            socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
        )
        writer.transport.abort()

    async def test(api: Api) -> None:
        for _ in range(3):
            await abort_mid_body(api)
        for _ in range(100):
            async with api.session.get(api.url + "/healthz") as response:
                if (await response.json())["refused"].get("client_gone", 0) >= 3:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the server never noticed the aborted uploads")
        await asyncio.sleep(0.2)  # and closed their connections
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            left = [o for o in gc.garbage if isinstance(o, (web.BaseRequest, RequestHandler))]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert left == [], left

    gc.collect()
    gc.disable()
    try:
        run(scenario(test))
    finally:
        gc.enable()


# -- lifecycle and the real agent --------------------------------------------


def test_shutdown_stops_listening() -> None:
    async def test() -> None:
        runner = await serve(build_app(make_directory()), "127.0.0.1", 0)
        url = f"http://127.0.0.1:{bound_port(runner)}/healthz"
        async with aiohttp.ClientSession() as session:
            assert (await session.get(url)).status == 200
            await shutdown(runner)
            with pytest.raises(aiohttp.ClientConnectionError):
                await session.get(url)

    run(test)


def test_reporter_delivers_events_once_in_order_and_gets_each_command_once(
    tmp_path: Path,
) -> None:
    received: list[Command] = []
    stop = Command(CommandKind.STOP_RANKS, "c-9", {"grace_s": 5.0})
    directory = make_directory()

    async def test(api: Api) -> None:
        reporter = Reporter(
            api.url,
            JOB,
            "node2",
            SECRET,
            tmp_path / "spool",
            on_command=received.append,
            clock=lambda: NOW,
            max_batch=7,
            backoff=tenacity.wait_fixed(0.05),
        )
        async with reporter:
            sent = [
                await reporter.emit(EventKind.CHECKPOINT_COMMITTED, {"step": step, "path": "/c"})
                for step in range(1, 31)
            ]
            assert await reporter.flush(10.0)
            directory.queue_command(JOB, "node2", stop)
            report = HeartbeatReport(JOB, "node2", NOW, (), reporter.incarnation)
            assert await reporter.heartbeat(report)
            assert await reporter.heartbeat(report)
            await reporter.emit(EventKind.AGENT_STOPPED, {"reason": "done"})
        recorded = directory.events(JOB)
        assert [e.event_id for e in recorded] == [e.event_id for e in sent] + [
            recorded[-1].event_id
        ]
        assert [e.payload.get("step") for e in recorded[:30]] == list(range(1, 31))
        assert received == [stop]
        assert reporter.pending == 0

    run(scenario(test, directory=directory))


def test_the_driver_asks_and_gets_the_directorys_answer() -> None:
    async def test(api: Api) -> None:
        relaunch = protocol.DriverAnswer(
            protocol.DriverAction.RELAUNCH, 2, ("node1",), "/ckpt/step-4", "4711/2/relaunch/1"
        )
        api.directory.answer_driver(JOB, relaunch)
        ended = protocol.DriverRequest(JOB, protocol.DriverPhase.ENDED, attempt=1, exit_code=1)
        answer = await api.send(protocol.DRIVER_PATH, protocol.encode_driver_request(ended))
        assert answer.status == 200, answer.body
        assert protocol.decode_driver_answer(answer.body) == relaunch
        assert api.directory.driver_requests(JOB) == [ended]

    run(scenario(test))


def test_a_driver_speaking_for_another_job_is_refused_403_and_garbage_400() -> None:
    async def test(api: Api) -> None:
        other = protocol.DriverRequest(OTHER_JOB, protocol.DriverPhase.START)
        body = protocol.encode_driver_request(other)
        assert_refused(await api.send(protocol.DRIVER_PATH, body), 403, "cross_job")
        garbage = b'{"protocol": 1, "type": "driver_request", "job_id": "4711"}'
        assert_refused(await api.send(protocol.DRIVER_PATH, garbage), 400, "malformed")
        assert api.directory.driver_requests(JOB) == []

    run(scenario(test))


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
