"""The Reporter's on-disk spool: every event, fsynced, until the supervisor accepted it.

:class:`Spool` keeps JSON-lines segments and a durable cursor, "acknowledged
up to here", in one directory per job and node. A Reporter started on the
same directory after a crash loads the earlier incarnation's unacknowledged
events first, with their original ids; an flock keeps a second writer out.
"""

from __future__ import annotations

import collections
import fcntl
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from agent.checkpoint.files import write_durably
from agent.wire import protocol
from agent.wire.diskio import fsync_dir
from agent.wire.errors import ConfigError, ResurgoError
from agent.wire.protocol import Event

logger = logging.getLogger(__name__)

# A fully acknowledged spool segment larger than this is replaced by a fresh
# one, so that a long job's spool does not grow without bound.
ROTATE_BYTES = 1 << 20
_SEGMENT_PREFIX = "events-"
_SEGMENT_SUFFIX = ".jsonl"
_CURSOR_NAME = "cursor.json"
_LOCK_NAME = "lock"


class SpoolLocked(ResurgoError):
    """Another live Reporter holds the spool directory; two writers would interleave events."""


@dataclass(frozen=True)
class _Spooled:
    """An event waiting in the spool; ``position`` is the cursor once it is acknowledged."""

    event: Event
    encoded_bytes: int
    position: tuple[int, int]  # (segment number, byte offset just past its line)


class Spool:
    """Append-only JSON-lines segments plus a durable "acknowledged up to" cursor.

    Layout of the directory: ``events-<n>.jsonl`` segments (each Reporter start
    appends to a new one), ``cursor.json`` = ``{"segment": n, "offset": b}``
    meaning every byte before ``b`` in segment ``n`` and every earlier segment
    was accepted by the supervisor, and ``lock`` (flock) against a second
    writer. Not thread-safe: one asyncio loop owns it.
    """

    def __init__(self, directory: Path, job_id: str, node: str) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = open(directory / _LOCK_NAME, "a")  # noqa: SIM115 (held until close)
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as error:
            self._lock.close()
            raise SpoolLocked(
                f"spool {directory} is in use by another agent process on this node: "
                "stop it first, or give each agent its own spool directory"
            ) from error
        self.pending: collections.deque[_Spooled] = collections.deque()
        self._cursor = self._read_cursor()
        self._load(job_id, node)
        self._segment = max(max(self._segments(), default=0), self._cursor[0]) + 1
        self._file: IO[bytes] = open(self._path(self._segment), "ab")  # noqa: SIM115
        self._offset = 0
        fsync_dir(directory)
        self._remove_acknowledged_segments()

    def append(self, event: Event) -> None:
        """Write ``event`` durably, then queue it for sending."""
        line = protocol.encode_event(event) + b"\n"
        self._file.write(line)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._offset += len(line)
        self.pending.append(_Spooled(event, len(line), (self._segment, self._offset)))

    def batch(self, max_events: int, max_bytes: int) -> list[Event]:
        """The oldest pending events, at most ``max_events`` and about ``max_bytes`` encoded."""
        events: list[Event] = []
        size = 0
        for spooled in self.pending:
            if events and (len(events) >= max_events or size + spooled.encoded_bytes > max_bytes):
                break
            events.append(spooled.event)
            size += spooled.encoded_bytes
        return events

    def acknowledge(self, count: int) -> None:
        """Drop the ``count`` oldest pending events: advance the cursor past them, durably."""
        last = None
        for _ in range(count):
            last = self.pending.popleft()
        if last is None:
            return
        self._write_cursor(last.position, last.event.event_id)
        self._remove_acknowledged_segments()
        if not self.pending and self._offset > ROTATE_BYTES:
            self._rotate()

    def close(self) -> None:
        """Close the segment and release the directory lock."""
        self._file.close()
        self._lock.close()

    def _rotate(self) -> None:
        old = self._segment
        self._segment += 1
        self._file.close()
        self._file = open(self._path(self._segment), "ab")  # noqa: SIM115
        self._offset = 0
        fsync_dir(self.directory)
        # The new, empty segment exists before the cursor names it, so a crash
        # in between leaves a cursor that points at a real file.
        self._write_cursor((self._segment, 0), None)
        self._path(old).unlink(missing_ok=True)

    def _path(self, segment: int) -> Path:
        return self.directory / f"{_SEGMENT_PREFIX}{segment:08d}{_SEGMENT_SUFFIX}"

    def _segments(self) -> list[int]:
        numbers = []
        for path in self.directory.glob(f"{_SEGMENT_PREFIX}*{_SEGMENT_SUFFIX}"):
            digits = path.name[len(_SEGMENT_PREFIX) : -len(_SEGMENT_SUFFIX)]
            if digits.isdigit():
                numbers.append(int(digits))
        return sorted(numbers)

    def _read_cursor(self) -> tuple[int, int]:
        path = self.directory / _CURSOR_NAME
        if not path.exists():
            return (0, 0)
        try:
            document = json.loads(path.read_bytes())
            segment, offset = document["segment"], document["offset"]
            if not (isinstance(segment, int) and isinstance(offset, int)):
                raise ValueError("segment and offset must be integers")
            return (segment, offset)
        except (OSError, ValueError, KeyError, TypeError) as error:
            # Written atomically, so this is damage from outside; replaying
            # everything is safe because the supervisor dedups by event id.
            logger.error("spool cursor %s unreadable (%s): replaying the whole spool", path, error)
            return (0, 0)

    def _write_cursor(self, position: tuple[int, int], event_id: str | None) -> None:
        self._cursor = position
        document = {"segment": position[0], "offset": position[1], "last_event_id": event_id}
        write_durably(self.directory / _CURSOR_NAME, json.dumps(document).encode())

    def _load(self, job_id: str, node: str) -> None:
        for segment in self._segments():
            if segment < self._cursor[0]:
                continue
            start = self._cursor[1] if segment == self._cursor[0] else 0
            for event, end in self._read_segment(segment, start):
                if (event.job_id, event.node) != (job_id, node):
                    self._lock.close()
                    raise ConfigError(
                        f"spool {self.directory} holds undelivered events of job "
                        f"{event.job_id} on node {event.node}, not {job_id} on {node}: "
                        "give each job and node its own spool directory"
                    )
                encoded = len(protocol.encode_event(event)) + 1
                self.pending.append(_Spooled(event, encoded, (segment, end)))
        if self.pending:
            logger.info(
                "spool %s: %d undelivered events from earlier runs will be sent first",
                self.directory,
                len(self.pending),
            )

    def _read_segment(self, segment: int, start: int) -> Iterator[tuple[Event, int]]:
        data = self._path(segment).read_bytes()
        offset = start
        while offset < len(data):
            end = data.find(b"\n", offset)
            if end < 0:
                # The append that wrote this was never fsynced to completion, so
                # emit() never returned it: nobody was told it was recorded.
                logger.warning(
                    "spool segment %s ends in a torn line (%d bytes): ignored",
                    self._path(segment),
                    len(data) - offset,
                )
                return
            line = data[offset:end]
            offset = end + 1
            try:
                yield protocol.decode_event(line), offset
            except protocol.ProtocolError as error:
                logger.error(
                    "spool segment %s: skipping an undecodable line at byte %d (%s): %r",
                    self._path(segment),
                    end - len(line),
                    error,
                    line[:200],
                )

    def _remove_acknowledged_segments(self) -> None:
        for segment in self._segments():
            if segment < self._cursor[0]:
                self._path(segment).unlink(missing_ok=True)
