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


def test_a_commit_holds_the_loop_no_longer_than_its_time_and_the_rest_go_in_the_next(
    tmp_path: Path,
) -> None:
    """Batches that take long to store (a job's relayed events) are committed a few at
    a time, each commit within ``hold_s``; every batch is stored and answered."""
    store = Store.open(tmp_path / "state.db")
    store.upsert_job(
        "7", state="running", record={}, now_s=NOW, name="t", original_nodes=1, min_nodes=1
    )
    clock = [0.0]
    group = GroupCommit(
        lambda: store.transaction(durable=True), hold_s=0.02, clock=lambda: clock[0]
    )
    taken_in: list[int] = []

    def take(name: str) -> str:
        store.record_observation("7", "note", {"name": name}, NOW, observation_id=f"7/t/{name}")
        taken_in.append(group.commits)
        clock[0] += 0.015  # each batch takes 15 ms to store
        return name

    async def scenario() -> list[str]:
        return await asyncio.gather(*(group.run(lambda n=n: take(n)) for n in "abcde"))

    assert asyncio.run(scenario()) == list("abcde")
    # Two batches a commit (the second starts within 20 ms, the third would not).
    assert taken_in == [0, 0, 1, 1, 2]
    assert group.commits == 3 and group.taken == 5
    stored = {row.payload["name"] for row in store.events_for("7", kinds=["note"])}
    assert stored == set("abcde")
    store.close()
