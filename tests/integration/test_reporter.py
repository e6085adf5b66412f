"""The Reporter against the recording server on 127.0.0.1: order, exactly once, outages.

Every scenario runs real HTTP on loopback with a real on-disk spool. Backoff
is shortened (tens of milliseconds to half a second) so that outages of a few
seconds fit in a unit-test budget; one ``slow`` test keeps the issue's 30 s
outage with the production backoff.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import tenacity

from agent.node import client, spool
from agent.node.client import Reporter
from agent.node.spool import SpoolLocked
from agent.wire import protocol
from agent.wire.auth import load_secret, new_secret, write_secret
from agent.wire.errors import ConfigError
from agent.wire.protocol import (
    Command,
    CommandKind,
    Event,
    EventKind,
    HeartbeatReport,
    ProtocolError,
    RankStatus,
)
from tests.recording_server import RecordingServer

JOB = "4711"
NODE = "node2"
SECRET = new_secret()
FAST_BACKOFF = tenacity.wait_random_exponential(multiplier=0.02, max=0.5)


@pytest.fixture
def server() -> Iterator[RecordingServer]:
    with RecordingServer({JOB: SECRET}) as running:
        yield running


def make_reporter(server: RecordingServer, spool: Path, **overrides: Any) -> Reporter:
    settings: dict[str, Any] = {"backoff": FAST_BACKOFF, "timeout_s": 1.0, **overrides}
    secret = settings.pop("secret", SECRET)
    return Reporter(server.url, JOB, NODE, secret, spool, **settings)


def run(scenario: Callable[[], Awaitable[None]], timeout_s: float = 60.0) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(scenario(), timeout_s)

    asyncio.run(bounded())


async def emit_numbered(
    reporter: Reporter, first: int, count: int, gap_s: float = 0.0
) -> list[str]:
    ids = []
    for number in range(first, first + count):
        event = await reporter.emit(EventKind.CHECKPOINT_COMMITTED, {"step": number, "path": "/c"})
        ids.append(event.event_id)
        if gap_s:
            await asyncio.sleep(gap_s)
    return ids


def recorded_ids(server: RecordingServer) -> list[str]:
    return [event.event_id for event in server.events]


def steps(events: list[Event]) -> list[int]:
    return [event.payload["step"] for event in events]


def test_events_arrive_in_order_exactly_once(server: RecordingServer, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with make_reporter(server, tmp_path, max_batch=7) as reporter:
            ids = await emit_numbered(reporter, 0, 40)
            assert await reporter.flush(10)
            assert reporter.pending == 0
        assert recorded_ids(server) == ids
        assert steps(server.events) == list(range(40))
        assert server.duplicates == 0

    run(scenario)


@pytest.mark.parametrize(
    ("outage_s", "backoff"),
    [
        (5.0, FAST_BACKOFF),
        pytest.param(30.0, client.DEFAULT_BACKOFF, marks=pytest.mark.slow, id="30s-real-backoff"),
    ],
    ids=["5s", "30s-real-backoff"],
)
def test_events_during_a_supervisor_outage_arrive_after_it_in_order_exactly_once(
    server: RecordingServer, tmp_path: Path, outage_s: float, backoff: Any
) -> None:
    async def scenario() -> None:
        async with make_reporter(server, tmp_path, backoff=backoff, max_batch=5) as reporter:
            ids = await emit_numbered(reporter, 0, 3)
            assert await reporter.flush(10)
            await asyncio.to_thread(server.stop)
            started = time.monotonic()
            per_event_s = outage_s / 20
            ids += await emit_numbered(reporter, 3, 20, gap_s=per_event_s)
            assert reporter.pending == 20
            await asyncio.sleep(max(0.0, outage_s - (time.monotonic() - started)))
            await asyncio.to_thread(server.start)
            # The production backoff waits at most 10 s between attempts.
            assert await reporter.flush(25)
        assert recorded_ids(server) == ids
        assert steps(server.events) == list(range(23))

    run(scenario, timeout_s=outage_s + 60)


def test_a_restarted_agent_replays_old_events_first_with_their_ids(
    server: RecordingServer, tmp_path: Path
) -> None:
    async def scenario() -> None:
        server.stop()
        first = make_reporter(server, tmp_path)
        await first.start()
        old_ids = await emit_numbered(first, 0, 6)
        await first.close(drain_timeout_s=0.3)
        assert first.pending == 6

        second = make_reporter(server, tmp_path)
        assert second.pending == 6
        assert second.incarnation != first.incarnation
        await second.start()
        new_ids = await emit_numbered(second, 6, 4)
        await asyncio.sleep(0.3)
        server.start()
        assert await second.flush(10)
        await second.close()
        assert recorded_ids(server) == old_ids + new_ids
        assert {event.incarnation for event in server.events[:6]} == {first.incarnation}
        assert server.duplicates == 0

    run(scenario)


def test_a_lost_reply_is_resent_and_recorded_once(server: RecordingServer, tmp_path: Path) -> None:
    async def scenario() -> None:
        server.lose_replies(2)
        async with make_reporter(server, tmp_path) as reporter:
            ids = await emit_numbered(reporter, 0, 5)
            assert await reporter.flush(10)
        assert recorded_ids(server) == ids
        assert server.duplicates >= 5

    run(scenario)


def test_a_wrong_secret_is_refused_401_and_the_events_stay_spooled(
    server: RecordingServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        wrong = make_reporter(server, tmp_path, secret=new_secret())
        await wrong.start()
        ids = await emit_numbered(wrong, 0, 3)
        await asyncio.to_thread(
            server.wait_for,
            "two 401s",
            lambda: [status for status, _ in server.rejections].count(401) >= 2,
            10,
        )
        await wrong.close(drain_timeout_s=0.1)
        assert wrong.pending == 3
        assert server.events == []
        assert "refused the agent's credentials (401): bad signature" in caplog.text

        # The operator fixes the secret: the same spool delivers the same events.
        async with make_reporter(server, tmp_path) as fixed:
            assert await fixed.flush(10)
        assert recorded_ids(server) == ids

    run(scenario)


def test_a_400_is_logged_as_a_bug_and_retried_never_dropped(
    server: RecordingServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        server.fail_with(400, "events[0].payload: the supervisor dislikes it")
        async with make_reporter(server, tmp_path) as reporter:
            ids = await emit_numbered(reporter, 0, 2)
            await asyncio.to_thread(
                server.wait_for,
                "a 400",
                lambda: (400, "events[0].payload: the supervisor dislikes it") in server.rejections,
                10,
            )
            assert reporter.pending == 2
            server.fail_with(None)
            assert await reporter.flush(10)
        assert recorded_ids(server) == ids
        assert "rejected a batch of events (400): events[0].payload" in caplog.text
        assert "bug in Resurgo" in caplog.text

    run(scenario)


def test_commands_reach_on_command_once_each(server: RecordingServer, tmp_path: Path) -> None:
    stop = Command(CommandKind.STOP_RANKS, "cmd-1", {"grace_s": 30.0})
    interval = Command(
        CommandKind.SET_CHECKPOINT_INTERVAL, "cmd-2", {"interval_s": 600.0, "every_steps": None}
    )
    received: list[Command] = []

    async def scenario() -> None:
        async with make_reporter(server, tmp_path, on_command=received.append) as reporter:
            server.queue_command(stop)
            await emit_numbered(reporter, 0, 1)
            assert await reporter.flush(10)
            # The supervisor repeats a command until it knows it arrived.
            server.queue_command(stop)
            server.queue_command(interval)
            assert await reporter.heartbeat(heartbeat())
            server.queue_command(interval)
            await emit_numbered(reporter, 1, 1)
            assert await reporter.flush(10)

    run(scenario)
    assert received == [stop, interval]


def heartbeat() -> HeartbeatReport:
    return HeartbeatReport(
        job_id=JOB,
        node=NODE,
        time_unix_s=time.time(),
        ranks=(RankStatus(0, 0, os.getpid(), 10, "train", time.time(), 0.1, 0.2, 0.1, 10),),
        agent_incarnation="00aa00aa00aa00aa",
    )


def test_heartbeats_are_best_effort_and_never_spooled(
    server: RecordingServer, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with make_reporter(server, tmp_path, heartbeat_timeout_s=0.5) as reporter:
            assert await reporter.heartbeat(heartbeat())
            server.stop()
            assert not await reporter.heartbeat(heartbeat())
            assert reporter.heartbeat_failures == 1
            assert reporter.heartbeats_sent == 1
            assert reporter.pending == 0
        assert len(server.heartbeats) == 1

    run(scenario)


def test_emit_refuses_a_bad_payload_and_spools_nothing(
    server: RecordingServer, tmp_path: Path
) -> None:
    async def scenario() -> None:
        async with make_reporter(server, tmp_path) as reporter:
            with pytest.raises(ProtocolError, match="missing field 'path'"):
                await reporter.emit(EventKind.CHECKPOINT_COMMITTED, {"step": 1})
            event = await reporter.emit(EventKind.AGENT_STOPPED, {"reason": "done"})
            assert event.seq == 1
            assert await reporter.flush(10)

    run(scenario)


def test_a_second_reporter_on_the_same_spool_is_refused(
    server: RecordingServer, tmp_path: Path
) -> None:
    first = make_reporter(server, tmp_path)
    with pytest.raises(SpoolLocked, match="in use by another agent"):
        make_reporter(server, tmp_path)
    run(first.close)
    make_reporter(server, tmp_path)


def test_a_spool_of_another_job_is_refused(server: RecordingServer, tmp_path: Path) -> None:
    async def scenario() -> None:
        server.stop()
        reporter = make_reporter(server, tmp_path)
        await emit_numbered(reporter, 0, 1)
        await reporter.close(drain_timeout_s=0)

    run(scenario)
    with pytest.raises(ConfigError, match="holds undelivered events of job 4711"):
        Reporter(server.url, "9999", NODE, SECRET, tmp_path)


def test_a_torn_last_line_from_a_crash_is_ignored_on_restart(
    server: RecordingServer, tmp_path: Path
) -> None:
    ids: list[str] = []

    async def crash_mid_append() -> None:
        server.stop()
        reporter = make_reporter(server, tmp_path)
        ids.extend(await emit_numbered(reporter, 0, 2))
        await reporter.close(drain_timeout_s=0)

    run(crash_mid_append)
    (segment,) = tmp_path.glob("events-*.jsonl")
    with open(segment, "ab") as handle:
        handle.write(b'{"protocol":1,"type":"ev')

    async def restart() -> None:
        server.start()
        async with make_reporter(server, tmp_path) as reporter:
            assert await reporter.flush(10)

    run(restart)
    assert recorded_ids(server) == ids


def test_an_acknowledged_spool_is_rotated_and_stays_small(
    server: RecordingServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spool, "ROTATE_BYTES", 500)

    async def scenario() -> None:
        async with make_reporter(server, tmp_path) as reporter:
            for batch in range(5):
                await emit_numbered(reporter, batch * 10, 10)
                assert await reporter.flush(10)

    run(scenario)
    segments = list(tmp_path.glob("events-*.jsonl"))
    assert len(segments) == 1
    assert segments[0].stat().st_size <= 500
    assert steps(server.events) == list(range(50))


def test_unreachable_supervisor_is_logged_as_a_warning_with_the_spool_size(
    server: RecordingServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.node.client")

    async def scenario() -> None:
        server.stop()
        reporter = make_reporter(server, tmp_path)
        await reporter.start()
        await emit_numbered(reporter, 0, 2)
        await asyncio.sleep(0.5)
        await reporter.close(drain_timeout_s=0.1)

    run(scenario)
    assert "supervisor unreachable" in caplog.text
    assert "2 events spooled in" in caplog.text
    assert re.search(r"no answer for \d+ s \(retried without limit\)", caplog.text)


def test_load_secret_refuses_a_file_others_can_read(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    secret = new_secret()
    write_secret(path, secret)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_secret(path) == secret
    path.chmod(0o644)
    with pytest.raises(ConfigError, match=rf"mode 0644.*run `chmod 600 {path}`"):
        load_secret(path)


def test_load_secret_refuses_a_malformed_or_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "job.secret"
    with pytest.raises(ConfigError, match="cannot read the job secret"):
        load_secret(path)
    path.write_text("not hex\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError, match="64 hex digits"):
        load_secret(path)
    assert len(new_secret()) == 32
    assert new_secret() != new_secret()


def test_recording_server_refuses_unsigned_malformed_and_cross_job_requests(
    server: RecordingServer,
) -> None:
    other_job_event = protocol.make_event(
        EventKind.AGENT_STOPPED, "9999", NODE, "00aa00aa", 1, time.time(), {"reason": "x"}
    )

    async def post(body: bytes, signed: bool = True) -> tuple[int, str]:
        url = server.url + protocol.EVENTS_PATH
        headers = (
            protocol.signed_headers(
                SECRET, "POST", protocol.EVENTS_PATH, JOB, int(time.time()), body
            )
            if signed
            else {}
        )
        async with (
            aiohttp.ClientSession() as session,
            session.post(url, data=body, headers=headers) as response,
        ):
            return response.status, await response.text()

    async def scenario() -> None:
        assert await post(b"{}", signed=False) == (401, "missing signing headers")
        status, reason = await post(b"{}")
        assert (status, reason) == (400, "events: missing field 'protocol'")
        status, reason = await post(protocol.encode_events([other_job_event]))
        assert status == 403 and "not about job 4711" in reason
        status, _ = await post(b" " * (protocol.MAX_BODY_BYTES + 1))
        assert status == 413

    run(scenario)
    assert server.events == []
