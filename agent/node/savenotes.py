"""A rank's checkpoint saves as the agent hears of them, and the events they become.

A rank in phase ``checkpoint`` is saving: the time from its first beat in
that phase to its first beat out of it is how long the save took (for a
script that imports nothing, the bootstrap beats around ``torch.save`` and
DCP saves). A checkpoint note is a commit of the in-rank library
(``checkpoint_committed``) or a file a script saved itself
(``checkpoint_written``, with its bytes and that duration).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable
from typing import Any

from agent.wire import protocol
from agent.wire.datagram import CheckpointNote, Phase, RankBeat

log = logging.getLogger(__name__)


class SaveNotes:
    """Each local rank's save in progress and its last save's duration; monotonic time."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        # A rank's save in progress (monotonic start) and its last save's seconds.
        self._saving_since: dict[int, float] = {}
        self._save_seconds: dict[int, float] = {}
        # Paths the ranks noted as written themselves (the root's scan leaves them out).
        self.written: set[str] = set()

    def on_beat(self, beat: RankBeat) -> None:
        """Note a save starting or ending from the phase of a rank's beat."""
        now = self._monotonic()
        if beat.phase is Phase.CHECKPOINT:
            self._saving_since.setdefault(beat.rank, now)
        elif (since := self._saving_since.pop(beat.rank, None)) is not None:
            self._save_seconds[beat.rank] = now - since

    def saving(self) -> bool:
        """Whether a local rank is in its checkpoint phase now."""
        return bool(self._saving_since)

    def event(self, message: CheckpointNote) -> tuple[protocol.EventKind, dict[str, Any]] | None:
        """The event a checkpoint note becomes; None (logged) for a path that is not UTF-8."""
        if not protocol.is_unicode(message.path):
            # Undecodable bytes kept by surrogateescape: the protocol
            # carries valid Unicode only, and the supervisor refuses it.
            log.warning("checkpoint path %s is not UTF-8: not reported", ascii(message.path))
            return None
        # A commit of ours, or a file a script that imports nothing saved.
        note = {"step": message.step, "path": message.path, "global_rank": message.rank}
        kind = protocol.EventKind.CHECKPOINT_COMMITTED
        if message.automatic:
            self.written.add(message.path)
            kind = protocol.EventKind.CHECKPOINT_WRITTEN
            note["total_bytes"] = _size_of(message.path)
            note["duration_s"] = self._took(message.rank)
        return kind, note

    def _took(self, rank: int) -> float | None:
        """Seconds the save a note reports took (None: no checkpoint phase was seen)."""
        took = self._save_seconds.pop(rank, None)
        if took is None and (since := self._saving_since.get(rank)) is not None:
            took = self._monotonic() - since  # the note came before the phase ended
        return None if took is None else round(took, 3)


def _size_of(path: str) -> int | None:
    """A written file's size, or the bytes of every file in a written directory (a DCP
    save); None when it cannot be read (moved, or another user's)."""
    try:
        found = os.stat(path)
        if not stat.S_ISDIR(found.st_mode):
            return found.st_size
        total = 0
        for root, _, names in os.walk(path):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(root, name)).st_size
        return total
    except OSError:
        return None
