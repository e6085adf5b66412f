"""torchrun ranks really span the local Slurm nodes: the demo's toy job."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, LiveCluster

pytestmark = pytest.mark.slurm


def test_torchrun_across_three_slurm_nodes_rendezvous_and_all_reduce(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    output = tmp_path / "job.out"
    job_id = slurm_cluster.sbatch(
        "--nodes=3",
        f"--output={output}",
        "--export=ALL",
        str(REPO / "deploy/demo/toy_job.sh"),
        env={"RESURGO_PYTHON": sys.executable, "RESURGO_DEMO_DIR": str(REPO / "deploy/demo")},
    )
    job = slurm_cluster.wait_job_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
    text = output.read_text()
    assert job["job_state"] == "COMPLETED", text
    ranks = re.findall(r"rank (\d)/6 on (node\d): all_reduce sum = 15", text)
    assert sorted(rank for rank, _ in ranks) == [str(r) for r in range(6)]
    assert len({node for _, node in ranks}) == 3
    assert "RESULT world=6 sum=15 expected=15 OK" in text
