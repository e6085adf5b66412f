"""The Resurgo checkpoint format: the one owner of names, manifest and commit marker.

A Resurgo checkpoint is a torch.distributed.checkpoint (DCP) directory
``step-<N>/`` with two extra files:

- ``resurgo.manifest.json`` lists every file of the checkpoint (relative path,
  byte count, xxh3-128 checksum), the step, the world size that saved it, which
  kinds of state are inside, and save statistics. It is written after the DCP
  save future completed, so the DCP ``.metadata`` it lists is final.
- ``resurgo.committed`` is the commit marker, written last and fsynced (then the
  directory is fsynced). It holds the checksum of the manifest's exact bytes, so
  a marker can only commit the manifest it was written for.

The writer (``agent.checkpoint.save``) and the validator
(``agent.checkpoint.validate``, used by the supervisor and ``resurgo ckpt``)
both import this module; nothing about the format is written anywhere else.

This module is pure: it turns values into bytes and bytes into values, and
never touches the disk or the clock.
"""

from __future__ import annotations

import enum
import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import xxhash

from agent.wire.errors import CheckpointInvalid

FORMAT_VERSION = 1

MANIFEST_NAME = "resurgo.manifest.json"
MARKER_NAME = "resurgo.committed"
DCP_METADATA_NAME = ".metadata"
# DCP's coordinator writes this, fsyncs and renames it to .metadata; a leftover
# one means the coordinator died between the two.
DCP_METADATA_TMP_NAME = ".metadata.tmp"
DCP_DATA_SUFFIX = ".distcp"

CHECKSUM_ALGORITHM = "xxh3_128"
# Large enough to amortise the Python call per chunk, small enough to keep
# validation memory bounded whatever the shard size.
CHUNK_BYTES = 8 << 20

STEP_DIR = re.compile(r"^step-(\d+)$")
_MARKER_PREFIX = "resurgo-commit v1 "


class StateKind(enum.Enum):
    """What a checkpoint holds; recorded in the manifest's ``contents``."""

    MODEL = "model"
    OPTIMIZER = "optimizer"
    LR_SCHEDULER = "lr_scheduler"
    GRAD_SCALER = "grad_scaler"
    RNG = "rng"
    DATA_POSITION = "data_position"
    STEP = "step"
    EXTRA = "extra"


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: path relative to the checkpoint directory."""

    path: str
    bytes: int
    checksum: str


@dataclass(frozen=True)
class SaveStats:
    """How the save went, for operators (``resurgo ckpt list``) and metrics."""

    stall_s: float
    write_s: float
    total_bytes: int
    filesystem: str
    mode: str  # "async" or "sync" (fallback when host memory could not hold the staged copy)


@dataclass(frozen=True)
class Manifest:
    """Everything Resurgo records about one committed checkpoint."""

    step: int
    world_size: int
    contents: tuple[StateKind, ...]
    files: tuple[FileEntry, ...]
    created_unix_s: float
    stats: SaveStats | None = None
    format_version: int = FORMAT_VERSION
    checksum_algorithm: str = CHECKSUM_ALGORITHM
    user: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Sum of the byte counts of every listed file."""
        return sum(entry.bytes for entry in self.files)


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step}"


def parse_step_dir_name(name: str) -> int | None:
    """The step of a ``step-<N>`` directory name, or None for any other name."""
    match = STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def new_hasher() -> Any:
    """A fresh incremental hasher for :data:`CHECKSUM_ALGORITHM`."""
    return xxhash.xxh3_128()


def checksum_bytes(data: bytes) -> str:
    """Checksum of ``data`` as stored in the manifest and the marker."""
    return f"{CHECKSUM_ALGORITHM}:{xxhash.xxh3_128_hexdigest(data)}"


def format_checksum(hasher: Any) -> str:
    """The manifest spelling of a finished :func:`new_hasher` hasher."""
    return f"{CHECKSUM_ALGORITHM}:{hasher.hexdigest()}"


def check_relative_path(path: str) -> str:
    """Return ``path`` if it names a file inside the checkpoint directory, else raise.

    A manifest or DCP metadata that points outside its directory (absolute path,
    ``..``, empty component) is treated as corrupt, never followed.
    """
    parts = path.split("/")
    if not path or path.startswith("/") or "\\" in path or "\x00" in path:
        raise CheckpointInvalid(f"path {path[:200]!r} does not name a file inside the checkpoint")
    if any(part in ("", ".", "..") for part in parts):
        raise CheckpointInvalid(f"path {path[:200]!r} does not name a file inside the checkpoint")
    try:
        # What the filesystem call will do with it (os.fsencode on Linux): a
        # lone surrogate outside the escaped-byte range names no file at all.
        path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as error:
        raise CheckpointInvalid(f"path {path[:200]!r} cannot be a file name: {error}") from error
    return path


