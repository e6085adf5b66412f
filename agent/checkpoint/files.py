"""Disk primitives shared by the checkpoint writer and validator.

Streaming checksums in bounded memory and durable small-file writes (temp file,
fsync, rename, fsync of the directory: :mod:`agent.wire.diskio`). Names and
checksum spelling come from :mod:`agent.checkpoint.format`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from agent.checkpoint import format as fmt
from agent.wire.diskio import fsync_dir, open_regular


def iter_chunks(path: Path, chunk_bytes: int = fmt.CHUNK_BYTES) -> Iterator[bytes]:
    """Yield the file's bytes in chunks of at most ``chunk_bytes``; memory stays bounded."""
    with open_regular(path) as handle:
        while chunk := handle.read(chunk_bytes):
            yield chunk


def checksum_file(path: Path) -> tuple[int, str]:
    """Return ``(byte count, checksum)`` of the file, reading it once, in chunks."""
    hasher = fmt.new_hasher()
    size = 0
    for chunk in iter_chunks(path):
        hasher.update(chunk)
        size += len(chunk)
    return size, fmt.format_checksum(hasher)


def describe_file(directory: Path, relative: str) -> fmt.FileEntry:
    """Manifest entry for ``directory / relative``."""
    size, checksum = checksum_file(directory / fmt.check_relative_path(relative))
    return fmt.FileEntry(path=relative, bytes=size, checksum=checksum)


def write_durably(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that after a crash it is either whole or absent.

    Writes a temporary sibling, fsyncs it, renames it over ``path`` and fsyncs
    the directory.
    """
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    fsync_dir(path.parent)


def read_small(path: Path, limit_bytes: int = 64 << 20) -> bytes:
    """Read a small regular file whole, refusing one larger than ``limit_bytes``
    (ValueError) and anything but a regular file (OSError)."""
    with open_regular(path) as handle:
        data = _read_up_to(handle, limit_bytes + 1)
    if len(data) > limit_bytes:
        raise ValueError(f"{path} is larger than {limit_bytes} bytes")
    return data


def _read_up_to(handle: BinaryIO, count: int) -> bytes:
    # In pieces: read(n) allocates n bytes up front, whatever the file holds,
    # so one read of a generous limit would cost the limit for a tiny file.
    parts, left = [], count
    while left > 0 and (part := handle.read(min(left, _READ_PIECE_BYTES))):
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


_READ_PIECE_BYTES = 1 << 20


def move_aside(path: Path, label: str, now_unix_s: float) -> Path:
    """Rename ``path`` to ``<name>.<label>-<unix>`` (``-1``, ``-2``... when taken); return it.

    The new name is not a ``step-<N>`` name, so nothing takes it for a
    checkpoint any more, and nothing is deleted.
    """
    target = path.with_name(f"{path.name}.{label}-{int(now_unix_s)}")
    suffix = 1
    while target.exists():
        target = path.with_name(f"{path.name}.{label}-{int(now_unix_s)}-{suffix}")
        suffix += 1
    path.rename(target)
    return target
