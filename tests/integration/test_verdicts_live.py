"""A Resurgo drain an admin lifts with plain scontrol, on the live local cluster.

The drain goes through Resurgo's own path (the executor, the real Slurm
client); the resume is an admin's `scontrol update nodename=... state=resume`
outside Resurgo. The supervisor's next poll must record the drain as undone
outside Resurgo, `resurgo nodes` (text and --json) must stop showing it as
Resurgo's, and the blame must stop counting towards the lemon list.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from supervisor.act.executor import Executor
from supervisor.config import SupervisorConfig
from supervisor.core.intents import DrainNode
from supervisor.core.model import Cause
from supervisor.core.policy import Policy
from supervisor.daemon import Supervisor
from supervisor.slurm.client import SlurmClient
from supervisor.store import Actor
from tests.conftest import LiveCluster

pytestmark = pytest.mark.slurm

JOB = "990016"  # no such Slurm job: a drain needs none
EARLIER = "990015"  # an earlier job of another user
NODE = "node4"


@pytest.fixture
def supervisor(slurm_cluster: LiveCluster, tmp_path: Path) -> Iterator[Supervisor]:
    client = SlurmClient(env={"SLURM_CONF": str(slurm_cluster.conf)})
    assert not asyncio.run(client.nodes())[NODE].drained, f"{NODE} is drained by someone"
    daemon = Supervisor(SupervisorConfig(state_dir=str(tmp_path / "state")), Policy(), slurm=client)
    try:
        yield daemon
    finally:
        daemon.store.close()
        if asyncio.run(client.nodes())[NODE].drained:
            asyncio.run(client.resume(NODE))


def resurgo_nodes(cluster: LiveCluster, state_dir: str, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.cli.main", "nodes", "--state-dir", state_dir, *flags],
        env=cluster.env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def document(cluster: LiveCluster, state_dir: str) -> dict[str, Any]:
    parsed: dict[str, Any] = json.loads(resurgo_nodes(cluster, state_dir, "--json"))
    return parsed


def test_a_drain_an_admin_lifts_with_scontrol_shows_as_undone_and_stops_counting_as_a_lemon(
    slurm_cluster: LiveCluster, supervisor: Supervisor
) -> None:
    store, state_dir = supervisor.store, supervisor.config.state_dir
    now = time.time()
    store.upsert_job(JOB, state="running", record={}, now_s=now, name="t",
                     original_nodes=4, min_nodes=1, slurm_user="alice")  # fmt: skip
    store.upsert_job(EARLIER, state="completed", record={}, now_s=now - 7200, name="e",
                     original_nodes=4, min_nodes=1, slurm_user="bob")  # fmt: skip
    # An earlier blame by another user's job, served out on probation: with today's
    # drain the node reaches the default lemon threshold (2 within the window, 2 users).
    store.record_drain(NODE, cause=Cause.HANG, job_id=EARLIER, reason="resurgo: hang job=990015",
                       now_s=now - 3600, action_id=f"{EARLIER}/1/drain/{NODE}")  # fmt: skip
    store.record_undrain(NODE, now_s=now - 3000)
    drain = DrainNode(JOB, 1, NODE, Cause.RANK_SIGNAL, "rank 3 SIGKILL")
    executor = Executor(store, supervisor.slurm, checkpoint_root_of=lambda job_id: None)
    asyncio.run(executor.execute(JOB, [drain], time.time()))
    asyncio.run(supervisor.polling.poll())
    assert supervisor.cluster.view.lemons == {NODE}
    before = document(slurm_cluster, state_dir)
    assert [(d["node"], d["by_resurgo"]) for d in before["drained"]] == [(NODE, True)]
    assert [lemon["node"] for lemon in before["lemons"]] == [NODE]

    slurm_cluster.run(["scontrol", "update", f"nodename={NODE}", "state=resume"])
    asyncio.run(supervisor.polling.poll())

    assert supervisor.cluster.view.lemons == frozenset()
    policy = supervisor.policy
    assert store.lemons(policy.lemon_blames, policy.lemon_window_s, time.time()) == []
    earlier, lifted = store.blame_history(NODE)
    assert earlier.counts_as_blame and earlier.undrained_by is Actor.SUPERVISOR
    assert lifted.undrained_by is Actor.OUTSIDE and lifted.withdrawn_by is Actor.OUTSIDE
    after = document(slurm_cluster, state_dir)
    assert after["drained"] == [] and after["lemons"] == []
    entry = after["history"][NODE][-1]
    assert (entry["undrained_by"], entry["withdrawn_by"]) == ("outside", "outside")
    text = resurgo_nodes(slurm_cluster, state_dir)
    assert "no drained nodes" in text and "undone outside Resurgo" in text
    assert "lemons: none" in text
