"""Whether a job's checkpoint root can take a checkpoint again, after a storage failure.

The supervisor's user may not write the job's checkpoint root (it belongs to
the job's user), so the look writes nothing: the root must list (a stale NFS
handle or an I/O error fails that), its file system must not be read-only,
and its free space must hold the newest checkpoint again with a margin, and
at least the policy's ``storage_min_free_gb`` (what the agents' health gate
wants before a relaunch starts a rank). A file system that does not answer within
:data:`LOOK_S` (a hung mount) is not usable. Never raises.

Each look also names the root's file system (its mount point, read from the
mount table, so a stale or hung mount still has a name): jobs whose roots share
one are one storage incident (:mod:`supervisor.core.failures`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from supervisor.views.words import size

# The least free space a usable root has, whatever the newest checkpoint's size, unless
# the caller asks for more (the agents' health gate wants 1 GB by default).
MIN_FREE_BYTES = 16 << 20
# The newest checkpoint's size is needed again, with this margin.
MARGIN = 1.2
# The longest one look may take: a hung mount never answers at all.
LOOK_S = 10.0
# At most this many files are summed for the newest checkpoint's size.
MAX_FILES = 100_000


@dataclass(frozen=True)
class Look:
    """What one look saw: usable or not, and why, in words for the verdict."""

    usable: bool
    detail: str
    filesystem: str = ""


def look_now(root: Path, min_free_bytes: int = MIN_FREE_BYTES) -> Look:
    """Look at ``root`` (blocking; see :func:`look`)."""
    try:
        names = os.listdir(root)
        stat = os.statvfs(root)
    except OSError as error:
        return Look(False, f"{root}: {error.strerror or error}")
    if stat.f_flag & os.ST_RDONLY:
        return Look(False, f"{root} is on a read-only file system")
    free = stat.f_bavail * stat.f_frsize
    need = max(min_free_bytes, int(MARGIN * _newest_size(root, names)))
    if free < need:
        return Look(
            False, f"{root} has {size(free)} free, the newest checkpoint needs {size(need)}"
        )
    return Look(True, f"{root} has {size(free)} free")


def mount_point(path: Path) -> str:
    """The mount point of the file system ``path`` lies on, from the mount table: no call
    reaches that file system, so a hung or stale mount answers too ("" if unknown)."""
    target = os.path.abspath(path)
    try:
        points = [part.mountpoint for part in psutil.disk_partitions(all=True)]
    except OSError:
        return ""
    under = [p for p in points if target == p or target.startswith(p.rstrip("/") + "/")]
    return max(under, key=len, default="")


async def look(root: Path | None, min_free_bytes: int = MIN_FREE_BYTES) -> Look:
    """Look at ``root`` in a thread of its own, for at most :data:`LOOK_S`; the look
    names the root's file system (:func:`mount_point`)."""
    if root is None:
        return Look(False, "no checkpoint directory is known")
    seen = await _look(root, min_free_bytes)
    return replace(seen, filesystem=mount_point(root))


async def _look(root: Path, min_free_bytes: int) -> Look:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[Look] = loop.create_future()

    def settle(seen: Look) -> None:
        if not done.done():
            done.set_result(seen)

    def run() -> None:
        seen = look_now(root, min_free_bytes)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits
            loop.call_soon_threadsafe(settle, seen)

    # A daemon thread, not the loop's executor: a call stuck in a hung mount cannot be
    # cancelled, and the executor's threads are joined at exit.
    threading.Thread(target=run, name="resurgo-storage-look", daemon=True).start()
    try:
        return await asyncio.wait_for(done, LOOK_S)
    except TimeoutError:
        return Look(False, f"{root} did not answer within {LOOK_S:g} s (a hung mount?)")


def _newest_size(root: Path, names: list[str]) -> int:
    """The bytes of the newest entry under ``root`` (by modification time), files summed."""
    newest: tuple[float, Path] | None = None
    for name in names:
        if name.startswith("."):
            continue
        with contextlib.suppress(OSError):
            mtime = (root / name).stat().st_mtime
            if newest is None or mtime > newest[0]:
                newest = (mtime, root / name)
    if newest is None:
        return 0
    if newest[1].is_file():
        return newest[1].stat().st_size
    total, counted = 0, 0
    for folder, _dirs, files in os.walk(newest[1]):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name)).st_size
            counted += 1
            if counted >= MAX_FILES:
                return total
    return total
