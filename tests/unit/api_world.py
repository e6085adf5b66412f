"""The supervisor's HTTP API under test: two jobs, their secrets, and a real server.

Shared by the ``test_api*.py`` files and the API fuzz tests: ``running`` serves
``build_app`` over a :class:`MemoryDirectory` on a free loopback port with the clock
fixed at ``NOW`` (so the replay window is exact), and :class:`Api` sends requests
signed like an agent's, with the given alterations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from agent.wire import protocol
from agent.wire.auth import new_secret
from agent.wire.protocol import Event, EventKind, HeartbeatReport, RankStatus
from supervisor.api import MemoryDirectory, bound_port, build_app, serve, shutdown

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
