"""Fixtures the store tests (``test_store*.py``) take by name.

``path`` is a store file in tmp_path; ``store`` is that store, opened and holding
job ``JOB`` (running, four nodes, at least two).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.store import Store
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
