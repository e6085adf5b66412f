"""The local cluster is a real Slurm: multi-node jobs, drain/resume, shrinking a job."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import LiveCluster

pytestmark = pytest.mark.slurm


def test_three_node_batch_job_runs_one_srun_task_per_node(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    output = tmp_path / "out.txt"
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        # Explicit counts: inherited ones are wrong after a resize (DESIGN.md §4).
        "srun --nodes=3 --ntasks=3 --ntasks-per-node=1 "
        "bash -c 'echo \"task=$SLURM_PROCID node=$SLURMD_NODENAME\"'\n"
    )
    job_id = slurm_cluster.sbatch("--nodes=3", f"--output={output}", str(script))
    slurm_cluster.wait_for(
        f"job {job_id} to write three lines",
        lambda: output.exists() and len(output.read_text().splitlines()) == 3,
    )
    lines = sorted(output.read_text().splitlines())
    nodes = {line.split("node=")[1] for line in lines}
    assert [line.split()[0] for line in lines] == ["task=0", "task=1", "task=2"]
    assert len(nodes) == 3
    assert nodes <= {"node1", "node2", "node3", "node4"}


def test_drained_node_reads_back_through_sinfo_json_and_resumes(
    slurm_cluster: LiveCluster,
) -> None:
    reason = "resurgo: integration test drain"
    slurm_cluster.run(["scontrol", "update", "nodename=node4", "state=drain", f"reason={reason}"])
    try:
        node = slurm_cluster.nodes()["node4"]
        assert "DRAIN" in node["state_flags"]
        assert node["reason"] == reason
    finally:
        slurm_cluster.run(["scontrol", "update", "nodename=node4", "state=resume"])
    node = slurm_cluster.nodes()["node4"]
    assert "DRAIN" not in node["state_flags"]
    assert node["state"] == "idle"


def test_shrinking_a_running_job_gives_it_the_new_node_list(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    job_id = slurm_cluster.sbatch(
        "--nodes=3", f"--output={tmp_path / 'out.txt'}", "--wrap", "srun sleep 120"
    )
    try:
        job = slurm_cluster.wait_job_state(job_id, {"RUNNING"})
        assert job["node_count"] == 3
        job_nodes = slurm_cluster.run(
            ["scontrol", "show", "hostnames", job["nodes"]]
        ).stdout.split()
        kept = job_nodes[:2]
        slurm_cluster.run(["scontrol", "update", f"jobid={job_id}", f"NodeList={','.join(kept)}"])
        shrunk = slurm_cluster.wait_for(
            f"job {job_id} to have 2 nodes",
            lambda: (lambda j: j if j and j["node_count"] == 2 else None)(
                slurm_cluster.job(job_id)
            ),
        )
        hostnames = slurm_cluster.run(["scontrol", "show", "hostnames", shrunk["nodes"]])
        assert hostnames.stdout.split() == kept
    finally:
        slurm_cluster.run(["scancel", str(job_id)])
