"""The supervisor's HTTP API when things go wrong or pile up.

A bug behind a handler is a logged 500 without details, the intake gate answers a
probe before a burst of reports, refusals are logged at a bounded rate, and an upload
aborted mid-body is freed at once.

Each test starts the real server (``serve`` on a free loopback port) over a
:class:`MemoryDirectory` and talks HTTP to it with aiohttp's client; the clock
is fixed at ``NOW`` so the replay window is exact (``api_world``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import time
from collections.abc import Sequence

import pytest
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from agent.wire import protocol
from agent.wire.protocol import Event
from supervisor.api import MemoryDirectory, RefusalLog
from supervisor.api.app import INTAKE_AT_ONCE
from tests.unit.api_world import (
    JOB,
    NODES,
    NOW,
    OTHER_SECRET,
    SECRET,
    Api,
    assert_refused,
    event,
    run,
    scenario,
)

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


def test_an_unknown_job_is_logged_at_info_a_forged_signature_at_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A job submitted a moment ago asks before the next poll registers it: no warning."""
    log = RefusalLog(logging.getLogger("test.refusals"), lambda: 0.0)
    with caplog.at_level(logging.INFO, logger="test.refusals"):
        log.record(401, "unknown_job", "job '4711' is not known to this supervisor", "4711")
        log.record(401, "bad_signature", "bad signature", "4711")
    assert [(r.levelno, "cause=" + r.args[2]) for r in caplog.records] == [  # type: ignore[index, operator]
        (logging.INFO, "cause=unknown_job"), (logging.WARNING, "cause=bad_signature"),
    ]  # fmt: skip


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
