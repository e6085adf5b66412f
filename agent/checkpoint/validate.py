"""The checkpoint validation ladder: quick, full, load — cheapest level first.

Each level includes the ones before it and stops at the first failure it finds:

- ``QUICK`` reads only small files and ``stat``: commit marker, manifest and DCP
  ``.metadata`` exist and parse, the marker commits this manifest, no leftover
  ``.metadata.tmp``, the manifest agrees with the directory (same data files,
  same byte counts), and every DCP storage item lies inside its file.
- ``FULL`` adds the checksum of every file the manifest lists.
- ``LOAD`` adds a test load: every storage item deserializes the way DCP's
  ``FileSystemReader`` reads it, and floating tensors hold no NaN or Inf.

FULL and LOAD share one sequential pass per file: every byte is read once,
memory stays within one chunk plus the largest single item. When LOAD finds a
broken item it keeps hashing, so a checkpoint that FULL would reject is always
reported as failing FULL, the cheaper level.

A plain DCP directory (no Resurgo manifest, e.g. torchtitan's ``step-N/``) gets
QUICK without the manifest checks, and LOAD; the report says what was skipped.

Two pickles are involved, and neither is unpickled freely here, because the
supervisor validates checkpoints that any job user wrote while it may hold
Slurm operator rights: ``.metadata`` goes through an allowlist of DCP's own
metadata classes, and non-tensor items through torch's ``weights_only``
loader unless the caller trusts the checkpoint (``trust_pickled_objects``).
"""

from __future__ import annotations

import enum
import io
import math
import os
import pickle
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from agent.checkpoint import files
from agent.checkpoint import format as fmt
from agent.checkpoint.report import Level, Report
from agent.wire.errors import CheckpointInvalid

# DCP metadata grows with the number of tensors times shards; large FSDP models
# reach tens of MB. Beyond this, treat the file as corrupt instead of reading it.
# The words of a rejection for memory (the validation process names its limit after them).
NEEDS_MORE_MEMORY = "needs more memory to load than this process may use"
_METADATA_LIMIT_BYTES = 512 << 20
_MARKER_LIMIT_BYTES = 4096

PLAIN_DCP_NOTE = "no Resurgo manifest: checksums not checked (plain DCP directory)"


_LADDER = (Level.QUICK, Level.FULL, Level.LOAD)


def validate(
    path: str | os.PathLike[str],
    level: Level = Level.FULL,
    *,
    trust_pickled_objects: bool = False,
) -> Report:
    """Validate the checkpoint directory ``path`` up to ``level``; never raises for a bad one.

    ``trust_pickled_objects=True`` unpickles non-tensor items that reference
    arbitrary Python classes (NumPy RNG state, user objects). That runs code
    from the checkpoint: pass it only where the caller would load the checkpoint
    anyway with the same rights (the job restoring its own state).
    """
    if not isinstance(level, Level):
        raise TypeError(f"level must be a Level, got {level!r}")
    ladder = _Ladder(Path(path), level, trust_pickled_objects)
    try:
        ladder.run()
    except _Rejected as rejected:
        return ladder.report(rejected)
    except OSError as error:
        # Permissions, a file deleted mid-run, an I/O error: unreadable means unusable.
        reached = ladder.checked[-1] if ladder.checked else Level.QUICK
        return ladder.report(_Rejected(reached, f"{path} cannot be read: {error}"))
    return ladder.report(None)


class _Rejected(Exception):
    """Internal: stops the ladder at the first failure."""

    def __init__(self, level: Level, reason: str) -> None:
        super().__init__(reason)
        self.level = level
        self.reason = reason


@dataclass(frozen=True)
class _Item:
    index: dcp_metadata.MetadataIndex
    relative_path: str
    offset: int
    length: int
    transforms: tuple[str, ...]


