"""One way for an agent's heartbeats to go: a signed WebSocket to a base URL.

The supervisor and a job's aggregator (``agent/driver/aggregator.py``) serve
the same heartbeat stream (:data:`~agent.wire.protocol.HEARTBEAT_STREAM_PATH`):
a signed upgrade, then one signed frame per heartbeat, each answered by one
frame (a :class:`~agent.wire.protocol.Reply` or a
:class:`~agent.wire.protocol.Refusal`). Where the upgrade is refused as
unknown (an older supervisor, a proxy without WebSockets), heartbeats go as
signed POSTs to :data:`~agent.wire.protocol.HEARTBEAT_PATH`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from agent.wire import protocol
from agent.wire.auth import Rejected, signed_post
from agent.wire.protocol import Refusal, Reply

logger = logging.getLogger(__name__)

# Upgrade refusals that mean "no heartbeat stream here" (an older supervisor,
# a proxy without WebSockets): heartbeats go as POSTs instead.
_NO_STREAM_STATUSES = frozenset({400, 404, 405, 426, 501})
# How long closing a broken stream may wait for the other side's close frame.
_STREAM_CLOSE_S = 1.0


class HeartbeatLine:
    """Heartbeats to one base URL; ``name`` says whose it is in messages."""

    def __init__(
        self,
        base_url: str,
        name: str,
        job_id: str,
        secret: bytes,
        *,
        stream: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self._job_id = job_id
        self._secret = secret
        self._clock = clock
        self._use_stream = stream
        self._stream: aiohttp.ClientWebSocketResponse | None = None
        self.streams_opened = 0

    async def send(self, session: aiohttp.ClientSession, body: bytes, timeout_s: float) -> Reply:
        """One heartbeat over the stream (opened if need be), or POSTed where there is none.

        Raises :class:`~agent.wire.auth.Rejected` for a refusal (the stream
        stays open), and aiohttp's, OS and protocol errors when it was not
        delivered (the caller drops the stream).
        """
        stream = self._stream
        if stream is None or stream.closed:
            stream = await self._open(session) if self._use_stream else None
        if stream is None:
            data = await signed_post(
                session, self.base_url + protocol.HEARTBEAT_PATH, self._job_id, self._secret,
                body, timeout_s=timeout_s, clock=self._clock,
            )  # fmt: skip
            return protocol.decode_reply(data)
        await stream.send_bytes(
            protocol.sign_frame(self._secret, self._job_id, int(self._clock()), body)
        )
        message = await stream.receive()
        if message.type is aiohttp.WSMsgType.BINARY:
            data = message.data
        elif message.type is aiohttp.WSMsgType.TEXT:
            data = message.data.encode()
        else:
            raise ConnectionError(
                f"{self.name} closed the heartbeat stream ({stream.close_code}: "
                f"{protocol.clip_text(str(message.extra or ''), 200)})"
            )
        answer = protocol.decode_stream_answer(data)
        if isinstance(answer, Refusal):
            raise Rejected(answer.status, f"{answer.cause}: {answer.reason}")
        return answer

    async def _open(self, session: aiohttp.ClientSession) -> aiohttp.ClientWebSocketResponse | None:
        """Open the heartbeat stream with a signed upgrade; None if there is none."""
        path = protocol.HEARTBEAT_STREAM_PATH
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
                    "%s has no heartbeat stream (%d %s); heartbeats go as POSTs",
                    self.name,
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
