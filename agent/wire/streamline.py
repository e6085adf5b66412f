"""A signed WebSocket to one base URL, one frame a report, each answered; POSTs where none.

Two kinds of report go this way, each with its stream and its POST path:

- an agent's heartbeats (:data:`~agent.wire.protocol.HEARTBEAT_STREAM_PATH`),
  to the supervisor or to its job's aggregator (``agent/driver/aggregator.py``),
  which serve the same stream: :data:`HEARTBEATS`;
- a job's heartbeats from its aggregator to the supervisor
  (:data:`~agent.wire.protocol.JOB_HEARTBEATS_STREAM_PATH`): :data:`JOB_HEARTBEATS`.

A stream is a signed upgrade, then one signed frame per report
(:func:`~agent.wire.protocol.sign_frame` over the stream's path), each
answered by one frame: the reply, or a :class:`~agent.wire.protocol.Refusal`.
A connection pays for a request's parsing, routing and answer once, not once
a report. Where the upgrade is refused as unknown (an older supervisor, a
proxy without WebSockets), reports go as signed POSTs instead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import aiohttp

from agent.wire import protocol
from agent.wire.auth import Rejected, signed_post
from agent.wire.protocol import AgentCommands, Refusal, Reply

_A = TypeVar("_A")


@dataclass(frozen=True)
class Route(Generic[_A]):
    """Where one kind of report goes, and how its answers read."""

    stream_path: str
    post_path: str
    answer: Callable[[bytes], _A | Refusal]


HEARTBEATS: Route[Reply] = Route(
    protocol.HEARTBEAT_STREAM_PATH, protocol.HEARTBEAT_PATH, protocol.decode_stream_answer
)
JOB_HEARTBEATS: Route[tuple[AgentCommands, ...]] = Route(
    protocol.JOB_HEARTBEATS_STREAM_PATH,
    protocol.JOB_HEARTBEATS_PATH,
    protocol.decode_job_stream_answer,
)

logger = logging.getLogger(__name__)

# Upgrade refusals that mean "no heartbeat stream here" (an older supervisor,
# a proxy without WebSockets): heartbeats go as POSTs instead.
_NO_STREAM_STATUSES = frozenset({400, 404, 405, 426, 501})
# How long closing a broken stream may wait for the other side's close frame.
_STREAM_CLOSE_S = 1.0


class StreamLine(Generic[_A]):
    """Reports of one ``route`` to one base URL; ``name`` says whose it is in messages."""

    def __init__(
        self,
        route: Route[_A],
        base_url: str,
        name: str,
        job_id: str,
        secret: bytes,
        *,
        stream: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.route = route
        self.base_url = base_url.rstrip("/")
        self.name = name
        self._job_id = job_id
        self._secret = secret
        self._clock = clock
        self._use_stream = stream
        self._stream: aiohttp.ClientWebSocketResponse | None = None
        self.streams_opened = 0

    async def send(self, session: aiohttp.ClientSession, body: bytes, timeout_s: float) -> _A:
        """One report over the stream (opened if need be), or POSTed where there is none.

        Raises :class:`~agent.wire.auth.Rejected` for a refusal (the stream
        stays open), and aiohttp's, OS and protocol errors when it was not
        delivered (the caller drops the stream).
        """
        stream = self._stream
        if stream is None or stream.closed:
            stream = await self._open(session) if self._use_stream else None
        if stream is None:
            data = await signed_post(
                session, self.base_url + self.route.post_path, self._job_id, self._secret,
                body, timeout_s=timeout_s, clock=self._clock,
            )  # fmt: skip
        else:
            data = await self._exchange(stream, body)
        answer = self.route.answer(data)
        if isinstance(answer, Refusal):
            raise Rejected(answer.status, f"{answer.cause}: {answer.reason}")
        return answer

    async def _exchange(self, stream: aiohttp.ClientWebSocketResponse, body: bytes) -> bytes:
        path = self.route.stream_path
        await stream.send_bytes(
            protocol.sign_frame(self._secret, self._job_id, int(self._clock()), body, path)
        )
        message = await stream.receive()
        if message.type is aiohttp.WSMsgType.BINARY:
            data: bytes = message.data
            return data
        if message.type is aiohttp.WSMsgType.TEXT:
            return str(message.data).encode()
        raise ConnectionError(
            f"{self.name} closed the stream ({stream.close_code}: "
            f"{protocol.clip_text(str(message.extra or ''), 200)})"
        )

    async def _open(self, session: aiohttp.ClientSession) -> aiohttp.ClientWebSocketResponse | None:
        """Open the stream with a signed upgrade; None if there is none."""
        path = self.route.stream_path
        headers = protocol.signed_headers(
            self._secret, "GET", path, self._job_id, int(self._clock()), b""
        )
        try:
            stream = await session.ws_connect(
                self.base_url + path,
                headers=headers,
                max_msg_size=protocol.MAX_BODY_BYTES,
                timeout=aiohttp.ClientWSTimeout(ws_close=_STREAM_CLOSE_S),
            )
        except aiohttp.WSServerHandshakeError as error:
            if error.status in _NO_STREAM_STATUSES:
                logger.info(
                    "%s has no stream at %s (%d %s); reports go as POSTs",
                    self.name,
                    path,
                    error.status,
                    error.message,
                )
                self._use_stream = False
                return None
            raise Rejected(error.status, error.message) from None
        self._stream = stream
        self.streams_opened += 1
        return stream

    async def drop(self) -> None:
        """Close the stream (the next heartbeat opens another)."""
        stream, self._stream = self._stream, None
        if stream is not None and not stream.closed:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ConnectionError):
                await stream.close()
