"""Checkpoint manifests and DCP metadata, fuzzed: a report, never an escape, a hang or a bomb.

The supervisor validates checkpoints that any job's user wrote, with rights
to read every user's files. So the manifest and the pickled DCP ``.metadata``
are hostile input: whatever paths, offsets, lengths and pickled classes they
hold, :func:`validate` returns a :class:`Report`, opens no file outside the
checkpoint directory (an audit hook records every ``open``), never runs a
class the metadata has no business holding, never blocks on a FIFO, and
never allocates beyond the files it reads. The manifest and the commit
marker round-trip exactly.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import sys
import tempfile
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.filesystem import _StorageInfo

from agent.checkpoint import files
from agent.checkpoint import format as fmt
from agent.checkpoint.validate import Level, Report, validate
from agent.wire.errors import CheckpointInvalid
from tests.ckpt_helpers import make_committed_checkpoint, save_plain_dcp, small_state

FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
LEVELS = st.sampled_from(list(Level))
SECRET = b"another user's data, never to be read"

# -- every open() of the process while a test records -------------------------------------

_opened: list[str] | None = None
_hook_installed = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], str | bytes | Path):
        _opened.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def recording_opens() -> Iterator[list[str]]:
    """Every path opened (``open``, ``os.open``) inside the block."""
    global _opened, _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)  # cannot be removed; idle unless a block records
        _hook_installed = True
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


@pytest.fixture(scope="module")
def committed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_committed_checkpoint(tmp_path_factory.mktemp("committed"), 5)


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_plain_dcp(tmp_path_factory.mktemp("plain") / "step-5", small_state(5))


@contextlib.contextmanager
def sandbox(checkpoint: Path) -> Iterator[tuple[Path, Path]]:
    """A copy of ``checkpoint`` next to a file it must never read: (checkpoint, secret)."""
    root = Path(tempfile.mkdtemp(prefix="ckpt-"))
    try:
        secret = root / "secret.bin"
        secret.write_bytes(SECRET)
        copy = root / "ckpts" / checkpoint.name
        shutil.copytree(checkpoint, copy, symlinks=True)
        yield copy, secret
    finally:
        shutil.rmtree(root, ignore_errors=True)


def validated(directory: Path, level: Level, never: Path) -> Report:
    """``validate`` under the audit hook; fails the test if it opened ``never``."""
    with recording_opens() as opened:
        report = validate(directory, level)
    touched = [path for path in opened if Path(path).name == never.name]
    assert not touched, f"validation opened {touched}"
    assert isinstance(report, Report)
    assert report.valid == (report.reason is None)
    return report


def remark(directory: Path, document: dict[str, Any]) -> None:
    """Write ``document`` as the manifest and commit it with a matching marker."""
    data = (json.dumps(document, sort_keys=True, indent=1) + "\n").encode()
    (directory / fmt.MANIFEST_NAME).write_bytes(data)
    (directory / fmt.MARKER_NAME).write_bytes(fmt.marker_bytes(data))


# -- hostile paths --------------------------------------------------------------------------


def hostile_paths(secret: Path) -> st.SearchStrategy[str]:
    """Paths a manifest or DCP metadata could name to reach ``secret`` (or break the reader)."""
    return st.sampled_from(
        [
            "../secret.bin",
            "../../secret.bin",
            "./../secret.bin",
            "a/../../secret.bin",
            str(secret),
            "/" + str(secret).lstrip("/"),
            "link/secret.bin",  # through a symlink to the directory above
            "escape",  # a symlink to the secret
            "loop",  # a symlink loop
            "fifo",  # a FIFO: a reader would block forever
            "..",
            ".",
            "",
            "a//b",
            "a\\..\\..\\secret.bin",
            "nul\x00.distcp",
            "\ud800.distcp",
            "x" * 5000,
            "/".join(["d"] * 2000),
        ]
    ) | st.text(alphabet="./\\ab\x00", max_size=12)


def plant_traps(directory: Path, secret: Path) -> None:
    """Symlinks and a FIFO inside the checkpoint directory, for the hostile paths to use."""
    # Names DCP does not use, so the manifest check does not refuse them unread.
    (directory / "link").symlink_to(secret.parent)
    (directory / "escape").symlink_to(secret)
    (directory / "loop").symlink_to(directory / "loop")
    os.mkfifo(directory / "fifo")


@FUZZ
@given(data=st.data(), level=LEVELS)
def test_a_manifest_naming_any_path_never_makes_validation_read_outside(
    committed: Path, data: st.DataObject, level: Level
) -> None:
    with sandbox(committed) as (directory, secret):
        plant_traps(directory, secret)
        document = json.loads((directory / fmt.MANIFEST_NAME).read_bytes())
        path = data.draw(hostile_paths(secret))
        listed = {"path": path, "bytes": len(SECRET), "checksum": fmt.checksum_bytes(SECRET)}
        if data.draw(st.booleans(), label="replace a listed file"):
            document["files"][0] = listed
        else:
            document["files"].append(listed)
        remark(directory, document)
        report = validated(directory, level, never=secret)
    assert not report.valid
    assert report.failed_level is Level.QUICK


@FUZZ
@given(
    data=st.data(),
    level=LEVELS,
    offset=st.integers(0, 1 << 62) | st.integers(0, 4096),
    length=st.integers(0, 1 << 62) | st.integers(0, 4096),
)
def test_dcp_metadata_naming_any_file_and_range_never_escapes_or_over_allocates(
    plain: Path, data: st.DataObject, level: Level, offset: int, length: int
) -> None:
    with sandbox(plain) as (directory, secret):
        plant_traps(directory, secret)
        metadata = pickle.loads((directory / fmt.DCP_METADATA_NAME).read_bytes())
        index = data.draw(st.sampled_from(sorted(metadata.storage_data, key=repr)))
        info = metadata.storage_data[index]
        relative = info.relative_path
        if data.draw(st.booleans(), label="hostile file"):
            relative = data.draw(hostile_paths(secret))
        metadata.storage_data[index] = _StorageInfo(relative, offset, length)
        (directory / fmt.DCP_METADATA_NAME).write_bytes(pickle.dumps(metadata))
        sizes = sum(path.stat().st_size for path in directory.glob("*.distcp"))
        tracemalloc.start()
        try:
            report = validated(directory, level, never=secret)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert peak < 64 * (1 << 20) + 4 * sizes, f"{peak} bytes allocated"
    if relative != info.relative_path:
        assert not report.valid


@FUZZ
@given(data=st.data(), level=LEVELS)
def test_damaged_dcp_metadata_bytes_give_a_report_never_an_exception(
    plain: Path, data: st.DataObject, level: Level
) -> None:
    with sandbox(plain) as (directory, secret):
        path = directory / fmt.DCP_METADATA_NAME
        raw = bytearray(path.read_bytes())
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(raw) - 1))
            kind = data.draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
            if kind == "flip":
                raw[at] ^= data.draw(st.integers(1, 255))
            elif kind == "cut":
                del raw[at:]
            elif kind == "insert":
                raw[at:at] = data.draw(st.binary(min_size=1, max_size=32))
            else:
                del raw[at : at + data.draw(st.integers(1, 32))]
            if not raw:
                break
        path.write_bytes(bytes(raw))
        validated(directory, level, never=secret)


# -- classes the metadata must never hold -------------------------------------------------

ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "collections", "pathlib")
DANGEROUS = [
    ("os", "system"),
    ("posix", "system"),
    ("builtins", "open"),
    ("builtins", "exec"),
    ("builtins", "eval"),
    ("builtins", "getattr"),
    ("builtins", "__import__"),
    ("subprocess", "call"),
    ("shutil", "copyfile"),
    ("torch", "load"),
    ("torch", "save"),
    ("torch.serialization", "load"),
    ("pathlib", "Path"),
    ("collections", "namedtuple"),
    ("numpy", "load"),
    ("pickle", "loads"),
]


def calling(module: str, name: str, argument: str) -> bytes:
    """A protocol-2 pickle that calls ``module.name(argument)`` when loaded."""
    return (
        b"\x80\x02c"
        + f"{module}\n{name}\n".encode()
        + b"X"
        + len(argument.encode()).to_bytes(4, "little")
        + argument.encode()
        + b"\x85R."
    )


@FUZZ
@given(
    target=st.sampled_from(DANGEROUS)
    | st.tuples(
        st.from_regex(r"[a-z_][a-z0-9_.]{0,20}", fullmatch=True),
        st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,20}", fullmatch=True),
    ).filter(lambda pair: not pair[0].startswith(ALLOWED_MODULES) and pair[0] != "torch"),
    level=LEVELS,
)
def test_metadata_calling_anything_outside_dcps_classes_is_refused_without_running_it(
    plain: Path, target: tuple[str, str], level: Level
) -> None:
    module, name = target
    with sandbox(plain) as (directory, secret):
        canary = directory.parent / "canary"
        argument = f"touch {canary}" if name == "system" else str(canary)
        (directory / fmt.DCP_METADATA_NAME).write_bytes(calling(module, name, argument))
        report = validated(directory, level, never=secret)
        assert not canary.exists(), f"{module}.{name} ran"
    assert not report.valid and report.failed_level is Level.QUICK
    assert report.reason is not None and ".metadata" in report.reason


# -- files that are not files ----------------------------------------------------------------


@pytest.mark.parametrize("name", [fmt.DCP_METADATA_NAME, fmt.MANIFEST_NAME, "__0_0.distcp"])
def test_a_fifo_in_place_of_a_checkpoint_file_never_blocks_validation(
    committed: Path, name: str
) -> None:
    with sandbox(committed) as (directory, secret):
        (directory / name).unlink()
        os.mkfifo(directory / name)
        reports: list[Report] = []
        worker = threading.Thread(
            target=lambda: reports.append(validated(directory, Level.LOAD, never=secret)),
            daemon=True,
        )
        worker.start()
        worker.join(30)
        if worker.is_alive():
            # Unblock the reader so the thread ends, then fail.
            with open(directory / name, "wb"):
                pass
            pytest.fail(f"validation blocked on a FIFO named {name}")
    assert reports and not reports[0].valid


def test_the_file_readers_refuse_a_fifo_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        files.read_small(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        next(files.iter_chunks(fifo))


# -- the manifest and the marker ------------------------------------------------------------

SAFE_NAMES = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,15}", fullmatch=True).filter(
    lambda name: name not in (".", "..")
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), 1 << 63)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
MANIFESTS = st.builds(
    fmt.Manifest,
    step=st.integers(0, 1 << 62),
    world_size=st.integers(1, 1 << 20),
    contents=st.lists(st.sampled_from(list(fmt.StateKind)), unique=True).map(tuple),
    files=st.lists(
        st.builds(
            fmt.FileEntry,
            path=st.lists(SAFE_NAMES, min_size=1, max_size=3).map("/".join),
            bytes=st.integers(0, 1 << 50),
            checksum=st.binary(min_size=1, max_size=64).map(fmt.checksum_bytes),
        ),
        max_size=8,
        unique_by=lambda entry: entry.path,
    ).map(tuple),
    created_unix_s=st.floats(0, 1e10),
    stats=st.none()
    | st.builds(
        fmt.SaveStats,
        stall_s=st.floats(0, 1e6),
        write_s=st.floats(0, 1e6),
        total_bytes=st.integers(0, 1 << 50),
        filesystem=st.text(max_size=10),
        mode=st.sampled_from(["async", "sync"]),
    ),
    user=st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=4),
)


@FUZZ
@given(manifest=MANIFESTS)
def test_a_manifest_round_trips_through_its_bytes(manifest: fmt.Manifest) -> None:
    data = fmt.manifest_to_bytes(manifest)
    again = fmt.manifest_from_bytes(data)
    assert again == manifest
    assert fmt.manifest_to_bytes(again) == data


@FUZZ
@given(manifest=MANIFESTS, data=st.data())
def test_the_marker_commits_exactly_the_manifest_it_was_written_for(
    manifest: fmt.Manifest, data: st.DataObject
) -> None:
    manifest_data = fmt.manifest_to_bytes(manifest)
    marker = fmt.marker_bytes(manifest_data)
    fmt.check_marker(marker, manifest_data)
    which = data.draw(st.sampled_from(["marker", "manifest"]))
    target = bytearray(marker if which == "marker" else manifest_data)
    at = data.draw(st.integers(0, len(target) - 1))
    target[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CheckpointInvalid):
        if which == "marker":
            fmt.check_marker(bytes(target), manifest_data)
        else:
            fmt.check_marker(marker, bytes(target))


@FUZZ
@given(data=st.data())
def test_a_manifest_with_any_field_replaced_parses_or_raises_checkpoint_invalid(
    data: st.DataObject,
) -> None:
    document = json.loads(fmt.manifest_to_bytes(data.draw(MANIFESTS)))
    targets: list[tuple[Any, Any]] = [(document, key) for key in document]
    for entry in document["files"]:
        targets += [(entry, key) for key in entry]
    if document["stats"] is not None:
        targets += [(document["stats"], key) for key in document["stats"]]
    for _ in range(data.draw(st.integers(1, 3))):
        container, key = data.draw(st.sampled_from(targets))
        if data.draw(st.booleans()):
            container[key] = data.draw(JSON_VALUES | st.floats())
        else:
            container.pop(key, None)
    try:
        manifest = fmt.manifest_from_bytes(json.dumps(document).encode())
    except CheckpointInvalid:
        return
    assert manifest.step >= 0 and manifest.world_size >= 1
    for entry in manifest.files:
        assert fmt.check_relative_path(entry.path) == entry.path
        assert isinstance(entry.bytes, int) and entry.bytes >= 0


@FUZZ
@given(path=st.text(max_size=20) | st.text(alphabet="./\\a\x00\ud800\udcff", max_size=12))
def test_a_checked_relative_path_stays_inside_any_directory(path: str) -> None:
    try:
        checked = fmt.check_relative_path(path)
    except CheckpointInvalid:
        return
    root = PurePosixPath("/ckpt/step-1")
    joined = PurePosixPath(os.path.normpath(root / checked))
    assert joined.is_relative_to(root) and joined != root
    checked.encode("utf-8", "surrogateescape")  # a name the filesystem can take


def test_loaded_items_never_need_more_than_their_stored_bytes(plain: Path) -> None:
    # The LOAD level reads each item whole: bounded by the file, which QUICK bounded.
    with sandbox(plain) as (directory, secret):
        tracemalloc.start()
        try:
            report = validated(directory, Level.LOAD, never=secret)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert report.valid, report.reason
    sizes = sum(path.stat().st_size for path in plain.glob("*.distcp"))
    assert peak < 64 * (1 << 20) + 4 * sizes


def test_one_item_of_the_recorded_checkpoint_reads_back_through_the_bounded_reader(
    plain: Path,
) -> None:
    path = next(plain.glob("*.distcp"))
    assert files.read_small(path) == path.read_bytes()
    assert b"".join(files.iter_chunks(path, chunk_bytes=7)) == path.read_bytes()
