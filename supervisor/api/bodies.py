"""Request bodies read within a time limit, into memory returned to the OS the moment they end.

:class:`BodyReader` is step 2 of the checks in :mod:`supervisor.api.app`: a
body is read in chunks into an anonymous memory map of its own, hashed as it
arrives, within a time limit (a body that never ends, or a
``Content-Length`` that lies, holds nothing longer), cut at the size limit,
and counted against a budget shared by every request not yet authenticated.
A client that goes away mid-body raises :class:`ClientGone`, which is no
error.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import mmap
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from supervisor.api.refusals import Cause


class ClientGone(Exception):
    """The client closed its connection before its body was read (never an error)."""


# After this many body bytes, once no body is held, freed heap is handed back.
TRIM_AFTER_BYTES = 64 << 20


def trim_heap() -> None:
    """Return the free pages of the C heap to the OS (glibc's ``malloc_trim``).

    The network hands a body over in pieces of up to 256 KiB, copied through
    asyncio's and aiohttp's buffers: a burst of uploads aborted mid-body
    leaves free holes in the heap that glibc keeps (with the fixed mmap
    threshold of the daemon, about 20 MiB after 300 aborted 8 MiB uploads
    without this trim, 1.5 MiB with it: bench/RESULTS.md, docs/security.md 7).
    Called when the last body being read is released after at least
    :data:`TRIM_AFTER_BYTES` were read: a few milliseconds, at most once per
    that many bytes. A no-op off glibc.
    """
    with contextlib.suppress(OSError, AttributeError):
        _LIBC.malloc_trim(0)


try:
    _LIBC: Any = ctypes.CDLL(None)
except OSError:  # not on glibc, or no C library to load: nothing to trim
    _LIBC = None


class BodyReader:
    """Reads request bodies within a time limit, into memory it returns to the OS at once.

    A body is read chunk by chunk into an anonymous ``mmap`` sized for the
    largest body allowed (or the announced length): pages are taken only as
    bytes arrive, and ``close`` unmaps them whatever the allocator would have
    kept of a ``bytes`` grown piecewise. While a body is being read it counts
    against ``budget_bytes``, shared by every request not yet authenticated.
    """

    def __init__(self, max_bytes: int, timeout_s: float, budget_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._timeout_s = timeout_s
        self._budget_bytes = budget_bytes
        self.held = 0  # bytes held by bodies being read or checked now
        self._read_since_trim = 0

    @contextlib.asynccontextmanager
    async def read(self, request: web.Request) -> AsyncIterator[tuple[memoryview, Any]]:
        """``(body, its hashlib.sha256)`` while the context lasts; refusals raise."""
        digest = hashlib.sha256()
        if not request.body_exists:
            yield memoryview(b""), digest
            return
        length = request.content_length
        if length is not None and length > self.max_bytes:
            raise Cause.TOO_LARGE.refuse(self._too_large(length))
        size = self.max_bytes if length is None else length
        area = mmap.mmap(-1, max(size, 1))
        held = 0
        try:
            filled = 0
            try:
                async with asyncio.timeout(self._timeout_s):
                    while chunk := await request.content.readany():
                        if filled + len(chunk) > size:
                            raise Cause.TOO_LARGE.refuse(self._too_large(length))
                        if self.held + len(chunk) > self._budget_bytes:
                            raise Cause.BUSY.refuse(
                                "the supervisor holds as many unauthenticated bodies as it "
                                "allows; retry in a few seconds"
                            )
                        self.held += len(chunk)
                        self._read_since_trim += len(chunk)
                        held += len(chunk)
                        area[filled : filled + len(chunk)] = chunk
                        digest.update(chunk)
                        filled += len(chunk)
            except TimeoutError:
                raise Cause.BODY_TIMEOUT.refuse(
                    f"the body did not arrive within {self._timeout_s:g} s"
                ) from None
            except (ConnectionError, BadHttpMessage) as error:
                # aiohttp keeps this exception in the request's StreamReader (and its
                # waiter future); its traceback holds the frames that refer to both, and
                # this one holds the request, its last chunks and its connection. That
                # cycle would wait for the garbage collector, which the daemon runs
                # rarely: a burst of aborted uploads kept ~1-2 MiB each
                # (docs/security.md, 7). Without the traceback, they go when the
                # request does.
                error.__traceback__ = None
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise ClientGone(f"connection lost after {filled} body bytes") from None
                raise Cause.BAD_HTTP.refuse(f"the body is not valid HTTP: {error}") from None
            if length is not None and filled != length:
                raise Cause.MALFORMED.refuse(
                    f"the body has {filled} bytes, Content-Length said {length}"
                )
            with memoryview(area) as view, view[:filled] as body:
                yield body, digest
        finally:
            self.held -= held
            area.close()
            if self.held == 0 and self._read_since_trim >= TRIM_AFTER_BYTES:
                self._read_since_trim = 0
                trim_heap()

    def _too_large(self, length: int | None) -> str:
        size = "the body" if length is None else f"the body ({length} bytes)"
        return f"{size} is over the limit of {self.max_bytes} bytes: send smaller batches"
