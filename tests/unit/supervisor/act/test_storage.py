"""The look at a checkpoint root after a storage failure (supervisor.act.storage)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from supervisor.act import storage


def test_a_root_with_room_for_its_newest_checkpoint_is_usable(tmp_path: Path) -> None:
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / "shard-0").write_bytes(b"x" * 1000)
    seen = asyncio.run(storage.look(tmp_path))
    assert seen.usable and seen.detail.startswith(f"{tmp_path} has ")


def test_less_free_space_than_asked_for_is_not_usable(tmp_path: Path) -> None:
    seen = storage.look_now(tmp_path, min_free_bytes=1 << 60)  # more than any disk here
    assert not seen.usable and "the newest checkpoint needs 1,152,922 TB" in seen.detail
    seen = asyncio.run(storage.look(tmp_path, 1 << 60))
    assert not seen.usable


def test_the_newest_checkpoint_sets_the_room_needed(tmp_path: Path) -> None:
    old, new = tmp_path / "step-10", tmp_path / "step-20"
    for folder, size in ((old, 10), (new, 3000)):
        folder.mkdir()
        (folder / "a").write_bytes(b"x" * size)
        (folder / "b").write_bytes(b"x" * size)
    assert storage._newest_size(tmp_path, ["step-10", "step-20"]) == 6000


def test_a_root_that_cannot_be_listed_or_is_unknown_is_not_usable(tmp_path: Path) -> None:
    assert "No such file or directory" in storage.look_now(tmp_path / "gone").detail
    assert asyncio.run(storage.look(None)).detail == "no checkpoint directory is known"


def test_a_look_that_hangs_ends_at_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    def hung(root: Path, min_free_bytes: int) -> storage.Look:
        time.sleep(2)
        return storage.Look(True, "too late")

    monkeypatch.setattr(storage, "LOOK_S", 0.2)
    monkeypatch.setattr(storage, "look_now", hung)
    seen = asyncio.run(storage.look(Path("/nfs/hung")))
    assert not seen.usable and "did not answer within 0.2 s" in seen.detail


def test_a_look_names_the_mount_point_of_the_roots_file_system(tmp_path: Path) -> None:
    # /proc is its own file system on every Linux host; /proc/self/fd lies on it.
    assert storage.mount_point(Path("/proc/self/fd")) == "/proc"
    assert storage.mount_point(Path("/")) == "/"
    seen = asyncio.run(storage.look(tmp_path / "gone" / "deeper"))
    assert not seen.usable and seen.filesystem == storage.mount_point(tmp_path)
    assert seen.filesystem and str(tmp_path).startswith(seen.filesystem)
