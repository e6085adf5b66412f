"""Save statistics from the manifests agents report, read only inside the job's checkpoint root.

A ``checkpoint_committed`` event names a directory; its manifest carries the
save's cost, which the checkpoint interval is computed from. The event is the
job's own word, and the supervisor reads files with privileges the job does
not have, so:

- a path that does not lie inside the job's registered checkpoint root is
  refused before anything is opened (:func:`inside_root`, pure);
- the manifest is opened by walking from the root one component at a time
  with ``O_NOFOLLOW``, so a symlink anywhere below the root (placed before the
  check or swapped in after it) is an error, never followed
  (:func:`open_inside`);
- reading and decoding run in a child process (``python -m
  supervisor.manifests ROOT PATH``, one at a time, killed after
  ``CHILD_TIMEOUT_S``), which answers with the statistics as one JSON line.
  Neither a worker thread nor a bounded prefix would do: msgspec decodes a
  64 MiB manifest holding the GIL for 70-250 ms (and zeroing its buffer
  holds it as long again), which stalled the event loop, every request with
  it, for up to 2 s under 100 concurrent commits; and the statistics are
  the *last* key of a manifest written with sorted keys, after its file
  list. In a child the loop never waits, and the 64 MiB buffer never enters
  the supervisor's heap. The file is bounded (the format's manifest limit)
  and decoded by msgspec into the statistics alone;
- each path is read once, whether it parsed or not, and each job gets a
  bounded number of reads per minute (:class:`ManifestReader`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import posixpath
import shutil
import stat
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Annotated

import msgspec

from agent.checkpoint import format as fmt
from agent.checkpoint.format import SaveStats
from agent.wire.errors import CheckpointInvalid
from supervisor.children import subprocess_runner

log = logging.getLogger(__name__)

# The format's own limit (agent/checkpoint/validate.py reads manifests with it).
MANIFEST_LIMIT_BYTES = 64 << 20
# Per job: at most this many manifest reads per window (the newest checkpoint's
# statistics are the ones that count; a job reporting faster gets the rest later).
READS_PER_WINDOW = 6
READ_WINDOW_S = 60.0
# Paths remembered per job (read, refused or skipped); the oldest are forgotten first.
_REMEMBERED_PATHS = 4096
# Reads waiting for the child, across jobs; more are dropped (and logged).
_MAX_QUEUED = 64
# A child still reading after this long is killed (a manifest on a hung filesystem).
CHILD_TIMEOUT_S = 30.0
# The most a child's answer may hold (a few hundred bytes of statistics or a reason).
_MAX_ANSWER_BYTES = 64 << 10

_Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]


class _Stats(msgspec.Struct):
    stall_s: _Seconds
    write_s: _Seconds
    total_bytes: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
    filesystem: Annotated[str, msgspec.Meta(max_length=256)]
    mode: Annotated[str, msgspec.Meta(max_length=64)]


class _StatsOnly(msgspec.Struct):
    """The two fields of a manifest the supervisor needs; msgspec skips the rest unbuilt."""

    format_version: int
    stats: _Stats | None = None


_DECODER = msgspec.json.Decoder(_StatsOnly)


class _Answer(msgspec.Struct, forbid_unknown_fields=True):
    """What the child writes: the statistics (None: the manifest has none), or why not."""

    stats: _Stats | None = None
    error: Annotated[str, msgspec.Meta(max_length=2000)] | None = None


_ANSWER_DECODER = msgspec.json.Decoder(_Answer)


class OutsideRoot(CheckpointInvalid):
    """A reported checkpoint path is not inside the job's checkpoint root."""


def inside_root(root: str, path: str) -> tuple[str, ...] | None:
    """The components of ``path`` below ``root``, or None when it is not strictly inside.

    Lexical only: both must be absolute, and ``path`` spelled without ``.``,
    ``..`` or empty components (an agent reports ``<root>/step-<N>`` as
    built from the same root). Symlinks are :func:`open_inside`'s business.
    """
    if not root.startswith("/") or not path.startswith("/") or "\0" in path:
        return None
    base = posixpath.normpath(root)
    parts = path.split("/")[1:]
    if any(part in ("", ".", "..") for part in parts):
        return None
    prefix = [] if base == "/" else base.split("/")[1:]
    if len(parts) <= len(prefix) or parts[: len(prefix)] != prefix:
        return None
    return tuple(parts[len(prefix) :])


