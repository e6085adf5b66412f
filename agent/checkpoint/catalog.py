"""What checkpoints a directory holds, and which one to resume from.

``list_checkpoints`` only looks (names, marker, sizes, save statistics from the
manifest); it never validates. ``newest_valid`` walks the list newest first and
validates until one passes, keeping the report of every newer one it rejected,
so that the supervisor and ``resurgo ckpt newest`` can say why they fell back.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint import files
from agent.checkpoint import format as fmt
from agent.checkpoint.report import Level, Report
from agent.wire.diskio import fsync_dir
from agent.wire.errors import CheckpointInvalid

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    """One ``step-<N>`` directory as found on disk (not validated).

    ``mtime_s`` is the latest modification time of the directory or any file
    in it: the last sign of life of a save in progress. ``stats`` comes from the
    manifest when one is present and parses.
    """

    step: int
    path: str
    committed: bool
    has_manifest: bool
    mtime_s: float
    total_bytes: int
    stats: fmt.SaveStats | None


def list_checkpoints(root: str | os.PathLike[str]) -> list[Entry]:
    """Every ``step-<N>`` directory directly under ``root``, newest step first.

    Other names are ignored. A missing ``root`` holds no checkpoints yet (the job
    has not saved), so it gives an empty list.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        return []
    entries = []
    for child in root_path.iterdir():
        step = fmt.parse_step_dir_name(child.name)
        if step is None or not child.is_dir():
            continue
        try:
            entries.append(describe(child, step))
        except OSError as error:
            # Deleted while we looked (retention, an operator): not a checkpoint now.
            log.warning("skipping %s: %s", child, error)
    entries.sort(key=lambda entry: entry.step, reverse=True)
    return entries


def newest_committed_step(root: str | os.PathLike[str]) -> int | None:
    """The newest step under ``root`` with a commit marker (not validated), cheaply: one
    directory listing and a stat per step directory, newest first; None when none."""
    for step in _steps_newest_first(root):
        if _marked(root, step):
            return step
    return None


def step_being_written(root: str | os.PathLike[str]) -> Path | None:
    """The newest step directory under ``root`` when it has no commit marker yet (a save
    under way, or one cut short); None when the newest is committed or there is none.
    As cheap as :func:`newest_committed_step`."""
    steps = _steps_newest_first(root)
    if not steps or _marked(root, steps[0]):
        return None
    return Path(root) / fmt.step_dir_name(steps[0])


def _steps_newest_first(root: str | os.PathLike[str]) -> list[int]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(
        (step for step in map(fmt.parse_step_dir_name, names) if step is not None), reverse=True
    )


def _marked(root: str | os.PathLike[str], step: int) -> bool:
    return (Path(root) / fmt.step_dir_name(step) / fmt.MARKER_NAME).is_file()


def newest_valid(
    root: str | os.PathLike[str], level: Level = Level.FULL
) -> tuple[Report | None, list[Report]]:
    """The newest checkpoint under ``root`` that passes ``level``, and every newer rejection.

    Returns ``(None, rejections)`` when no checkpoint is valid. Rejections are
    ordered newest first; each report's ``reason`` says why it was passed over.
    """
    from agent.checkpoint.validate import validate  # torch: only where a check runs

    rejected: list[Report] = []
    for entry in list_checkpoints(root):
        report = validate(entry.path, level)
        if report.valid:
            return report, rejected
        log.info("checkpoint %s rejected at %s: %s", entry.path, report.failed_level, report.reason)
        rejected.append(report)
    return None, rejected


def describe(directory: Path, step: int) -> Entry:
    """The catalog's entry for one ``step-<N>`` directory (not validated)."""
    mtime_s = directory.stat().st_mtime
    total_bytes = 0
    for child in directory.iterdir():
        # lstat: a symlink counts as itself, never as what it points to.
        status = child.lstat()
        total_bytes += status.st_size
        mtime_s = max(mtime_s, status.st_mtime)
    manifest_path = directory / fmt.MANIFEST_NAME
    stats = None
    has_manifest = manifest_path.is_file()
    if has_manifest:
        try:
            stats = fmt.manifest_from_bytes(files.read_small(manifest_path)).stats
        except (CheckpointInvalid, ValueError):
            stats = None  # validation reports the broken manifest; listing just shows none
    return Entry(
        step=step,
        path=str(directory),
        committed=(directory / fmt.MARKER_NAME).is_file(),
        has_manifest=has_manifest,
        mtime_s=mtime_s,
        total_bytes=total_bytes,
        stats=stats,
    )


def supersede_newer(root: str | os.PathLike[str], step: int, now_unix_s: float) -> list[Path]:
    """Move every ``step-<N>`` with N > ``step`` aside as ``step-<N>.superseded-<unix>``.

    A run that resumes from ``step`` abandons what came after it: those
    checkpoints (rejected, or from a timeline the resume replaces) would
    otherwise collide with the new run's saves at the same steps, and a later
    "newest valid" could pick them over the continuation's own. Nothing is
    deleted: the directories stay for inspection under a name that is not a
    checkpoint. Call on one rank (rank 0) before the first save.
    """
    moved = []
    for entry in list_checkpoints(root):
        if entry.step <= step:
            continue
        source = Path(entry.path)
        target = files.move_aside(source, "superseded", now_unix_s)
        log.warning("resuming from step %d: %s moved aside to %s", step, source, target.name)
        moved.append(target)
    if moved:
        fsync_dir(Path(root))
    return moved
