"""A recording stand-in for the supervisor's agent API, for tests (docs/protocol.md).

It speaks protocol v1 like the real supervisor will: verifies signatures
(401), decodes strictly (400 with the reason), refuses a job's credentials
reporting for another job (403), records events in arrival order once per
``event_id`` while acknowledging duplicates again, records heartbeats, and
returns queued commands on the next reply. It can be stopped and started on
the same port to simulate an outage, and told to fail on purpose.

It runs on its own event loop in a daemon thread, so synchronous tests, async
tests (any loop) and agent processes started by a test can all reach it::

    with RecordingServer({"1234": secret}) as server:
        ...  # point the agent at server.url
        server.wait_for_events(3, timeout_s=10)
        assert [e.payload for e in server.events] == [...]

``python -m tests.recording_server --job 1234 --secret-file s`` serves until
interrupted and prints each recorded event as a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

from aiohttp import web

from agent.wire import protocol
from agent.wire.protocol import AuthError, Command, Event, HeartbeatReport, ProtocolError, Reply

_CALL_TIMEOUT_S = 10.0


class RecordingServer:
    """Records what agents send, on ``http://127.0.0.1:<port>`` (the port fixed at first start).

    ``secrets`` maps job id to that job's secret. ``clock`` is the verifier's
    clock for the replay window (inject one to test clock skew).
    """

    def __init__(
        self,
        secrets: Mapping[str, bytes],
        *,
        port: int = 0,
        clock: Callable[[], float] = time.time,
        window_s: int = protocol.REPLAY_WINDOW_S,
        start: bool = True,
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port
        self._secrets = dict(secrets)
        self._clock = clock
        self._window_s = window_s
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._event_ids: set[str] = set()
        self._heartbeats: list[HeartbeatReport] = []
        self._rejections: list[tuple[int, str]] = []
        self._commands: list[Command] = []
        self._duplicates = 0
        self._fail_status: int | None = None
        self._fail_reason = ""
        self._lost_replies = 0
        self._runner: web.AppRunner | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="recording-server", daemon=True
        )
        self._thread.start()
        if start:
            self.start()

    # -- control, callable from any thread ---------------------------------

    @property
    def url(self) -> str:
        """Base URL for the agent's Reporter."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """Whether the server is listening."""
        return self._runner is not None

    def start(self) -> None:
        """Listen (again) on the same port; recorded data is kept across restarts."""
        self._call(self._start())

    def stop(self) -> None:
        """Stop listening: agents now get connection refused, as in an outage."""
        self._call(self._stop())

    def close(self) -> None:
        """Stop listening and end the server's thread."""
        if self._loop.is_closed():
            return
        self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_CALL_TIMEOUT_S)
        self._loop.close()

    def __enter__(self) -> RecordingServer:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def queue_command(self, command: Command) -> None:
        """Return ``command`` on the next reply (to events or a heartbeat)."""
        with self._lock:
            self._commands.append(command)

    def fail_with(self, status: int | None, reason: str = "injected failure") -> None:
        """Answer every authenticated request with ``status`` (None: behave normally again)."""
        with self._lock:
            self._fail_status = status
            self._fail_reason = reason

    def lose_replies(self, count: int) -> None:
        """Record the next ``count`` event batches but answer 503, as if the reply were lost."""
        with self._lock:
            self._lost_replies = count

    @property
    def events(self) -> list[Event]:
        """Every distinct event, in the order it first arrived."""
        with self._lock:
            return list(self._events)

    @property
    def heartbeats(self) -> list[HeartbeatReport]:
        """Every heartbeat received, in arrival order."""
        with self._lock:
            return list(self._heartbeats)

    @property
    def rejections(self) -> list[tuple[int, str]]:
        """``(status, reason)`` of every refused request, in order."""
        with self._lock:
            return list(self._rejections)

    @property
    def duplicates(self) -> int:
        """How many events arrived again after they were recorded (acknowledged, not recorded)."""
        with self._lock:
            return self._duplicates

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float) -> None:
        """Poll ``predicate`` until true; AssertionError naming ``what`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.02)

    def wait_for_events(self, count: int, timeout_s: float) -> list[Event]:
        """Wait until at least ``count`` distinct events were recorded; return them."""
        self.wait_for(f"{count} events", lambda: len(self.events) >= count, timeout_s)
        return self.events

    # -- inside the server's loop -------------------------------------------

    def _call(self, coroutine: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(_CALL_TIMEOUT_S)

    async def _start(self) -> None:
        if self._runner is not None:
            return
        app = web.Application(client_max_size=protocol.MAX_BODY_BYTES)
        app.router.add_post(protocol.EVENTS_PATH, self._handle_events)
        app.router.add_post(protocol.HEARTBEAT_PATH, self._handle_heartbeat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self.port = runner.addresses[0][1]
        self._runner = runner

    async def _stop(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _authenticate(self, request: web.Request, body: bytes) -> str:
        """The request's job id, or raise :class:`_Refused` with the status and reason."""
        job_id = request.headers.get(protocol.HEADER_JOB)
        timestamp = request.headers.get(protocol.HEADER_TIMESTAMP)
        signature = request.headers.get(protocol.HEADER_SIGNATURE)
        if job_id is None or timestamp is None or signature is None:
            raise _Refused(401, "missing signing headers")
        secret = self._secrets.get(job_id)
        if secret is None:
            raise _Refused(401, f"unknown job {job_id[:64]!r}")
        try:
            timestamp_s = int(timestamp)
        except ValueError:
            raise _Refused(401, "timestamp is not an integer") from None
        try:
            protocol.verify(
                secret,
                request.method,
                request.path,
                job_id,
                timestamp_s,
                body,
                signature,
                now_s=int(self._clock()),
                window_s=self._window_s,
            )
        except AuthError as error:
            raise _Refused(401, str(error)) from None
        if request.headers.get(protocol.HEADER_PROTOCOL) != str(protocol.PROTOCOL_VERSION):
            raise _Refused(400, f"{protocol.HEADER_PROTOCOL} must be {protocol.PROTOCOL_VERSION}")
        with self._lock:
            if self._fail_status is not None:
                raise _Refused(self._fail_status, self._fail_reason)
        return job_id

    async def _handle_events(self, request: web.Request) -> web.Response:
        return await self._answer(self._record_events, request)

    async def _handle_heartbeat(self, request: web.Request) -> web.Response:
        return await self._answer(self._record_heartbeat, request)

    async def _answer(
        self, handler: Callable[[str, bytes], tuple[str, ...]], request: web.Request
    ) -> web.Response:
        try:
            body = await request.read()
            accepted = handler(await self._authenticate(request, body), body)
        except _Refused as refusal:
            with self._lock:
                self._rejections.append((refusal.status, refusal.reason))
            return web.Response(status=refusal.status, text=refusal.reason)
        with self._lock:
            commands, self._commands = tuple(self._commands), []
        reply = protocol.encode_reply(Reply(commands=commands, accepted_event_ids=accepted))
        return web.Response(body=reply, content_type="application/json")

    def _record_events(self, job_id: str, body: bytes) -> tuple[str, ...]:
        try:
            events = protocol.decode_events(body)
        except ProtocolError as error:
            raise _Refused(400, str(error)) from None
        for event in events:
            if event.job_id != job_id:
                raise _Refused(403, f"event {event.event_id} is not about job {job_id}")
        with self._lock:
            for event in events:
                if event.event_id in self._event_ids:
                    self._duplicates += 1
                    continue
                self._event_ids.add(event.event_id)
                self._events.append(event)
            if self._lost_replies > 0:
                self._lost_replies -= 1
                raise _Refused(503, "reply lost on purpose")
        return tuple(event.event_id for event in events)

    def _record_heartbeat(self, job_id: str, body: bytes) -> tuple[str, ...]:
        try:
            report = protocol.decode_heartbeat(body)
        except ProtocolError as error:
            raise _Refused(400, str(error)) from None
        if report.job_id != job_id:
            raise _Refused(403, f"heartbeat is not about job {job_id}")
        with self._lock:
            self._heartbeats.append(report)
        return ()


class _Refused(Exception):
    """A request answered with ``status`` and a plain-text ``reason`` instead of a reply."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def main(argv: list[str] | None = None) -> None:
    """Serve on 127.0.0.1 until interrupted; print each new event as a JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--job", required=True, help="job id to accept")
    parser.add_argument("--secret-file", required=True, type=Path, help="0600 hex secret file")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    from agent.wire.auth import load_secret

    with RecordingServer({args.job: load_secret(args.secret_file)}, port=args.port) as server:
        print(f"listening on {server.url}", flush=True)
        printed = 0
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                events = server.events
                for event in events[printed:]:
                    sys.stdout.write(protocol.encode_event(event).decode() + "\n")
                sys.stdout.flush()
                printed = len(events)
                time.sleep(0.2)


if __name__ == "__main__":
    main()
