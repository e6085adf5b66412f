"""The supervisor's HTTP API with its real clients: lifecycle, the agent, the driver.

Shutdown stops listening, the agent's Reporter delivers events once and in order and
gets each command once, and the driver asks and is answered (or refused).

Each test starts the real server (``serve`` on a free loopback port) over a
:class:`MemoryDirectory` and talks HTTP to it with aiohttp's client; the clock
is fixed at ``NOW`` so the replay window is exact (``api_world``).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
import tenacity

from agent.node.client import Reporter
from agent.wire import protocol
from agent.wire.protocol import Command, CommandKind, EventKind, HeartbeatReport
from supervisor.api import bound_port, build_app, serve, shutdown
from tests.unit.api_world import (
    JOB,
    NOW,
    OTHER_JOB,
    SECRET,
    Api,
    assert_refused,
    make_directory,
    run,
    scenario,
)

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