def manifest_to_bytes(manifest: Manifest) -> bytes:
    """Serialise ``manifest`` as canonical JSON (sorted keys, UTF-8, trailing newline)."""
    document = asdict(manifest)
    document["contents"] = [kind.value for kind in manifest.contents]
    return (json.dumps(document, sort_keys=True, indent=1) + "\n").encode()


def manifest_from_bytes(data: bytes) -> Manifest:
    """Parse manifest bytes strictly; raise :class:`CheckpointInvalid` naming the problem."""
    try:
        document = json.loads(data.decode())
    # ValueError covers JSONDecodeError and integers beyond Python's digit limit;
    # RecursionError, nesting deeper than the parser's stack.
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointInvalid(f"{MANIFEST_NAME} is not valid JSON: {error}") from error
    if not isinstance(document, dict):
        raise CheckpointInvalid(f"{MANIFEST_NAME} is not a JSON object")
    try:
        version = document["format_version"]
        if version != FORMAT_VERSION:
            raise CheckpointInvalid(
                f"{MANIFEST_NAME} has format_version {version!r}; this Resurgo reads "
                f"{FORMAT_VERSION}: upgrade Resurgo to read it"
            )
        if document["checksum_algorithm"] != CHECKSUM_ALGORITHM:
            raise CheckpointInvalid(
                f"{MANIFEST_NAME} uses checksum {document['checksum_algorithm']!r}, "
                f"expected {CHECKSUM_ALGORITHM!r}"
            )
        files = tuple(
            FileEntry(
                path=check_relative_path(_typed(entry["path"], str, "files[].path")),
                bytes=_non_negative(entry["bytes"], "files[].bytes"),
                checksum=_typed(entry["checksum"], str, "files[].checksum"),
            )
            for entry in _typed(document["files"], list, "files")
        )
        paths = [entry.path for entry in files]
        if len(set(paths)) != len(paths):
            raise CheckpointInvalid(f"{MANIFEST_NAME} lists a file twice")
        stats_doc = document.get("stats")
        stats = None
        if stats_doc is not None:
            stats = SaveStats(
                stall_s=_seconds(stats_doc["stall_s"], "stats.stall_s"),
                write_s=_seconds(stats_doc["write_s"], "stats.write_s"),
                total_bytes=_non_negative(stats_doc["total_bytes"], "stats.total_bytes"),
                filesystem=_typed(stats_doc["filesystem"], str, "stats.filesystem"),
                mode=_typed(stats_doc["mode"], str, "stats.mode"),
            )
        return Manifest(
            step=_non_negative(document["step"], "step"),
            world_size=_positive(document["world_size"], "world_size"),
            contents=tuple(
                StateKind(value) for value in _typed(document["contents"], list, "contents")
            ),
            files=files,
            created_unix_s=float(document["created_unix_s"]),
            stats=stats,
            user=_typed(document.get("user", {}), dict, "user"),
        )
    except CheckpointInvalid:
        raise
    # OverflowError: float() of an integer too large for a double.
    except (KeyError, TypeError, ValueError, OverflowError) as error:
        raise CheckpointInvalid(f"{MANIFEST_NAME} is malformed: {error!r}") from error


def marker_bytes(manifest_data: bytes) -> bytes:
    """Commit-marker content binding it to the exact manifest bytes."""
    return f"{_MARKER_PREFIX}{checksum_bytes(manifest_data)}\n".encode()


def check_marker(marker_data: bytes, manifest_data: bytes) -> None:
    """Raise :class:`CheckpointInvalid` unless the marker commits this manifest."""
    if marker_data != marker_bytes(manifest_data):
        raise CheckpointInvalid(
            f"{MARKER_NAME} does not match {MANIFEST_NAME}: the manifest was changed or "
            "the marker is from another save"
        )


def _typed(value: Any, kind: type, name: str) -> Any:
    if not isinstance(value, kind):
        raise CheckpointInvalid(f"{MANIFEST_NAME}: {name} must be {kind.__name__}")
    return value


def _non_negative(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise CheckpointInvalid(f"{MANIFEST_NAME}: {name} must be an integer >= 0")
    return value


def _seconds(value: Any, name: str) -> float:
    # A JSON number only: float() would also take the strings "nan" and "inf",
    # and json.loads the constants NaN and Infinity; none is a duration, and a
    # NaN save cost would poison every interval computed from it.
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
    ):
        raise CheckpointInvalid(f"{MANIFEST_NAME}: {name} must be a finite number >= 0")
    return float(value)


def _positive(value: Any, name: str) -> int:
    if _non_negative(value, name) == 0:
        raise CheckpointInvalid(f"{MANIFEST_NAME}: {name} must be an integer >= 1")
    return int(value)
