"""Checkpoints validated ahead of any fault (``supervisor/act/ahead.py``), with a counting check.

A recovery takes the background verdict of a checkpoint unchanged since, waits for
one of the same checkpoint still running, and validates again anything written to
since (truncated, rewritten in place, replaced, a file added).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from supervisor.act.ahead import AheadValidation, fingerprint
from supervisor.act.executor import Executor
from supervisor.core.intents import ValidateCheckpoints, ValidationLevel
from supervisor.store import Store
from tests.fakes.slurm import JOB, FakeSlurm
from tests.unit.executor_world import NOW


class Checks:
    """A check that says every existing file is valid and counts what it read; ``gate``
    (when set) holds each check until released."""

    def __init__(self) -> None:
        self.read: list[tuple[str, str]] = []
        self.invalid: set[str] = set()
        self.gate: asyncio.Event | None = None
        self.started = asyncio.Event()

    async def __call__(self, path: str, level: str) -> tuple[bool, str]:
        self.read.append((path, level))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        if path in self.invalid:
            return False, "a shard's checksum differs"
        return os.path.exists(path), ""


def checkpoint(where: Path, name: str = "step-100") -> Path:
    folder = where / name
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(b"x" * 1000)
    (folder / ".metadata").write_bytes(b"m" * 100)
    return folder


def scenario(
    body: Callable[[AheadValidation, Checks], Coroutine[Any, Any, None]],
    reading: Callable[[], bool] = lambda: True,
) -> None:
    async def main() -> None:
        checks = Checks()
        ahead = AheadValidation(checks, reading=reading)
        runner = asyncio.create_task(ahead.run())
        try:
            await body(ahead, checks)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(main())


async def settled(ahead: AheadValidation, count: int) -> None:
    for _ in range(500):
        if ahead.validated >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{ahead.validated} background validations, not {count}")


def test_a_checkpoint_unchanged_since_its_background_validation_is_not_read_again(
    tmp_path: Path,
) -> None:
    ckpt = str(checkpoint(tmp_path))

    async def body(ahead: AheadValidation, checks: Checks) -> None:
        ahead.note("12", ckpt, "full")
        await settled(ahead, 1)
        assert await ahead.verdict(ckpt, "full") == (True, "")
        assert await ahead.verdict(ckpt, "quick") == (True, "")  # a shallower level
        assert await ahead.verdict(ckpt, "load") is None  # a deeper one: read it now
        assert checks.read == [(ckpt, "full")]

    scenario(body)


def test_a_checkpoint_written_to_since_is_validated_again(tmp_path: Path) -> None:
    """Truncated, rewritten in place with the same size, replaced, a file added: each
    makes the fault read it again."""
    changes: list[Callable[[Path], None]] = [
        lambda c: os.truncate(c / "__0_0.distcp", 10),
        lambda c: (c / "__0_0.distcp").write_bytes(b"y" * 1000),
        lambda c: os.replace(_written(c / "new", b"x" * 1000), c / "__0_0.distcp"),
        lambda c: (c / "__1_0.distcp").write_bytes(b""),
    ]

    async def body(ahead: AheadValidation, checks: Checks) -> None:
        for index, change in enumerate(changes):
            ckpt = checkpoint(tmp_path, f"step-{index}")
            ahead.note("12", str(ckpt), "full")
            await settled(ahead, index + 1)
            change(ckpt)
            assert await ahead.verdict(str(ckpt), "full") is None, index

    scenario(body)


def _written(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_one_path_saved_again_is_validated_again_and_once_per_content(tmp_path: Path) -> None:
    """Lightning's last.ckpt: one path, a new file each save."""
    last = tmp_path / "last.ckpt"

    async def body(ahead: AheadValidation, checks: Checks) -> None:
        for saved in range(2):
            os.replace(_written(tmp_path / "tmp", bytes([saved]) * 100), last)
            ahead.note("12", str(last), "full")
            await settled(ahead, saved + 1)
            assert await ahead.verdict(str(last), "full") == (True, "")
        ahead.note("12", str(last), "full")  # the same content again: not read again
        await asyncio.sleep(0.05)
        assert len(checks.read) == 2

    scenario(body)


def test_an_invalid_verdict_answers_only_for_its_own_level(tmp_path: Path) -> None:
    bad = tmp_path / "model.pt"
    bad.write_bytes(b"w" * 10)
    gone = str(tmp_path / "gone")

    async def body(ahead: AheadValidation, checks: Checks) -> None:
        checks.invalid.add(str(bad))
        ahead.note("12", str(bad), "full")
        await settled(ahead, 1)
        assert await ahead.verdict(str(bad), "full") == (False, "a shard's checksum differs")
        assert await ahead.verdict(str(bad), "quick") is None  # may pass a shallower look
        ahead.note("13", gone, "full")  # gone: no fingerprint, no verdict
        await asyncio.sleep(0.05)
        assert await ahead.verdict(gone, "full") is None and len(checks.read) == 1

    scenario(body)


