"""Checkpoints validated when they are written, so that a recovery finds its choice made.

Validating the newest checkpoint after a fault puts a read of it (the whole of
it at ``full`` level) between the fault and the relaunch. :class:`AheadValidation`
validates each job's newest checkpoint as soon as the supervisor hears of it
(a commit, or a checkpoint a script wrote itself), in the background, and
keeps the verdict with the checkpoint's
fingerprint: every file's name, size, inode and change times. At the fault,
:meth:`AheadValidation.verdict` answers from that verdict when the
checkpoint is unchanged since; a checkpoint changed since (a file truncated,
rewritten, added or gone) is validated again then, as before.

The background has a validation child of its own (niced): the fault's
validation never waits for it, and takes the verdict of a background
validation of the same checkpoint still running, once that one reads: a
background child still starting (importing torch, niced, on a loaded head
node: a minute and more) is not waited for, the fault's own child reads it. Only the newest
checkpoint of a job waits to be validated (a newer one replaces it), and
verdicts are kept for the newest :data:`KEEP` checkpoints. A restarted supervisor keeps none:
its first recovery validates as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Verdicts kept, newest first; with a few checkpoints a job, thousands of jobs' newest.
KEEP = 4096
# A checkpoint of more files is not fingerprinted (validated at the fault instead).
MAX_FILES = 100_000
# How deep each level reads: a valid verdict answers for its level and the shallower.
DEPTH = {"quick": 0, "full": 1, "load": 2}

Fingerprint = tuple[tuple[str, int, int, int, int], ...]
Check = Callable[[str, str], Awaitable[tuple[bool, str]]]


def fingerprint(path: str) -> Fingerprint | None:
    """(name under ``path``, size, inode, modification and status-change times in ns)
    of each file of the checkpoint at ``path`` (a file, or a directory's files at any
    depth), sorted; None when it is gone, unreadable or has more than
    :data:`MAX_FILES` files. A file written or replaced since changes its entry:
    the times move with every write (the kernel's clock tick apart), a replacing
    file has another inode."""
    try:
        if not os.path.isdir(path):
            return (_entry("", os.stat(path)),)
        files: list[tuple[str, int, int, int, int]] = []
        for folder, _, names in os.walk(path, onerror=_raise):
            for name in names:
                full = os.path.join(folder, name)
                files.append(
                    _entry(os.path.relpath(full, path), os.stat(full, follow_symlinks=False))
                )
                if len(files) > MAX_FILES:
                    return None
    except OSError:
        return None
    return tuple(sorted(files))


def _entry(name: str, seen: os.stat_result) -> tuple[str, int, int, int, int]:
    return (name, seen.st_size, seen.st_ino, seen.st_mtime_ns, seen.st_ctime_ns)


def _raise(error: OSError) -> None:
    raise error


@dataclass(frozen=True)
class Verdict:
    """A background validation's result, and the checkpoint as it was read."""

    fingerprint: Fingerprint
    level: str
    valid: bool
    reason: str

    def answers(self, level: str) -> bool:
        """Whether this verdict stands for a validation at ``level``: a valid one for
        its level and the shallower ones, an invalid one for its own level only."""
        return _covers(self.level, level) if self.valid else self.level == level


class AheadValidation:
    """Each job's newest checkpoint validated in the background; :meth:`run` is the task."""

    def __init__(
        self, check: Check, *, keep: int = KEEP, reading: Callable[[], bool] = lambda: True
    ) -> None:
        """``check(path, level)`` validates one checkpoint: ``(valid, reason)``;
        ``reading()``: whether a check under way reads now (its process has started)."""
        self._check = check
        self._reading = reading
        self._keep = keep
        self._verdicts: OrderedDict[str, Verdict] = OrderedDict()
        self._waiting: OrderedDict[str, tuple[str, str]] = OrderedDict()  # job -> (path, level)
        self._wake = asyncio.Event()
        self._current: tuple[str, str, asyncio.Task[None]] | None = None
        self.validated = 0  # background validations finished

    def note(self, job_id: str, path: str, level: str) -> None:
        """Validate ``path``, ``job_id``'s newest checkpoint, at ``level`` when the
        process is free (replacing the job's checkpoint still waiting, if any)."""
        self._waiting.pop(job_id, None)
        self._waiting[job_id] = (os.path.normpath(path), level)
        self._wake.set()

    async def verdict(self, path: str, level: str) -> tuple[bool, str] | None:
        """The checkpoint's verdict at ``level`` from a background validation of it
        as it is now (waiting for one still running); None: validate it now."""
        path = os.path.normpath(path)
        current = self._current
        if current is not None and current[0] == path and _covers(current[1], level):
            if not self._reading():
                log.info("checkpoint %s: its background validation is still starting; "
                         "read at the fault instead", path)  # fmt: skip
                return None
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(current[2])
        known = self._verdicts.get(path)
        if known is None or not known.answers(level):
            return None
        now = await asyncio.to_thread(fingerprint, path)
        if now != known.fingerprint:
            log.info("checkpoint %s changed since it was validated: validating it again", path)
            return None
        return known.valid, known.reason

    async def run(self) -> None:
        """Validate the waiting checkpoints, one at a time, for as long as the daemon runs."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                _, (path, level) = self._waiting.popitem(last=False)
                known = self._verdicts.get(path)
                if known is not None and known.answers(level):
                    now = await asyncio.to_thread(fingerprint, path)
                    if now == known.fingerprint:
                        continue  # heard of twice (a commit, then the file written)
                task = asyncio.create_task(self._validate(path, level))
                self._current = (path, level, task)
                try:
                    await task
                except Exception:
                    # The fault's validation reads it instead (and says what failed).
                    log.exception("validating %s ahead of any fault failed", path)
                finally:
                    self._current = None

    async def _validate(self, path: str, level: str) -> None:
        before = await asyncio.to_thread(fingerprint, path)
        if before is None:
            return
        valid, reason = await self._check(path, level)
        if await asyncio.to_thread(fingerprint, path) != before:
            return  # written to while read: the fault's validation reads it again
        self.validated += 1
        verdict = "valid" if valid else "rejected"
        why = f": {reason}" if reason else ""
        log.info("checkpoint %s %s at %s ahead of any fault%s", path, verdict, level, why)
        self._verdicts.pop(path, None)
        self._verdicts[path] = Verdict(before, level, valid, reason)
        while len(self._verdicts) > self._keep:
            self._verdicts.popitem(last=False)


def _covers(done: str, asked: str) -> bool:
    """Whether a validation at level ``done`` reads all that one at ``asked`` would."""
    return DEPTH.get(done, -1) >= DEPTH.get(asked, 99)