def open_inside(root: str, parts: tuple[str, ...]) -> int:
    """A read-only descriptor of ``root/parts...``, never leaving ``root``.

    The root itself is the user's registered choice and may be a symlink;
    below it every component is opened relative to its parent with
    ``O_NOFOLLOW``, so a symlink is ``ELOOP`` instead of a way out. The last
    component is opened non-blocking (a FIFO is an error, not a hang).
    """
    flags = os.O_RDONLY | os.O_CLOEXEC
    fd = os.open(root, flags | os.O_DIRECTORY)
    try:
        for part in parts[:-1]:
            child = os.open(part, flags | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = child
        return os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=fd)
    finally:
        os.close(fd)


def refusal(root: str, path: str) -> str | None:
    """Why a reported checkpoint ``path`` is refused (outside ``root``, or reached through
    a symlink below it); None when it may be taken. Opens directories below the root only.

    A path that does not exist (yet) is not refused: there is nothing to read.
    """
    parts = inside_root(root, path)
    if parts is None:
        return f"{path[:300]!r} is not inside the job's checkpoint root {root!r}"
    try:
        os.close(open_inside(root, parts))
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            return (
                f"{path[:300]!r} passes through a symlink below the job's checkpoint root "
                f"{root!r}: checkpoints are read only inside the root"
            )
    return None


def read_save_stats(root: str, path: str) -> SaveStats | None:
    """The save statistics in ``path``'s manifest (None: the manifest has none).

    Raises :class:`OutsideRoot` for a path outside ``root`` (nothing opened),
    ``OSError`` for a symlink below the root, a missing or non-regular file,
    and :class:`CheckpointInvalid` for a manifest over the limit or not
    decodable.
    """
    parts = inside_root(root, path)
    if parts is None:
        raise OutsideRoot(f"{path!r} is not inside the job's checkpoint root {root!r}")
    fd = open_inside(root, (*parts, fmt.MANIFEST_NAME))
    try:
        size = os.fstat(fd).st_size
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", fmt.MANIFEST_NAME)
        if size > MANIFEST_LIMIT_BYTES:
            raise CheckpointInvalid(
                f"{fmt.MANIFEST_NAME} is {size} bytes, over the limit of {MANIFEST_LIMIT_BYTES}"
            )
        os.set_blocking(fd, True)
        buffer = bytearray(size)
        view = memoryview(buffer)
        filled = 0
        while filled < size and (count := os.readv(fd, [view[filled:]])):
            filled += count
        view.release()
    finally:
        os.close(fd)
    try:
        document = _DECODER.decode(memoryview(buffer)[:filled])
    except (msgspec.DecodeError, RecursionError) as error:
        raise CheckpointInvalid(f"{fmt.MANIFEST_NAME}: {error}") from error
    if document.format_version != fmt.FORMAT_VERSION:
        raise CheckpointInvalid(
            f"{fmt.MANIFEST_NAME} has format_version {document.format_version!r}; this "
            f"Resurgo reads {fmt.FORMAT_VERSION}"
        )
    found = document.stats
    if found is None:
        return None
    return SaveStats(found.stall_s, found.write_s, found.total_bytes, found.filesystem, found.mode)


# The reader runs below the daemon's priority (coreutils' nice, so that no code
# runs between fork and exec in a process with threads): on a busy head node its
# start-up and parsing must not take the CPU from the API's event loop.
_NICE: tuple[str, ...] = ("nice", "-n", "10") if shutil.which("nice") else ()


