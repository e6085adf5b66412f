"""Which processes are a node's ranks and how each ended (agent.node.procs), on real files."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.node.launch import Shape
from agent.node.procs import RankWatcher
from agent.wire import raised


@pytest.fixture
def launcher() -> Iterator[int]:
    """A launcher with no rank below it (its ranks already gone)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield process.pid
    process.kill()
    process.wait()


def _record(exit_dir: Path, rank: int, **fields: object) -> None:
    exit_dir.mkdir(exist_ok=True)
    document = {"global_rank": rank, "local_rank": rank % 2, "pid": 4000 + rank,
                "exit_code": 1, "signal": None, "time_unix_s": 100.0 + rank, **fields}  # fmt: skip
    (exit_dir / f"rank-{rank}.json").write_text(json.dumps(document))


def test_a_rank_that_died_before_discovery_is_reported_from_its_shims_record(
    tmp_path: Path, launcher: int
) -> None:
    exits = tmp_path / "exits"
    _record(exits, 3, stderr_tail="ModuleNotFoundError: No module named 'tansformers'")
    raised.note(exits, 3, "ModuleNotFoundError", "No module named 'tansformers'")
    watcher = RankWatcher(launcher, shape=Shape.TORCHRUN, exit_dir=exits, node_rank=1,
                          expected=2)  # fmt: skip
    (seen,) = watcher.poll_exits(200.0)
    assert (seen.rank.global_rank, seen.rank.local_rank, seen.rank.pid) == (3, 1, 4003)
    assert (seen.exit_code, seen.time_unix_s) == (1, 103.0)
    assert seen.raised is not None and seen.raised.message == "No module named 'tansformers'"
    assert seen.stderr_tail.endswith("No module named 'tansformers'")
    assert watcher.poll_exits(201.0) == []  # once


def test_once_every_rank_is_known_the_exit_folder_is_not_read_for_strangers(
    tmp_path: Path, launcher: int
) -> None:
    exits = tmp_path / "exits"
    _record(exits, 0)
    watcher = RankWatcher(launcher, shape=Shape.TORCHRUN, exit_dir=exits, node_rank=0,
                          expected=1)  # fmt: skip
    assert [e.rank.global_rank for e in watcher.poll_exits(200.0)] == [0]
    _record(exits, 5)  # all expected ranks known: nothing more is looked for
    assert watcher.poll_exits(201.0) == []
