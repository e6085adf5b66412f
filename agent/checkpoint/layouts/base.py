"""What every checkpoint layout shares: a found checkpoint, the interface, a report builder."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from agent.checkpoint.report import Level, Report

# The step a checkpoint's name gives: step-120, checkpoint-120, global_step120, iter_0120
# (a directory), or Lightning's "step=120" in a file's name.
_STEP_NAMED = re.compile(r"(?:step|checkpoint|iter)[-_]?(\d+)$")
_STEP_ASSIGNED = re.compile(r"(?:^|[-_])step=(\d+)")

# Where quarantined checkpoints go, inside the checkpoint root; no layout looks in it.
QUARANTINE_DIR = ".resurgo-quarantine"


@dataclass(frozen=True)
class Found:
    """One checkpoint as found on disk, not validated.

    ``name`` is how its framework names it (``checkpoint-120``, ``last.ckpt``),
    relative to the root; ``complete`` is the layout's sign that its save
    finished (a commit marker, ``trainer_state.json``, a whole zip archive's
    end); ``mtime_s`` the newest modification time in it.
    """

    layout: str
    path: str
    name: str
    step: int | None
    mtime_s: float
    total_bytes: int
    complete: bool


class Layout(Protocol):
    """One framework's way of keeping checkpoints (see the module docstring)."""

    name: str

    def owns(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint of this layout (by its name and kind)."""

    def find(self, root: Path) -> Iterable[Found]:
        """The checkpoints of this layout under ``root``."""

    def check(self, path: Path, level: Level) -> Report:
        """Validate one checkpoint up to ``level``; a bad one is a report, never an exception."""

    def steer(self, root: Path, chosen: Path | None) -> list[str]:
        """Point the framework's "latest" at ``chosen`` after a quarantine; say what changed."""


@dataclass
class Ladder:
    """A report under construction: the levels passed so far, and what was skipped."""

    path: Path
    level: Level
    step: int | None = None
    checked: list[Level] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def wants(self, level: Level) -> bool:
        """Whether validation goes as deep as ``level``."""
        order = (Level.QUICK, Level.FULL, Level.LOAD)
        return order.index(level) <= order.index(self.level)

    def passed(self, level: Level) -> None:
        self.checked.append(level)

    def fail(self, level: Level, reason: str) -> Report:
        return self._report(level, reason)

    def ok(self) -> Report:
        return self._report(None, None)

    def _report(self, failed: Level | None, reason: str | None) -> Report:
        return Report(
            path=str(self.path), valid=failed is None, level=self.level,
            checked=tuple(self.checked), failed_level=failed, reason=reason, step=self.step,
            has_manifest=False, skipped=tuple(self.skipped),
        )  # fmt: skip


def newest_mtime(path: Path) -> tuple[float, int]:
    """(newest modification time, total bytes) of a file, or of a directory and its files."""
    status = path.lstat()
    if not path.is_dir():
        return status.st_mtime, status.st_size
    mtime_s, total = status.st_mtime, 0
    for child in path.iterdir():
        # lstat: a symlink counts as itself, never as what it points to.
        child_status = child.lstat()
        total += child_status.st_size
        mtime_s = max(mtime_s, child_status.st_mtime)
    return mtime_s, total


def named_directories(
    root: Path, pattern: re.Pattern[str]
) -> Iterator[tuple[Path, int, float, int]]:
    """The directories directly under ``root`` whose name matches ``pattern`` (its first
    group a step): (path, that step, newest modification time, total bytes). One deleted
    while it is looked at (retention, an operator) is left out."""
    for child in root.iterdir():
        match = pattern.match(child.name)
        if match is None or not child.is_dir():
            continue
        try:
            mtime_s, total = newest_mtime(child)
        except OSError:
            continue
        yield child, int(match.group(1)), mtime_s, total


def step_in_path(path: str | os.PathLike[str]) -> int | None:
    """The step a checkpoint's path names, from its name alone (None: it names none).

    What the supervisor and the views read from a chosen checkpoint's path, with
    no file opened: ``checkpoint-120`` and ``last.ckpt`` differ, the first names
    step 120, the second nothing.
    """
    name = Path(path).name
    if name.endswith(".ckpt"):
        match = _STEP_ASSIGNED.search(name[: -len(".ckpt")])
        return int(match.group(1)) if match else None
    match = _STEP_NAMED.search(name)
    return int(match.group(1)) if match else None
