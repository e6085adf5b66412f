"""What the agent does at a time limit for a script that saves when it saves."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from agent.checkpoint import layouts
from agent.node.commands import await_save_settled, newest_checkpoint_write


def test_a_save_under_way_is_awaited_and_an_old_checkpoint_is_not(tmp_path: Path) -> None:
    saving = tmp_path / "checkpoint-20"
    saving.mkdir()
    (saving / "trainer_state.json").write_text('{"global_step": 20}')
    clock = [time.time()]
    ticks: list[float] = []

    def wall() -> float:
        ticks.append(clock[0])
        clock[0] += 0.5  # each look is half a second later
        return clock[0]

    outcome = asyncio.run(await_save_settled(str(tmp_path), lambda: False, clock[0] + 30, wall))
    assert outcome == "the script's save under way has ended"
    assert len(ticks) > 2  # it looked again until the checkpoint was 2 s old
    old = time.time() - 60
    for path in (saving / "trainer_state.json", saving):
        os.utime(path, (old, old))
    assert asyncio.run(await_save_settled(str(tmp_path), lambda: False, time.time() + 30,
                                          time.time)) is None  # fmt: skip


def test_an_unlistable_root_is_no_save_under_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(root: object) -> list[object]:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(layouts, "find_all", broken)
    assert newest_checkpoint_write(str(tmp_path)) is None
    assert asyncio.run(await_save_settled(str(tmp_path), lambda: False, time.time() + 30,
                                          time.time)) is None  # fmt: skip