class _Ladder:
    """One validation run: state gathered by QUICK and reused by FULL and LOAD."""

    def __init__(self, directory: Path, level: Level, trust_pickled_objects: bool) -> None:
        self.directory = directory
        self.root = directory
        self.level = level
        self.trust = trust_pickled_objects
        self.checked: list[Level] = []
        self.skipped: list[str] = []
        self.manifest: fmt.Manifest | None = None
        self.has_manifest = False
        self.metadata_bytes = b""
        self.metadata: dcp_metadata.Metadata | None = None
        self.items: list[_Item] = []
        self.unpickled_refused: list[str] = []
        self.step = fmt.parse_step_dir_name(directory.name)

    def report(self, rejected: _Rejected | None) -> Report:
        skipped = list(self.skipped)
        if self.unpickled_refused:
            shown = ", ".join(repr(name) for name in self.unpickled_refused[:3])
            more = len(self.unpickled_refused) - 3
            skipped.append(
                f"{len(self.unpickled_refused)} non-tensor item(s) ({shown}"
                f"{f' and {more} more' if more > 0 else ''}) reference Python classes that "
                "weights_only refuses: not unpickled (trust the checkpoint to check them)"
            )
        return Report(
            path=str(self.directory),
            valid=rejected is None,
            level=self.level,
            checked=tuple(self.checked),
            failed_level=None if rejected is None else rejected.level,
            reason=None if rejected is None else rejected.reason,
            step=self.step,
            has_manifest=self.has_manifest,
            skipped=tuple(skipped),
            manifest=self.manifest,
        )

    def run(self) -> None:
        self.checked.append(Level.QUICK)
        self.quick()
        wanted = _LADDER[: _LADDER.index(self.level) + 1]
        hash_files = Level.FULL in wanted and self.manifest is not None
        load_items = Level.LOAD in wanted
        if hash_files:
            self.checked.append(Level.FULL)
        if load_items:
            self.checked.append(Level.LOAD)
        if hash_files or load_items:
            self.stream(hash_files, load_items)

    # QUICK -----------------------------------------------------------------

    def quick(self) -> None:
        directory = self.directory
        if not directory.is_dir():
            raise _Rejected(Level.QUICK, f"{directory} is not a directory")
        self.root = directory.resolve()
        if (directory / fmt.DCP_METADATA_TMP_NAME).exists():
            raise _Rejected(
                Level.QUICK,
                f"{directory / fmt.DCP_METADATA_TMP_NAME} is left over: DCP's coordinator "
                "died before renaming it, so the save never finished",
            )
        has_marker = (directory / fmt.MARKER_NAME).exists()
        self.has_manifest = (directory / fmt.MANIFEST_NAME).exists()
        if has_marker != self.has_manifest:
            present, missing = (
                (fmt.MARKER_NAME, fmt.MANIFEST_NAME)
                if has_marker
                else (fmt.MANIFEST_NAME, fmt.MARKER_NAME)
            )
            raise _Rejected(
                Level.QUICK,
                f"{directory / missing} is missing although {present} exists: "
                "the Resurgo save was interrupted",
            )
        if self.has_manifest:
            self.read_manifest()
        else:
            self.skipped.append(PLAIN_DCP_NOTE)
        self.read_metadata()
        if self.manifest is not None:
            self.check_manifest_against_directory()
        self.check_items_fit()

    def read_manifest(self) -> None:
        manifest_data = self.read_small(fmt.MANIFEST_NAME, 64 << 20)
        marker_data = self.read_small(fmt.MARKER_NAME, _MARKER_LIMIT_BYTES)
        try:
            fmt.check_marker(marker_data, manifest_data)
            manifest = fmt.manifest_from_bytes(manifest_data)
        except CheckpointInvalid as error:
            raise _Rejected(Level.QUICK, f"{self.directory}: {error}") from error
        if self.step is not None and manifest.step != self.step:
            raise _Rejected(
                Level.QUICK,
                f"{self.directory / fmt.MANIFEST_NAME} records step {manifest.step} but the "
                f"directory is named for step {self.step}",
            )
        self.manifest = manifest
        self.step = manifest.step

    def read_metadata(self) -> None:
        self.metadata_bytes = self.read_small(fmt.DCP_METADATA_NAME, _METADATA_LIMIT_BYTES)
        where = self.directory / fmt.DCP_METADATA_NAME
        try:
            metadata = _MetadataUnpickler(io.BytesIO(self.metadata_bytes)).load()
        except MemoryError as error:
            # A length field past any checkpoint's (nine bytes can ask for 2**56), or a
            # limit on the validating process: either way it cannot be loaded here.
            raise _Rejected(
                Level.QUICK,
                f"{where} {NEEDS_MORE_MEMORY} (a length in it beyond any checkpoint's, or a "
                "memory limit set too low)",
            ) from error
        # Garbage can make the unpickler raise almost anything (EOFError,
        # ValueError, UnpicklingError, RecursionError...): all mean "corrupt".
        except Exception as error:
            raise _Rejected(
                Level.QUICK, f"{where} does not parse as DCP metadata: {error!r}"
            ) from error
        try:
            self.items = _storage_items(metadata)
        except CheckpointInvalid as error:
            raise _Rejected(Level.QUICK, f"{where} is inconsistent: {error}") from error
        # DCP's classes accept any field values, so a damaged file can hold, say,
        # a string where a torch.Size belongs; whatever that raises means corrupt.
        except Exception as error:
            raise _Rejected(Level.QUICK, f"{where} is inconsistent: {error!r}") from error
        self.metadata = metadata

    def check_manifest_against_directory(self) -> None:
        assert self.manifest is not None
        listed = {entry.path for entry in self.manifest.files}
        on_disk = {
            child.name
            for child in self.directory.iterdir()
            if child.name.endswith(fmt.DCP_DATA_SUFFIX) or child.name == fmt.DCP_METADATA_NAME
        }
        for name in sorted(on_disk - listed):
            raise _Rejected(
                Level.QUICK,
                f"{self.directory / name} is not listed in {fmt.MANIFEST_NAME}: "
                "the manifest and the directory disagree",
            )
        for entry in self.manifest.files:
            size = self.size_of(entry.path, f"listed in {fmt.MANIFEST_NAME}")
            if size != entry.bytes:
                what = "is empty" if size == 0 else f"has {size} bytes"
                raise _Rejected(
                    Level.QUICK,
                    f"{self.directory / entry.path} {what}; {fmt.MANIFEST_NAME} records "
                    f"{entry.bytes}: the file is truncated or was rewritten",
                )
        for item in self.items:
            if item.relative_path not in listed:
                raise _Rejected(
                    Level.QUICK,
                    f"{self.directory / fmt.DCP_METADATA_NAME} stores {item.index.fqn!r} in "
                    f"{item.relative_path}, which {fmt.MANIFEST_NAME} does not list",
                )

    def check_items_fit(self) -> None:
        sizes: dict[str, int] = {}
        for item in self.items:
            if item.relative_path not in sizes:
                sizes[item.relative_path] = self.size_of(
                    item.relative_path, f"referenced by {fmt.DCP_METADATA_NAME}"
                )
            size = sizes[item.relative_path]
            end = item.offset + item.length
            if end > size:
                raise _Rejected(
                    Level.QUICK,
                    f"{self.directory / item.relative_path} has {size} bytes but item "
                    f"{item.index.fqn!r} ends at byte {end}: the file is truncated",
                )

    # Disk access, always inside the checkpoint directory -------------------

    def contained(self, relative: str) -> Path:
        """Resolved path of ``relative``; rejects one that leaves the directory."""
        try:
            fmt.check_relative_path(relative)
        except CheckpointInvalid as error:
            raise _Rejected(Level.QUICK, f"{self.directory}: {error}") from error
        try:
            resolved = (self.root / relative).resolve()
        except RuntimeError as error:  # a symlink loop, on Python 3.11
            raise _Rejected(Level.QUICK, f"{self.directory / relative}: {error}") from error
        if not resolved.is_relative_to(self.root):
            raise _Rejected(
                Level.QUICK,
                f"{self.directory / relative} resolves to {resolved}, outside the "
                "checkpoint directory: refusing to read it",
            )
        return resolved

    def size_of(self, relative: str, why: str) -> int:
        path = self.contained(relative)
        if not path.is_file():
            raise _Rejected(Level.QUICK, f"{self.directory / relative} is missing (it is {why})")
        return path.stat().st_size

    def read_small(self, relative: str, limit_bytes: int) -> bytes:
        path = self.contained(relative)
        if not path.is_file():
            raise _Rejected(Level.QUICK, f"{self.directory / relative} is missing")
        try:
            return files.read_small(path, limit_bytes)
        except (OSError, ValueError) as error:
            raise _Rejected(
                Level.QUICK, f"{self.directory / relative} cannot be read: {error}"
            ) from error

    # FULL and LOAD: one pass over every byte ---------------------------------

    def stream(self, hash_files: bool, load_items: bool) -> None:
        entries = {entry.path: entry for entry in self.manifest.files} if self.manifest else {}
        by_file: dict[str, list[_Item]] = {}
        for item in self.items:
            by_file.setdefault(item.relative_path, []).append(item)
        names = set(by_file) | (set(entries) if hash_files else set())
        load_failure: str | None = None
        for name in sorted(names):
            entry = entries.get(name) if hash_files else None
            items = by_file.get(name, []) if load_items and load_failure is None else []
            if not items and entry is None:
                continue
            if name == fmt.DCP_METADATA_NAME and entry is not None:
                # Already in memory from QUICK: hash those bytes, do not read twice.
                self.compare_checksum(name, entry, fmt.checksum_bytes(self.metadata_bytes))
                continue
            failure = self.stream_file(name, entry, items)
            load_failure = load_failure or failure
            if load_failure is not None and not hash_files:
                break
        if load_failure is not None:
            raise _Rejected(Level.LOAD, load_failure)

    def stream_file(
        self, relative: str, entry: fmt.FileEntry | None, items: list[_Item]
    ) -> str | None:
        """Read ``relative`` once: hash it if ``entry``, deserialize ``items`` as they complete.

        Returns the first LOAD failure (hashing goes on after it); raises for a
        checksum mismatch.
        """
        hasher = fmt.new_hasher() if entry is not None else None
        pending = deque(sorted(items, key=lambda item: (item.offset, item.length)))
        window = bytearray()
        window_start = 0
        failure: str | None = None
        size = 0
        try:
            for chunk in files.iter_chunks(self.contained(relative)):
                size += len(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                if not pending:
                    continue
                window += chunk
                while pending and pending[0].offset + pending[0].length <= size:
                    item = pending.popleft()
                    start = item.offset - window_start
                    failure = self.check_item(item, bytes(window[start : start + item.length]))
                    if failure is not None:
                        pending.clear()
                # Keep only bytes some pending item still needs.
                keep_from = pending[0].offset if pending else size
                if keep_from > window_start:
                    del window[: keep_from - window_start]
                    window_start = keep_from
        except OSError as error:
            raise _Rejected(
                Level.QUICK, f"{self.directory / relative} cannot be read: {error}"
            ) from error
        if entry is not None and hasher is not None:
            if size != entry.bytes:
                raise _Rejected(
                    Level.QUICK,
                    f"{self.directory / relative} changed size during validation "
                    f"({size} bytes, {fmt.MANIFEST_NAME} records {entry.bytes})",
                )
            self.compare_checksum(relative, entry, fmt.format_checksum(hasher))
        if failure is None and pending:
            failure = (
                f"{self.directory / relative} ended at byte {size} before item "
                f"{pending[0].index.fqn!r}: it shrank during validation"
            )
        return failure

    def compare_checksum(self, relative: str, entry: fmt.FileEntry, actual: str) -> None:
        if actual != entry.checksum:
            raise _Rejected(
                Level.FULL,
                f"{self.directory / relative} has checksum {actual}, {fmt.MANIFEST_NAME} "
                f"records {entry.checksum}: its bytes changed after the save",
            )

    def check_item(self, item: _Item, data: bytes) -> str | None:
        """Deserialize one storage item as DCP would; the failure sentence, or None."""
        assert self.metadata is not None
        where = (
            f"{self.directory / item.relative_path}: item {item.index.fqn!r} "
            f"(bytes {item.offset}..{item.offset + item.length})"
        )
        try:
            stream = _undo_transforms(io.BytesIO(data), item.transforms)
            described = self.metadata.state_dict_metadata[item.index.fqn]
            if isinstance(described, dcp_metadata.BytesStorageMetadata):
                return self.check_object(where, item, stream)
            return _check_tensor(where, item, described, stream)
        # torch.load and the zip reader raise many types on damaged bytes; any
        # of them means this item would not load.
        except Exception as error:
            return f"{where} does not deserialize: {error!r}"

    def check_object(self, where: str, item: _Item, stream: io.BytesIO) -> str | None:
        # DCP writes non-tensor values with torch.save and loads them with
        # weights_only=False. Plain containers and numbers pass weights_only; an
        # object referencing other classes is unpickled only when the caller
        # trusts the checkpoint, since unpickling it runs the checkpoint's code.
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
        stream.seek(0)
        if unsafe and not self.trust:
            self.unpickled_refused.append(item.index.fqn)
            return None
        torch.load(stream, map_location="cpu", weights_only=not unsafe)
        return None


def _check_tensor(
    where: str,
    item: _Item,
    described: dcp_metadata.TensorStorageMetadata,
    stream: io.BytesIO,
) -> str | None:
    # FileSystemWriter writes each tensor item with torch.save(tensor) and
    # FileSystemReader reads it back with torch.load(weights_only=True).
    tensor = torch.load(stream, map_location="cpu", weights_only=True)
    if not isinstance(tensor, torch.Tensor):
        return f"{where} holds a {type(tensor).__name__}, not a tensor"
    chunk = next((chunk for chunk in described.chunks if chunk.offsets == item.index.offset), None)
    if chunk is not None and tuple(tensor.shape) != tuple(chunk.sizes):
        return f"{where} has shape {tuple(tensor.shape)}; the metadata says {tuple(chunk.sizes)}"
    if tensor.dtype != described.properties.dtype:
        return f"{where} has dtype {tensor.dtype}; the metadata says {described.properties.dtype}"
    if (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel():
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad = int(finite.numel() - finite.sum())
            return f"{where} holds {bad} NaN or Inf value(s) of {tensor.numel()}"
    return None


def _undo_transforms(stream: io.BytesIO, descriptors: tuple[str, ...]) -> io.BytesIO:
    """Reverse DCP's stream transforms (e.g. zstd) the way FileSystemReader does."""
    if not descriptors:
        return stream
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry,
        StreamTransformExtension,
    )

    raw: Any = stream
    for extension in ExtensionRegistry().from_descriptor_list(descriptors):
        if isinstance(extension, StreamTransformExtension):
            raw = extension.transform_from(raw)
    return io.BytesIO(raw.read())


def _storage_items(metadata: Any) -> list[_Item]:
    """Check the shape of unpickled DCP metadata; return its storage items."""
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointInvalid(f"it holds a {type(metadata).__name__}, not DCP Metadata")
    described = metadata.state_dict_metadata
    storage = metadata.storage_data
    if not isinstance(described, dict) or not isinstance(storage, dict):
        raise CheckpointInvalid("state_dict_metadata or storage_data is not a mapping")
    items = []
    for index, info in storage.items():
        if not isinstance(index, dcp_metadata.MetadataIndex) or not isinstance(info, _StorageInfo):
            raise CheckpointInvalid(f"storage entry {index!r} has the wrong type")
        if index.fqn not in described:
            raise CheckpointInvalid(f"stored item {index.fqn!r} is not described")
        for name, value in (("offset", info.offset), ("length", info.length)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CheckpointInvalid(f"item {index.fqn!r} has {name} {value!r}")
        if not isinstance(info.relative_path, str):
            raise CheckpointInvalid(f"item {index.fqn!r} has no file name")
        items.append(
            _Item(
                index=index,
                relative_path=info.relative_path,
                offset=info.offset,
                length=info.length,
                transforms=tuple(info.transform_descriptors or ()),
            )
        )
    for fqn, entry in described.items():
        if isinstance(entry, dcp_metadata.TensorStorageMetadata):
            wanted = [dcp_metadata.MetadataIndex(fqn, chunk.offsets) for chunk in entry.chunks]
        elif isinstance(entry, dcp_metadata.BytesStorageMetadata):
            wanted = [dcp_metadata.MetadataIndex(fqn)]
        else:
            raise CheckpointInvalid(f"{fqn!r} is described by a {type(entry).__name__}")
        # A tensor with zero elements has a chunk but DCP may store nothing to read.
        if any(index not in storage for index in wanted) and not _is_empty_tensor(entry):
            raise CheckpointInvalid(f"{fqn!r} has a chunk with no stored bytes")
    return items


def _is_empty_tensor(entry: Any) -> bool:
    return isinstance(entry, dcp_metadata.TensorStorageMetadata) and math.prod(entry.size) == 0


# The classes a DCP .metadata pickle references (checked against real
# FileSystemWriter output, torch 2.13). Anything else is refused, so a crafted
# .metadata cannot run code in the process that validates it.
_METADATA_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in dcp_metadata.__all__}
    | {
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
    }
)


def _enum_member(cls: Any, name: Any) -> Any:
    """``getattr(EnumClass, "NAME")`` for an enum member, and nothing else.

    Python 3.11 before 3.11.4 (Debian 12's 3.11.2, for one) pickles an enum
    member as a call of ``builtins.getattr`` on its class; DCP metadata holds
    one (``_MEM_FORMAT_ENCODING``). A general getattr would reach any
    attribute of an allowed class, and from there code: only a member of an
    enum the metadata may reference is given.
    """
    if (
        isinstance(cls, type)
        and issubclass(cls, enum.Enum)
        and isinstance(name, str)
        and name in cls.__members__
    ):
        return cls[name]
    raise pickle.UnpicklingError(
        f"it asks for attribute {name!r} of {cls!r}, which is not an enum member DCP metadata holds"
    )


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata, refusing every class DCP metadata never holds."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if module == "torch":
            value = getattr(torch, name, None)
            if name == "Size" or isinstance(
                value, (torch.dtype, torch.layout, torch.memory_format)
            ):
                return value
        raise pickle.UnpicklingError(
            f"it references {module}.{name}, which DCP metadata never holds"
        )
