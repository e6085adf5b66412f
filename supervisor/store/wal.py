"""The store's write-ahead log, checked before SQLite reads it: damage there is silent.

SQLite's WAL recovery (the first connection after a crash) trusts the log up
to its first frame with a wrong checksum or salt and drops the rest without a
word; a log whose 32-byte header is damaged is dropped whole. For a store
whose recent writes are still in the log (all of them, before the first
checkpoint) that is silent data loss: the supervisor would forget jobs,
drains and half-done actions, or even see an empty file and create a new
store over it. :func:`check_wal` refuses such a log before any connection
opens, naming the file and what would be lost.

What is not damage: a torn tail (frames of a transaction that was never
committed when the process or the machine died), frames of an earlier log
generation after the current ones (a checkpoint restarts the log from its
start without truncating it), an empty or missing log. The format is
https://www.sqlite.org/fileformat2.html#walformat.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from supervisor.errors import StoreCorrupt

_MAGICS = (0x377F0682, 0x377F0683)  # the low bit: checksums over big-endian words
_VERSION = 3007000
_HEADER_BYTES = 32
_FRAME_HEADER_BYTES = 24
_MIN_PAGE = 512
_MAX_PAGE = 65536
_MASK = 0xFFFFFFFF


def wal_path(path: Path) -> Path:
    """The write-ahead log of the database at ``path``."""
    return path.with_name(f"{path.name}-wal")


@dataclass(frozen=True)
class WalDamage:
    """What is wrong with a log: ``problem`` in words, ``dropped`` committed transactions."""

    problem: str
    dropped: int | None  # None: unknown (the header is damaged, every frame is dropped)


def _checksum(data: bytes, big_endian: bool, s0: int, s1: int) -> tuple[int, int]:
    """SQLite's WAL checksum of ``data`` (a multiple of 8 bytes), continuing from (s0, s1)."""
    words = struct.unpack(f"{'>' if big_endian else '<'}{len(data) // 4}I", data)
    for index in range(0, len(words), 2):
        s0 = (s0 + words[index] + s1) & _MASK
        s1 = (s1 + words[index + 1] + s0) & _MASK
    return s0, s1


@dataclass(frozen=True)
class _Header:
    big_endian: bool
    page_size: int
    salts: bytes
    checksum: tuple[int, int]


def _header(raw: bytes) -> _Header | str:
    """The parsed header, or what is wrong with it."""
    magic, version, page_size = struct.unpack(">III", raw[:12])
    if magic not in _MAGICS:
        return f"its header starts with {raw[:4].hex()}, not the WAL magic number"
    if version != _VERSION:
        return f"its header names format version {version}, not {_VERSION}"
    if not _MIN_PAGE <= page_size <= _MAX_PAGE or page_size & (page_size - 1):
        return f"its header names page size {page_size}"
    big_endian = bool(magic & 1)
    stored = struct.unpack(">II", raw[24:32])
    if _checksum(raw[:24], big_endian, 0, 0) != stored:
        return "its header checksum does not match"
    return _Header(big_endian, page_size, raw[16:24], stored)


def _frames(file: BinaryIO, page_size: int) -> Iterator[tuple[bytes, bytes]]:
    """Every whole frame after the header, read one at a time: (frame header, page)."""
    file.seek(_HEADER_BYTES)
    while True:
        frame_header = file.read(_FRAME_HEADER_BYTES)
        page = file.read(page_size)
        if len(frame_header) < _FRAME_HEADER_BYTES or len(page) < page_size:
            return
        yield frame_header, page


def _frame_ok(frame: tuple[bytes, bytes], header: _Header, seed: tuple[int, int]) -> bool:
    frame_header, page = frame
    page_number = struct.unpack(">I", frame_header[:4])[0]
    if page_number == 0 or frame_header[8:16] != header.salts:
        return False
    expected = _checksum(frame_header[:8] + page, header.big_endian, *seed)
    return expected == _stored_checksum(frame_header)


def _stored_checksum(frame_header: bytes) -> tuple[int, int]:
    first, second = struct.unpack(">II", frame_header[16:24])
    return first, second


def _is_commit(frame_header: bytes) -> bool:
    # A commit frame records the database size in pages after the commit.
    return struct.unpack(">I", frame_header[4:8])[0] != 0


def inspect_wal(wal: Path) -> WalDamage | None:
    """What SQLite's recovery would silently drop from ``wal``; None when it drops nothing
    that was committed (or there is no log)."""
    try:
        file = wal.open("rb")
    except FileNotFoundError:
        return None
    with file:
        raw = file.read(_HEADER_BYTES)
        # Shorter than one frame of the smallest page: no commit can be in it.
        if len(raw) < _HEADER_BYTES or os.fstat(file.fileno()).st_size < (
            _HEADER_BYTES + _FRAME_HEADER_BYTES + _MIN_PAGE
        ):
            return None
        header = _header(raw)
        if isinstance(header, str):
            return WalDamage(header, None)
        seed: tuple[int, int] | None = header.checksum
        previous = b""
        damaged_at = count = dropped = 0
        for count, frame in enumerate(_frames(file, header.page_size), start=1):
            if seed is not None:
                # Still in the part SQLite trusts: follow the checksum chain.
                if _frame_ok(frame, header, seed):
                    seed = _stored_checksum(frame[0])
                else:
                    seed, damaged_at = None, count
            elif (
                previous[8:16] == header.salts
                and _is_commit(frame[0])
                and _frame_ok(frame, header, _stored_checksum(previous))
            ):
                # Past the frame where SQLite stops. A commit frame of this log
                # generation (same salts) that checks out against its
                # predecessor was written, committed and is intact: only
                # damage in between hides it.
                dropped += 1
            previous = frame[0]
    if not dropped:
        return None  # a torn, uncommitted tail is what a crash leaves; SQLite discards it
    return WalDamage(
        f"frame {damaged_at} of {count} is damaged and {dropped} committed transactions follow it",
        dropped,
    )


def check_wal(path: Path, restore_hint: str) -> None:
    """Raise :class:`StoreCorrupt` when the log of the store at ``path`` is damaged.

    A log that changes while it is read belongs to a supervisor that has the
    store open (its connection owns the recovery; ours will not run one), so
    it is not judged. Its size and header do not tell: a supervisor appending
    to a log that an earlier generation made longer changes neither, and a
    frame read half-written, with whole frames after it by the time they are
    read, looks exactly like damage. So damage found is looked for again, and
    counts only when it is still there and the whole log read the same before
    and after that second look.
    """
    wal = wal_path(path)
    if inspect_wal(wal) is None:
        return
    before = _digest(wal)
    damage = inspect_wal(wal)
    if damage is None or before is None or _digest(wal) != before:
        return
    lost = (
        "every transaction in it"
        if damage.dropped is None
        else f"the {damage.dropped} committed transactions after the damage"
    )
    raise StoreCorrupt(
        f"store {path}: its write-ahead log {wal} is damaged ({damage.problem}); opening "
        f"the store would silently drop {lost}; {restore_hint}"
    )


def _digest(wal: Path) -> bytes | None:
    """A hash of the whole log's bytes (None: there is none)."""
    hasher = hashlib.blake2b(digest_size=16)
    try:
        with wal.open("rb") as file:
            while chunk := file.read(1 << 20):
                hasher.update(chunk)
    except FileNotFoundError:
        return None
    return hasher.digest()
