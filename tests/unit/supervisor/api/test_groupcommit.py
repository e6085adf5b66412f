"""Event batches that arrive together share one durable commit, on a real SQLite store.

Each take writes a row in its own savepoint: one that raises leaves nothing behind
and gets its error, the others are stored and answered, and nobody is answered
before the commit.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from supervisor.api.groupcommit import GroupCommit
from supervisor.store import Store

NOW = 1_760_000_000.0


def test_batches_arriving_together_share_a_commit_and_a_failing_one_is_undone_alone(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "state.db")
    store.upsert_job(
        "7", state="running", record={}, now_s=NOW, name="t", original_nodes=1, min_nodes=1
    )
    commits: list[int] = []

    @contextlib.contextmanager
    def durably() -> Iterator[None]:
        with store.transaction(durable=True):
            yield
        commits.append(len(commits))

    group = GroupCommit(durably)

    def take(name: str, fail: bool = False) -> str:
        store.record_observation("7", "note", {"name": name}, NOW, observation_id=f"7/t/{name}")
        if fail:
            raise ValueError(f"{name} failed after its write")
        return name

    async def scenario() -> list[object]:
        return await asyncio.gather(
            group.run(lambda: take("a")),
            group.run(lambda: take("b", fail=True)),
            group.run(lambda: take("c")),
            return_exceptions=True,
        )

    a, b, c = asyncio.run(scenario())
    assert (a, c) == ("a", "c")
    assert isinstance(b, ValueError)
    assert group.commits == 1 and group.taken == 3
    # The one outer block, and the savepoints of the two takes that did not raise.
    assert len(commits) == 3
    stored = {row.payload["name"] for row in store.events_for("7", kinds=["note"])}
    assert stored == {"a", "c"}
    store.close()


def test_a_commit_that_fails_fails_every_batch_of_its_group() -> None:
    class Refused(Exception):
        pass

    @contextlib.contextmanager
    def durably() -> Iterator[None]:
        yield
        raise Refused("disk full")

    group = GroupCommit(durably)

    async def scenario() -> None:
        with pytest.raises(Refused):
            await group.run(lambda: "stored?")

    asyncio.run(scenario())
    assert group.commits == 0