async def read_in_child(
    root: str, path: str, timeout_s: float = CHILD_TIMEOUT_S
) -> SaveStats | None:
    """:func:`read_save_stats` in a child process; the event loop only waits for its answer.

    Raises :class:`CheckpointInvalid` for anything that kept the statistics
    from being read (the child's reason, a timeout, a crash).
    """
    argv = [*_NICE, sys.executable, "-m", "supervisor.manifests", root, path]
    try:
        code, out, err = await subprocess_runner(argv, timeout_s)
    except TimeoutError:
        raise CheckpointInvalid(f"reading the manifest took over {timeout_s:g} s") from None
    if code != 0 or len(out) > _MAX_ANSWER_BYTES:
        tail = err[-500:].strip()
        raise CheckpointInvalid(f"the manifest reader exited {code}: {tail}")
    try:
        answer = _ANSWER_DECODER.decode(out)
    except msgspec.DecodeError as error:
        raise CheckpointInvalid(f"the manifest reader answered nonsense: {error}") from error
    if answer.error is not None:
        raise CheckpointInvalid(answer.error)
    found = answer.stats
    if found is None:
        return None
    return SaveStats(found.stall_s, found.write_s, found.total_bytes, found.filesystem, found.mode)


class ManifestReader:
    """Reads manifests in a child process, one at a time: once per path, a few per job per minute.

    ``on_stats(job_id, step, stats)`` runs on the event loop with each
    statistics found. Await :meth:`aclose` at shutdown.
    """

    def __init__(
        self,
        on_stats: Callable[[str, int, SaveStats], None],
        clock: Callable[[], float] = time.monotonic,
        per_window: int = READS_PER_WINDOW,
        window_s: float = READ_WINDOW_S,
    ) -> None:
        self._on_stats = on_stats
        self._clock = clock
        self._per_window = per_window
        self._window_s = window_s
        self._one_at_a_time = asyncio.Lock()
        self._seen: dict[str, deque[str]] = {}
        self._reads: dict[str, deque[float]] = {}
        self._queued = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.skipped = 0

    def request(self, job_id: str, root: str, step: int, path: str) -> bool:
        """Queue a read of ``path``'s manifest unless seen, rate-limited or over the queue.

        Returns whether a read was queued. Call on the event loop.
        """
        seen = self._seen.setdefault(job_id, deque(maxlen=_REMEMBERED_PATHS))
        if path in seen:
            return False
        seen.append(path)
        now = self._clock()
        reads = self._reads.setdefault(job_id, deque())
        while reads and now - reads[0] >= self._window_s:
            reads.popleft()
        if len(reads) >= self._per_window or self._queued >= _MAX_QUEUED:
            self.skipped += 1
            return False
        reads.append(now)
        self._queued += 1
        task = asyncio.get_running_loop().create_task(self._read(job_id, root, step, path))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def forget(self, job_id: str) -> None:
        """Drop what is remembered about a job that is gone."""
        self._seen.pop(job_id, None)
        self._reads.pop(job_id, None)

    async def _read(self, job_id: str, root: str, step: int, path: str) -> None:
        try:
            async with self._one_at_a_time:
                stats = await read_in_child(root, path)
        except (OSError, CheckpointInvalid) as error:
            log.warning("job %s: no save statistics from %r: %s", job_id, path[:300], error)
            return
        finally:
            self._queued -= 1
        if stats is not None:
            self._on_stats(job_id, step, stats)

    async def drain(self) -> None:
        """Wait for every queued read (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def aclose(self) -> None:
        """Abandon every queued read; a child still reading is killed."""
        for task in list(self._tasks):
            task.cancel()
        await self.drain()


def main(argv: Sequence[str]) -> int:
    """``python -m supervisor.manifests ROOT PATH``: one JSON line on stdout (:class:`_Answer`)."""
    root, path = argv
    try:
        stats = read_save_stats(root, path)
    except (OSError, CheckpointInvalid) as error:
        answer = _Answer(error=str(error)[:2000])
    else:
        answer = _Answer(
            stats=None
            if stats is None
            else _Stats(
                stats.stall_s, stats.write_s, stats.total_bytes, stats.filesystem, stats.mode
            )
        )
    sys.stdout.buffer.write(msgspec.json.encode(answer) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
