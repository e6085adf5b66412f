"""Fixtures the unit tests take by name.

For the store tests (``test_store*.py``): ``path`` is a store file in tmp_path;
``store`` is that store, opened and holding job ``JOB`` (running, four nodes, at
least two). For the operator CLI and metrics tests: ``state_dir``, a state
directory whose store holds one recovered job (:mod:`tests.unit.cli_world`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.store import Store
from tests.unit.cli_world import recovered_state_dir
from tests.unit.store_world import JOB, NOW, JobState


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "resurgo.db"


@pytest.fixture
def store(path: Path) -> Iterator[Store]:
    with Store.open(path) as opened:
        opened.upsert_job(
            JOB,
            state=JobState.RUNNING,
            record={"v": 1},
            now_s=NOW,
            name="train",
            original_nodes=4,
            min_nodes=2,
            secret_path="/state/1234/secret",
        )
        yield opened


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    """A store holding one recovered job: progress, a hang with stacks, a drain, a relaunch."""
    return recovered_state_dir(tmp_path)
