"""How the agent side proves itself to the supervisor: the per-job secret and requests it signs.

Each job has its own 256-bit secret, written 0600 into the job directory at
submit and read by the driver and every node's agent. :func:`signed_post` is
the one signed HTTP request: the Reporter's events and heartbeat fallback and
the driver's questions go through it. The header format and the HMAC itself
live in :mod:`agent.wire.protocol`.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from agent.wire import protocol
from agent.wire.diskio import fsync_dir, open_regular
from agent.wire.errors import ConfigError, ResurgoError

SECRET_BYTES = 32
# The hex form and a newline, with room for stray whitespace.
_SECRET_FILE_LIMIT = 4096


class Rejected(ResurgoError):
    """The supervisor answered with a status other than 200; ``reason`` is its body."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"supervisor answered {status}: {reason}")
        self.status = status
        self.reason = reason


async def signed_post(
    session: aiohttp.ClientSession,
    url: str,
    job_id: str,
    secret: bytes,
    body: bytes,
    *,
    timeout_s: float,
    clock: Callable[[], float] = time.time,
) -> bytes:
    """POST ``body`` signed for ``job_id``; the answer's body, or :class:`Rejected` (not 200)."""
    headers = protocol.signed_headers(
        secret, protocol.METHOD, urlsplit(url).path, job_id, int(clock()), body
    )
    headers["Content-Type"] = "application/json"
    async with session.post(
        url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as response:
        data = await response.read()
        if response.status != 200:
            reason = protocol.clip_text(data.decode("utf-8", "replace").strip(), 2000)
            raise Rejected(response.status, reason)
        return data


def new_secret() -> bytes:
    """A fresh 256-bit per-job signing secret."""
    return secrets.token_bytes(SECRET_BYTES)


def parse_secret(text: str) -> bytes:
    """The secret spelled as 64 hex digits (its form in files and the environment)."""
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError as error:
        raise ConfigError("the job secret must be 64 hex digits") from error
    if len(secret) != SECRET_BYTES:
        raise ConfigError(f"the job secret must be {SECRET_BYTES * 2} hex digits")
    return secret


def write_secret(path: Path, secret: bytes) -> None:
    """Store ``secret`` as hex in ``path`` with mode 0600 (durably, replacing any old file)."""
    if len(secret) != SECRET_BYTES:
        raise ConfigError(f"a job secret is {SECRET_BYTES} bytes, got {len(secret)}")
    temporary = path.with_name(f".{path.name}.tmp")
    # Created 0600 from the first byte, never briefly readable by others.
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secret.hex() + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    fsync_dir(path.parent)


def load_secret(path: Path) -> bytes:
    """Read a job secret written by :func:`write_secret`, refusing a file others can read.

    The file sits in a directory its user controls, and the supervisor reads
    it: anything but a small regular file of hex digits (a FIFO, a device, a
    huge or binary file) is a :class:`ConfigError`, never a blocked or
    crashed reader.
    """
    try:
        with open_regular(path) as handle:
            mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
            raw = handle.read(_SECRET_FILE_LIMIT + 1)
    except OSError as error:
        raise ConfigError(f"cannot read the job secret {path}: {error}") from error
    if len(raw) > _SECRET_FILE_LIMIT:
        raise ConfigError(f"job secret {path} is larger than {_SECRET_FILE_LIMIT} bytes")
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigError(f"job secret {path} is not hex text") from None
    if mode & 0o077:
        raise ConfigError(
            f"job secret {path} has mode {mode:04o}, readable by group or others: "
            f"run `chmod 600 {path}`"
        )
    try:
        return parse_secret(text)
    except ConfigError as error:
        raise ConfigError(f"job secret {path}: {error}") from error
