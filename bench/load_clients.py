"""The supervisor load benchmark's lean clients: one keep-alive connection each.

:class:`Connection` POSTs signed requests over HTTP/1.1 and :class:`StreamConnection`
speaks the heartbeat stream (a signed WebSocket upgrade, masked binary frames), both
on asyncio streams: far cheaper per request than aiohttp's client.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time

from agent.wire import protocol
from agent.wire.auth import Rejected


class _Socket:
    """A TCP connection to the supervisor, opened by its user and closed on any failure."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Connection(_Socket):
    """One keep-alive HTTP/1.1 connection to the supervisor, as an agent's session keeps.

    The generators' own client: it sends what aiohttp's client sends (request
    line, Host, Content-Type, Content-Length, the signing headers, the body)
    and reads the answer by its Content-Length, for a fraction of aiohttp's CPU
    per request, so that on a small machine the generators leave the CPUs to
    the supervisor they measure (``--client aiohttp`` uses aiohttp instead).
    A request on a reused connection that the server closed meanwhile (idle
    keep-alive timeout) is sent again once on a new one, as aiohttp does.
    """

    async def post(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        """Status and body of the answer to ``POST path``."""
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}",
                 *(f"{name}: {value}" for name, value in headers.items())]  # fmt: skip
        request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        reused = self.writer is not None
        try:
            return await self._exchange(request)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            stale = isinstance(error, ConnectionError) or not error.partial
            if not (reused and stale):
                raise
        return await self._exchange(request)

    async def _exchange(self, request: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        try:
            self.writer.write(request)
            head = await self.reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            fields = dict(line.split(":", 1) for line in header_lines if ":" in line)
            fields = {name.strip().lower(): value.strip() for name, value in fields.items()}
            body = await self.reader.readexactly(int(fields.get("content-length", "0")))
            if fields.get("connection", "").lower() == "close":
                self.close()
            return int(status_line.split()[1]), body
        except BaseException:
            self.close()
            raise


class StreamConnection(_Socket):
    """One agent's heartbeat stream: a WebSocket, as the agent's aiohttp session keeps one.

    The generators' own client, for the reason :class:`Connection` gives: it
    sends the signed upgrade request aiohttp sends, then masked binary frames
    (RFC 6455: a fresh random key per frame, as every client must), and reads
    the supervisor's unmasked answers by their length. ``--client aiohttp``
    uses aiohttp's WebSocket client instead.
    """

    def __init__(self, host: str, port: int, path: str = protocol.HEARTBEAT_STREAM_PATH) -> None:
        super().__init__(host, port)
        self.path = path
        self.opened = 0

    async def exchange(self, job_id: str, secret: bytes, frame: bytes) -> bytes:
        """Send one frame (opening the stream first if need be); the answer frame's payload."""
        if self.writer is None:
            await self._open(job_id, secret)
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(_masked_frame(frame))
            head = await self.reader.readexactly(2)
            if head[0] & 0x0F != 0x2:  # anything but a binary frame: a close, most likely
                raise ConnectionError(f"stream answered with opcode {head[0] & 0x0F}")
            length = head[1] & 0x7F
            if length == 126:
                length = int.from_bytes(await self.reader.readexactly(2))
            elif length == 127:
                length = int.from_bytes(await self.reader.readexactly(8))
            return await self.reader.readexactly(length)
        except BaseException:
            self.close()
            raise

    async def _open(self, job_id: str, secret: bytes) -> None:
        path = self.path
        headers = protocol.signed_headers(secret, "GET", path, job_id, int(time.time()), b"")
        key = base64.b64encode(secrets.token_bytes(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}",
                 "Sec-WebSocket-Version: 13",
                 *(f"{name}: {value}" for name, value in headers.items())]  # fmt: skip
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        try:
            self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            status = int(head.split(" ", 2)[1])
            if status != 101:
                raise Rejected(status, head.split("\r\n", 1)[0])
            self.opened += 1
        except BaseException:
            self.close()
            raise


def _masked_frame(payload: bytes) -> bytes:
    """A final binary client frame holding ``payload``, masked with a fresh random key."""
    size = len(payload)
    if size < 126:
        head = bytes((0x82, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((0x82, 0x80 | 126)) + size.to_bytes(2)
    else:
        head = bytes((0x82, 0x80 | 127)) + size.to_bytes(8)
    key = secrets.token_bytes(4)
    keystream = (key * (size // 4 + 1))[:size]
    masked = (int.from_bytes(payload) ^ int.from_bytes(keystream)).to_bytes(size)
    return head + key + masked
