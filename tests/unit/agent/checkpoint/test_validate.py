"""The validation ladder against real DCP checkpoints, corrupted one way at a time."""

from __future__ import annotations

import contextlib
import enum
import io
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.checkpoint import files
from agent.checkpoint import format as fmt
from agent.checkpoint.catalog import newest_valid
from agent.checkpoint.validate import NEEDS_MORE_MEMORY, PLAIN_DCP_NOTE, Level, Report, validate
from agent.wire.errors import CheckpointInvalid
from tests.ckpt_helpers import (
    data_files,
    make_committed_checkpoint,
    save_plain_dcp,
    small_state,
    tensor_payload_offset,
    write_manifest_and_marker,
)

LADDER = (Level.QUICK, Level.FULL, Level.LOAD)


def _flip_byte(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _remove_marker(directory: Path) -> None:
    (directory / fmt.MARKER_NAME).unlink()


def _remove_manifest(directory: Path) -> None:
    (directory / fmt.MANIFEST_NAME).unlink()


def _remove_shard(directory: Path) -> None:
    data_files(directory)[-1].unlink()


def _truncate_shard(directory: Path) -> None:
    shard = data_files(directory)[0]
    os.truncate(shard, shard.stat().st_size - 100)


def _empty_shard(directory: Path) -> None:
    os.truncate(data_files(directory)[0], 0)


def _flip_tensor_payload(directory: Path) -> None:
    path, offset = tensor_payload_offset(directory, "model.w")
    _flip_byte(path, offset + 17)


def _garble_metadata_same_size(directory: Path) -> None:
    # Same byte count, so only the parse can see it (not the size check).
    metadata = directory / fmt.DCP_METADATA_NAME
    size = metadata.stat().st_size
    metadata.write_bytes((bytes(range(256)) * (size // 256 + 1))[:size])


def _extra_unlisted_shard(directory: Path) -> None:
    shutil.copy(data_files(directory)[0], directory / "__7_0.distcp")


def _manifest_edited_after_commit(directory: Path) -> None:
    manifest = directory / fmt.MANIFEST_NAME
    manifest.write_bytes(manifest.read_bytes().replace(b'"world_size": 1', b'"world_size": 2'))


def _leftover_metadata_tmp(directory: Path) -> None:
    (directory / fmt.DCP_METADATA_TMP_NAME).write_bytes(b"partial")


def _shard_is_symlink_outside(directory: Path) -> None:
    shard = data_files(directory)[0]
    outside = directory.parent / "outside.bin"
    shard.rename(outside)
    shard.symlink_to(outside)


def _manifest_names_another_step(directory: Path) -> None:
    for name in (fmt.MANIFEST_NAME, fmt.MARKER_NAME):
        (directory / name).unlink()
    write_manifest_and_marker(directory, step=99)


def _metadata_pickle_runs_code(directory: Path) -> None:
    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.mkdir, (str(directory.parent / "pwned"),))

    (directory / fmt.DCP_METADATA_NAME).write_bytes(pickle.dumps(Exploit()))
    for name in (fmt.MANIFEST_NAME, fmt.MARKER_NAME):
        (directory / name).unlink()
    write_manifest_and_marker(directory, step=2)


CORRUPTIONS: list[tuple[str, Callable[[Path], None], Level]] = [
    ("no commit marker", _remove_marker, Level.QUICK),
    ("marker but no manifest", _remove_manifest, Level.QUICK),
    ("a missing shard", _remove_shard, Level.QUICK),
    ("a truncated shard", _truncate_shard, Level.QUICK),
    ("a zero-length shard", _empty_shard, Level.QUICK),
    ("one flipped byte inside a tensor payload", _flip_tensor_payload, Level.FULL),
    ("garbage .metadata of the recorded size", _garble_metadata_same_size, Level.QUICK),
    ("a data file the manifest does not list", _extra_unlisted_shard, Level.QUICK),
    ("a manifest edited after the commit", _manifest_edited_after_commit, Level.QUICK),
    ("a leftover .metadata.tmp", _leftover_metadata_tmp, Level.QUICK),
    ("a shard that is a symlink outside the directory", _shard_is_symlink_outside, Level.QUICK),
    ("a manifest naming another step", _manifest_names_another_step, Level.QUICK),
    ("a .metadata pickle that would run code", _metadata_pickle_runs_code, Level.QUICK),
]


@pytest.mark.parametrize(
    ("corrupt", "expected"),
    [pytest.param(corrupt, expected, id=name) for name, corrupt, expected in CORRUPTIONS],
)
def test_each_corruption_is_rejected_at_the_cheapest_level_and_newest_valid_falls_back(
    tmp_path: Path, corrupt: Callable[[Path], None], expected: Level
) -> None:
    previous = make_committed_checkpoint(tmp_path, 1)
    broken = make_committed_checkpoint(tmp_path, 2)
    corrupt(broken)

    deepest = validate(broken, Level.LOAD)
    assert not deepest.valid
    assert deepest.failed_level is expected
    assert deepest.reason and str(broken) in deepest.reason
    for cheaper in LADDER[: LADDER.index(expected)]:
        assert validate(broken, cheaper).valid, f"{cheaper} should not see it"
    assert validate(broken, expected).failed_level is expected

    found, rejected = newest_valid(tmp_path, Level.LOAD)
    assert found is not None and found.path == str(previous)
    assert [report.path for report in rejected] == [str(broken)]
    assert rejected[0].failed_level is expected
    assert not (tmp_path / "pwned").exists()


def test_committed_checkpoint_is_valid_at_every_level(tmp_path: Path) -> None:
    directory = make_committed_checkpoint(tmp_path, 5)
    for level in LADDER:
        report = validate(directory, level)
        assert report.valid, report.reason
        assert report.checked == LADDER[: LADDER.index(level) + 1]
        assert report.step == 5 and report.has_manifest and report.skipped == ()
        assert report.manifest is not None and report.manifest.step == 5


def test_nan_saved_into_a_committed_checkpoint_is_rejected_only_at_load(
    tmp_path: Path,
) -> None:
    state = small_state(3)
    state["model"]["w"][2, 3] = float("inf")
    directory = make_committed_checkpoint(tmp_path, 3, state)
    assert validate(directory, Level.FULL).valid
    report = validate(directory, Level.LOAD)
    assert report.failed_level is Level.LOAD
    assert report.reason is not None and "'model.w'" in report.reason
    assert "NaN or Inf" in report.reason


def test_plain_dcp_directory_gets_quick_and_load_and_says_checksums_were_skipped(
    tmp_path: Path,
) -> None:
    directory = save_plain_dcp(tmp_path / "step-4", small_state(4))
    full = validate(directory, Level.FULL)
    assert full.valid and not full.has_manifest
    assert full.checked == (Level.QUICK,)
    assert full.skipped == (PLAIN_DCP_NOTE,)
    load = validate(directory, Level.LOAD)
    assert load.valid and load.checked == (Level.QUICK, Level.LOAD)


def test_plain_dcp_flip_is_seen_only_when_it_breaks_a_value(tmp_path: Path) -> None:
    """Without a manifest there are no checksums, and torch's zip reader checks no
    CRC: a flipped bit inside a float payload just changes that float, and LOAD
    passes. LOAD catches the flip only when it yields NaN/Inf (or breaks the
    deserializer). This is why Resurgo writes a manifest."""
    directory = save_plain_dcp(tmp_path / "step-4", small_state(4))
    path, offset = tensor_payload_offset(directory, "model.w")
    _flip_byte(path, offset + 4)  # lowest mantissa byte of element 1: a tiny change
    assert validate(directory, Level.LOAD).valid
    # Overwrite element 1 with a float32 NaN (little-endian 0x7FC00000).
    data = bytearray(path.read_bytes())
    data[offset + 4 : offset + 8] = bytes([0x00, 0x00, 0xC0, 0x7F])
    path.write_bytes(bytes(data))
    report = validate(directory, Level.LOAD)
    assert report.failed_level is Level.LOAD
    assert report.reason is not None and "NaN or Inf" in report.reason


def test_plain_dcp_truncated_shard_is_rejected_at_quick(tmp_path: Path) -> None:
    directory = save_plain_dcp(tmp_path / "step-4", small_state(4))
    _truncate_shard(directory)
    assert validate(directory, Level.QUICK).failed_level is Level.QUICK


def test_manifest_without_marker_is_an_interrupted_save_not_plain_dcp(tmp_path: Path) -> None:
    directory = make_committed_checkpoint(tmp_path, 6)
    _remove_marker(directory)
    report = validate(directory, Level.QUICK)
    assert not report.valid and report.has_manifest
    assert report.reason is not None and "interrupted" in report.reason


def test_load_reads_every_data_byte_exactly_once_even_with_tiny_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = make_committed_checkpoint(tmp_path, 7)
    read: dict[str, int] = {}
    real_iter_chunks = files.iter_chunks

    def counting(path: Path, chunk_bytes: int = fmt.CHUNK_BYTES) -> Iterator[bytes]:
        # 97-byte chunks: items straddle many chunk boundaries.
        for chunk in real_iter_chunks(path, 97):
            read[path.name] = read.get(path.name, 0) + len(chunk)
            yield chunk

    monkeypatch.setattr(files, "iter_chunks", counting)
    assert validate(directory, Level.LOAD).valid
    assert read == {shard.name: shard.stat().st_size for shard in data_files(directory)}


def test_numpy_object_item_is_not_unpickled_unless_trusted(tmp_path: Path) -> None:
    state = small_state(8)
    state["numpy_rng"] = {**np.random.default_rng(0).bit_generator.state, "arr": np.zeros(2)}
    directory = make_committed_checkpoint(tmp_path, 8, state)
    cautious = validate(directory, Level.LOAD)
    assert cautious.valid
    assert any("'numpy_rng.arr'" in note for note in cautious.skipped)
    trusted = validate(directory, Level.LOAD, trust_pickled_objects=True)
    assert trusted.valid and trusted.skipped == ()


def test_missing_directory_is_an_invalid_report_not_an_exception(tmp_path: Path) -> None:
    report = validate(tmp_path / "step-1")
    assert not report.valid and report.failed_level is Level.QUICK
    assert report.step == 1


def test_level_must_be_a_level(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        validate(tmp_path, "full")  # type: ignore[arg-type]


def test_report_json_has_stable_keys_and_enum_values(tmp_path: Path) -> None:
    report = validate(make_committed_checkpoint(tmp_path, 9), Level.FULL)
    document = report.to_json_dict()
    assert list(document) == [
        "path", "valid", "level", "checked", "failed_level", "reason", "step",
        "has_manifest", "skipped",
    ]  # fmt: skip
    assert document["level"] == "full" and document["checked"] == ["quick", "full"]
    assert json.loads(json.dumps(document)) == document


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
_MANIFEST_KEYS = st.sampled_from(
    [
        "format_version",
        "checksum_algorithm",
        "files",
        "step",
        "world_size",
        "contents",
        "created_unix_s",
        "stats",
        "user",
    ]
)


@given(st.binary(max_size=512))
def test_manifest_from_bytes_raises_only_checkpoint_invalid_on_arbitrary_bytes(
    data: bytes,
) -> None:
    with contextlib.suppress(CheckpointInvalid):
        fmt.manifest_from_bytes(data)


@given(st.dictionaries(_MANIFEST_KEYS, _JSON) | _JSON)
def test_manifest_from_bytes_raises_only_checkpoint_invalid_on_arbitrary_json(
    document: object,
) -> None:
    base = {"format_version": 1, "checksum_algorithm": fmt.CHECKSUM_ALGORITHM}
    data = json.dumps({**base, **document} if isinstance(document, dict) else document)
    with contextlib.suppress(CheckpointInvalid):
        fmt.manifest_from_bytes(data.encode())


def test_manifest_from_bytes_rejects_huge_and_deeply_nested_numbers() -> None:
    for data in (
        b"1" * 5000,
        b"[" * 100_000,
        b'{"format_version": 1, "checksum_algorithm": '
        b'"xxh3_128", "files": [], "step": 1, "world_size": 1, "contents": [], '
        b'"created_unix_s": 1' + b"0" * 400 + b"}",
    ):
        with pytest.raises(CheckpointInvalid):
            fmt.manifest_from_bytes(data)


_NAMES = st.sampled_from(
    [
        fmt.MANIFEST_NAME,
        fmt.MARKER_NAME,
        fmt.DCP_METADATA_NAME,
        "__0_0.distcp",
        "__1_0.distcp",
        fmt.DCP_METADATA_TMP_NAME,
        "other",
    ]
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(_NAMES, st.binary(max_size=256), max_size=6), st.sampled_from(LADDER))
def test_validate_never_raises_on_a_directory_of_random_files(
    tmp_path: Path, contents: dict[str, bytes], level: Level
) -> None:
    directory = tmp_path / "step-3"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir()
    for name, data in contents.items():
        (directory / name).write_bytes(data)
    report = validate(directory, level)
    assert isinstance(report, Report)
    if fmt.DCP_METADATA_NAME not in contents:
        assert not report.valid


def test_metadata_whose_length_field_asks_for_petabytes_is_invalid_not_a_crash(
    tmp_path: Path,
) -> None:
    """Nine bytes (a pickle BYTEARRAY8 of 2**56 bytes) found by the random-files test: the
    unpickler's MemoryError is the file's verdict, not an exception out of validate."""
    directory = save_plain_dcp(tmp_path / "step-1", {"t": torch.ones(3)})
    (directory / fmt.DCP_METADATA_NAME).write_bytes(b"\x96\x00\x00\x00\x00\x00\x00\x00\x01")
    report = validate(directory, Level.QUICK)
    assert report.failed_level is Level.QUICK
    assert report.reason is not None and NEEDS_MORE_MEMORY in report.reason


def test_random_pickled_garbage_in_metadata_is_invalid_at_quick(tmp_path: Path) -> None:
    directory = save_plain_dcp(tmp_path / "step-1", {"t": torch.ones(3)})
    for payload in (pickle.dumps({"not": "metadata"}), pickle.dumps(torch.ones(2)), b"\x80\x05"):
        (directory / fmt.DCP_METADATA_NAME).write_bytes(payload)
        report = validate(directory, Level.QUICK)
        assert report.failed_level is Level.QUICK
        assert report.reason is not None and ".metadata" in report.reason


def test_metadata_of_dcp_classes_with_garbage_fields_is_invalid_at_quick(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    directory = save_plain_dcp(tmp_path / "step-1", {"t": torch.ones(3)})
    garbage = [
        Metadata(
            state_dict_metadata={"t": TensorStorageMetadata(TensorProperties(), "x", [1])},
            storage_data={},
        ),
        Metadata(
            state_dict_metadata={
                "t": TensorStorageMetadata(
                    TensorProperties(), torch.Size([3]), [ChunkStorageMetadata("a", "b")]
                )
            },
            storage_data={MetadataIndex("t", [0]): _StorageInfo("__0_0.distcp", -1, 5)},
        ),
        Metadata(state_dict_metadata={}, storage_data={"t": _StorageInfo("../x", 0, 1)}),
    ]
    for metadata in garbage:
        (directory / fmt.DCP_METADATA_NAME).write_bytes(pickle.dumps(metadata))
        report = validate(directory, Level.LOAD)
        assert report.failed_level is Level.QUICK, report
        assert report.reason is not None and "inconsistent" in report.reason


class _EnumsByGetattr(pickle.Pickler):
    """Pickles enum members as Python 3.11.0-3.11.3 do: ``getattr(EnumClass, "NAME")``."""

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, enum.Enum):
            return getattr, (type(obj), obj.name)
        return NotImplemented


def _repickle_enums_by_getattr(directory: Path) -> bytes:
    path = directory / fmt.DCP_METADATA_NAME
    metadata = pickle.loads(path.read_bytes())  # our own file, just written by torch
    buffer = io.BytesIO()
    _EnumsByGetattr(buffer).dump(metadata)
    return buffer.getvalue()


def test_metadata_pickled_by_python_3_11_2_with_enum_members_by_getattr_is_valid(
    tmp_path: Path,
) -> None:
    """Debian 12's Python writes ``builtins.getattr`` for DCP's memory-format enum: a
    user's every checkpoint was refused at full validation."""
    directory = save_plain_dcp(tmp_path / "step-1", {"t": torch.ones(3), "u": torch.zeros(2)})
    payload = _repickle_enums_by_getattr(directory)
    assert b"getattr" in payload
    (directory / fmt.DCP_METADATA_NAME).write_bytes(payload)
    report = validate(directory, Level.FULL)
    assert report.valid, report.reason


def test_getattr_in_metadata_reaches_nothing_but_an_enum_member(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.metadata import Metadata

    directory = save_plain_dcp(tmp_path / "step-1", {"t": torch.ones(3)})

    class Reach:
        def __reduce__(self) -> object:
            return getattr, (Metadata, "__init__")

    (directory / fmt.DCP_METADATA_NAME).write_bytes(pickle.dumps(Reach()))
    report = validate(directory, Level.QUICK)
    assert report.failed_level is Level.QUICK
    assert report.reason is not None and "not an enum member" in report.reason, report.reason
