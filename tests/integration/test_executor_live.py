"""The executor against the live local cluster: a drain, and a drain finished after a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from supervisor.act.executor import Executor
from supervisor.act.reconcile import args_of, is_our_drain, kind_of
from supervisor.core.intents import DrainNode
from supervisor.core.model import Cause
from supervisor.slurm.client import SlurmClient
from supervisor.store import ActionState, Store
from tests.conftest import LiveCluster

pytestmark = pytest.mark.slurm

NOW = 1_700_000_000.0
JOB = "990001"  # no such Slurm job: a drain needs none
NODE = "node4"


class CountingClient(SlurmClient):
    """The real client, counting the admin calls that would change the cluster."""

    def __init__(self, conf: Path) -> None:
        super().__init__(env={"SLURM_CONF": str(conf)})
        self.drains: list[str] = []

    async def drain(self, node: str, reason: str) -> None:
        self.drains.append(node)
        await super().drain(node, reason)

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        raise AssertionError("this test never shrinks")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with Store.open(tmp_path / "store.db") as opened:
        opened.upsert_job(
            JOB, state="running", record={}, now_s=NOW, name="t", original_nodes=4, min_nodes=1
        )
        yield opened


@pytest.fixture
def client(slurm_cluster: LiveCluster) -> Iterator[CountingClient]:
    counting = CountingClient(slurm_cluster.conf)
    assert not asyncio.run(counting.nodes())[NODE].drained, f"{NODE} is drained by someone"
    try:
        yield counting
    finally:
        asyncio.run(counting.resume(NODE))


def executor(store: Store, client: SlurmClient) -> Executor:
    return Executor(store, client, checkpoint_root_of=lambda job_id: None)


def test_a_drain_reaches_slurm_with_the_structured_reason_and_is_audited(
    store: Store, client: CountingClient
) -> None:
    intent = DrainNode(JOB, 1, NODE, Cause.RANK_SIGNAL, "rank 3 SIGKILL")
    asyncio.run(executor(store, client).execute(JOB, [intent], NOW))

    seen = asyncio.run(client.nodes())[NODE]
    assert seen.drained and seen.reason == intent.slurm_reason and is_our_drain(seen.reason, intent)
    assert [(d.node, d.cause, d.action_id) for d in store.open_drains()] == [
        (NODE, "rank_signal", intent.action_id)
    ]
    assert client.drains == [NODE]


def test_a_restarted_supervisor_finishes_a_half_done_drain_without_draining_again(
    slurm_cluster: LiveCluster, store: Store, client: CountingClient
) -> None:
    intent = DrainNode(JOB, 2, NODE, Cause.HANG, "rank 3 behind")
    # The killed supervisor: started the action, ran scontrol, died before mark_done.
    store.plan_action(intent.action_id, JOB, kind_of(intent), args_of(intent), NOW)
    store.mark_started(intent.action_id, NOW)
    before_restart = SlurmClient(env={"SLURM_CONF": str(slurm_cluster.conf)})
    asyncio.run(before_restart.drain(NODE, intent.slurm_reason))

    restarted = executor(store, client)
    assert asyncio.run(restarted.reconcile(NOW + 30)) == []

    assert client.drains == []
    row = store.get_action(intent.action_id)
    assert row is not None and row.state is ActionState.DONE and row.starts == 1
    assert [d.action_id for d in store.open_drains()] == [intent.action_id]
    assert asyncio.run(client.nodes())[NODE].drained
