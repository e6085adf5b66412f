"""The on-disk side of a checkpoint's commit: fresh step directories, manifest, marker.

:class:`~agent.checkpoint.save.Checkpointer` decides when; this module says
what is on disk. Rank 0 prepares a fresh ``step-<N>/`` before a save; each
rank lists the data files it wrote; rank 0 writes the manifest and then the
commit marker, both durably, after the directory's own entry is durable. A
directory without a marker that commits exactly its manifest is not a
checkpoint (:func:`is_committed`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agent.checkpoint import files
from agent.checkpoint import format as fmt
from agent.wire.diskio import fsync_dir
from agent.wire.errors import CheckpointError

logger = logging.getLogger(__name__)


def prepare_step_dir(path: Path, now_unix_s: float) -> Path:
    """Make ``path`` a fresh, empty step directory; return it.

    A committed checkpoint there is never overwritten (CheckpointError). An
    uncommitted leftover (a crashed save) is renamed aside to
    ``step-<N>.aborted-<unix>``, a name retention and restore do not take for a
    checkpoint: DCP writing into it would keep its stale ``.metadata`` until
    the new one lands, so a crash could leave old metadata beside new shards.

    The new entry is not fsynced here: nothing in the directory counts until
    the commit, which fsyncs ``path.parent`` before it writes the marker.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        if is_committed(path):
            raise CheckpointError(
                f"{path} is already a committed checkpoint and Resurgo never overwrites one; "
                "save under a new step, or move it away deliberately"
            )
        aside = files.move_aside(path, "aborted", now_unix_s)
        logger.warning("uncommitted leftover %s renamed to %s before saving", path, aside.name)
    path.mkdir()
    return path


def discard_fresh_dir(path: Path) -> None:
    """Rank 0: remove the empty directory prepared for a save that was skipped."""
    try:
        path.rmdir()
    except OSError as error:  # left as an uncommitted leftover, renamed aside next time
        logger.warning("could not remove unused %s: %s", path, error)


def is_committed(path: Path) -> bool:
    """True when ``path`` holds a manifest and a marker that commits exactly it."""
    try:
        manifest = files.read_small(path / fmt.MANIFEST_NAME)
        marker = files.read_small(path / fmt.MARKER_NAME)
        fmt.check_marker(marker, manifest)
    except (OSError, ValueError, CheckpointError):
        return False
    return True


def own_data_files(path: Path, rank: int) -> list[fmt.FileEntry]:
    """The DCP data files ``rank`` wrote into ``path``, each with its size and checksum."""
    prefix = f"__{rank}_"  # FileSystemWriter names data files by group rank
    return [
        files.describe_file(path, name)
        for name in sorted(os.listdir(path))
        if name.startswith(prefix) and name.endswith(fmt.DCP_DATA_SUFFIX)
    ]


def all_files(path: Path, reports: Iterable[Mapping[str, Any]]) -> list[fmt.FileEntry]:
    """Every rank's reported data files and DCP's ``.metadata``, sorted by path."""
    entries = [fmt.FileEntry(**entry) for report in reports for entry in report["files"]]
    # .metadata is final: DCP renamed it into place before the future completed.
    entries.append(files.describe_file(path, fmt.DCP_METADATA_NAME))
    entries.sort(key=lambda entry: entry.path)
    return entries


def write_commit(path: Path, manifest: fmt.Manifest) -> None:
    """Write ``manifest`` and then the marker that commits it, both durably."""
    data = fmt.manifest_to_bytes(manifest)
    # The step directory's entry in root (prepare_step_dir leaves it
    # unsynced, so the training loop never waits on a journal commit)
    # must be durable before the marker can commit what is inside.
    fsync_dir(path.parent)
    # The manifest's durable write also fsyncs the directory, which makes
    # DCP's own .metadata rename durable: DCP renames without a dir fsync.
    files.write_durably(path / fmt.MANIFEST_NAME, data)
    # The commit point: before this rename lands, the directory is uncommitted.
    files.write_durably(path / fmt.MARKER_NAME, fmt.marker_bytes(data))