def test_a_recovery_waits_for_the_background_read_of_the_same_checkpoint(
    tmp_path: Path,
) -> None:
    newer = str(checkpoint(tmp_path, "step-2"))

    async def body(ahead: AheadValidation, checks: Checks) -> None:
        checks.gate = asyncio.Event()
        ahead.note("12", newer, "full")
        await checks.started.wait()
        # The fault wants the checkpoint being read: it takes that read's verdict.
        asked = asyncio.create_task(ahead.verdict(newer, "full"))
        await asyncio.sleep(0.05)
        assert not asked.done()
        checks.gate.set()
        assert await asked == (True, "")
        assert checks.read == [(newer, "full")]
        # A deeper level than the one being read: not waited for, read at the fault.
        assert await ahead.verdict(newer, "load") is None

    scenario(body)


def test_a_recovery_does_not_wait_for_a_background_validation_still_starting(
    tmp_path: Path,
) -> None:
    """The background's niced child importing torch on a loaded head node took 74 s;
    a time-limit requeue waited for it while the recovery's own child was ready."""
    newer = str(checkpoint(tmp_path, "step-2"))

    async def body(ahead: AheadValidation, checks: Checks) -> None:
        checks.gate = asyncio.Event()
        ahead.note("12", newer, "full")
        await checks.started.wait()
        asked = asyncio.create_task(ahead.verdict(newer, "quick"))
        await asyncio.sleep(0.2)
        assert asked.done() and asked.result() is None  # read at the fault instead
        checks.gate.set()

    scenario(body, reading=lambda: False)


def test_the_background_keeps_only_a_jobs_newest_checkpoint_waiting(tmp_path: Path) -> None:
    paths = [str(checkpoint(tmp_path, f"step-{n}")) for n in range(4)]

    async def body(ahead: AheadValidation, checks: Checks) -> None:
        checks.gate = asyncio.Event()
        ahead.note("12", paths[0], "full")
        await checks.started.wait()
        for path in paths[1:]:
            ahead.note("12", path, "full")  # reported while the first is read
        checks.gate.set()
        await settled(ahead, 2)
        await asyncio.sleep(0.05)
        assert [path for path, _ in checks.read] == [paths[0], paths[3]]

    scenario(body)


def test_fingerprint_of_a_file_a_folder_and_nothing(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path)
    names = [entry[0] for entry in fingerprint(str(ckpt)) or ()]
    assert names == [".metadata", "__0_0.distcp"]
    assert fingerprint(str(ckpt / ".metadata")) is not None
    assert fingerprint(str(tmp_path / "missing")) is None


def test_the_executors_recovery_takes_the_verdict_made_when_the_checkpoint_was_reported(
    tmp_path: Path,
) -> None:
    """Through the executor: the commit's background validation is the only read; a
    checkpoint changed after it is read again at the fault."""
    from tests.ckpt_helpers import make_committed_checkpoint

    root = tmp_path / "ckpt"
    path = make_committed_checkpoint(root, 100)
    read: list[str] = []

    def counting(at: str, level: ValidationLevel) -> tuple[bool, str]:
        read.append(at)
        return True, ""

    async def main() -> None:
        store = Store.open(tmp_path / "store.db")
        store.upsert_job(JOB, state="running", record={}, now_s=NOW, name="toy",
                         original_nodes=4, min_nodes=2)  # fmt: skip
        ex = Executor(store, FakeSlurm(), checkpoint_root_of=lambda _: root,
                      validate_fn=counting, clock=lambda: NOW + 1)  # fmt: skip
        assert ex.ahead is not None
        runner = asyncio.create_task(ex.ahead.run())
        try:
            ex.note_checkpoint(JOB, str(path), ValidationLevel.FULL)
            await settled(ex.ahead, 1)
            (seen,) = await ex.execute(
                JOB, [ValidateCheckpoints(JOB, 2, ValidationLevel.FULL)], NOW
            )
            assert seen.valid and read == [str(path)]  # type: ignore[union-attr]
            os.truncate(next(path.glob("*.distcp")), 1)
            await ex.execute(JOB, [ValidateCheckpoints(JOB, 3, ValidationLevel.FULL)], NOW)
            assert read == [str(path), str(path)]
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
            store.close()

    asyncio.run(main())
