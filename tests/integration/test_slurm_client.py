"""SlurmClient against the live local cluster: drain/resume, shrink, requeue smaller, cancel."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from supervisor.slurm import parse
from supervisor.slurm.client import SlurmClient
from supervisor.slurm.parse import JobState, SlurmJob
from tests.conftest import LiveCluster

pytestmark = pytest.mark.slurm


@pytest.fixture
def client(slurm_cluster: LiveCluster) -> SlurmClient:
    return SlurmClient(env={"SLURM_CONF": str(slurm_cluster.conf)})


def wait_job(
    cluster: LiveCluster,
    client: SlurmClient,
    job_id: int,
    what: str,
    ok: Callable[[SlurmJob], bool],
) -> SlurmJob:
    def check() -> SlurmJob | None:
        job = asyncio.run(client.job(job_id))
        return job if job is not None and ok(job) else None

    try:
        result: SlurmJob = cluster.wait_for(f"job {job_id} {what}", check, timeout_s=45.0)
    except AssertionError as timed_out:
        said = cluster.ctld_lines(job_id)
        raise AssertionError(f"{timed_out}; slurmctld said:\n{said}") from None
    return result


def submit_three_node_job(cluster: LiveCluster, tmp_path: Path) -> int:
    # Requeue-safe: the step is just a sleep, and counts come from the current
    # allocation, not the first submission (DESIGN §4).
    return cluster.sbatch(
        "--nodes=3",
        "--requeue",
        "--job-name=resurgo-client-test",
        f"--output={tmp_path / 'out.txt'}",
        "--wrap",
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" '
        "--ntasks-per-node=1 sleep 120",
    )


def test_drain_and_resume_show_in_nodes(slurm_cluster: LiveCluster, client: SlurmClient) -> None:
    reason = parse.drain_reason("integration_test", 0)
    asyncio.run(client.drain("node4", reason))
    try:
        node = asyncio.run(client.nodes())["node4"]
        assert node.drained and not node.usable
        assert parse.parse_drain_reason(node.reason) == parse.DrainReason("integration_test", 0)
    finally:
        asyncio.run(client.resume("node4"))
    node = asyncio.run(client.nodes())["node4"]
    assert not node.drained


def test_shrink_a_running_job_changes_its_nodes(
    slurm_cluster: LiveCluster, client: SlurmClient, tmp_path: Path
) -> None:
    job_id = submit_three_node_job(slurm_cluster, tmp_path)
    try:
        job = wait_job(
            slurm_cluster, client, job_id, "running", lambda j: j.state is JobState.RUNNING
        )
        assert len(job.nodes) == 3
        keep = job.nodes[:2]
        asyncio.run(client.shrink(job_id, keep))
        shrunk = wait_job(slurm_cluster, client, job_id, "on 2 nodes", lambda j: j.node_count == 2)
        assert shrunk.nodes == keep
    finally:
        asyncio.run(client.cancel(job_id))


def test_requeue_smaller_runs_again_on_fewer_nodes_without_the_excluded_one(
    slurm_cluster: LiveCluster, client: SlurmClient, tmp_path: Path
) -> None:
    job_id = submit_three_node_job(slurm_cluster, tmp_path)
    try:
        job = wait_job(
            slurm_cluster, client, job_id, "running", lambda j: j.state is JobState.RUNNING
        )
        bad = job.nodes[-1]
        asyncio.run(client.requeue_smaller(job_id, n_nodes=2, n_tasks=2, exclude_nodes=[bad]))
        again = wait_job(
            slurm_cluster,
            client,
            job_id,
            "running again",
            lambda j: j.state is JobState.RUNNING and j.restart_count > job.restart_count,
        )
        assert again.node_count == 2
        assert len(again.nodes) == 2
        assert bad not in again.nodes
        assert again.excluded_nodes == (bad,)
        assert again.restart_count == job.restart_count + 1
    finally:
        asyncio.run(client.cancel(job_id))
    cancelled = wait_job(
        slurm_cluster, client, job_id, "cancelled", lambda j: j.state is JobState.CANCELLED
    )
    assert cancelled.state.finished
