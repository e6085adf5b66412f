"""Rendezvous ports on the live cluster: asked of the master node, never one in use.

A 2-node batch job plays the driver on its batch host (node1): another job's
store holds the port the old formula gives this job, and three launches are
planned at once, one with node1 as the master (probed in the process), two
with node2 as the master (probed with ``srun --overlap`` on node2; the local
cluster's nodes share one machine, so node1 and node2 share one port space).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, LiveCluster

pytestmark = pytest.mark.slurm

PLAN = """
import asyncio, json, os, socket, sys
from datetime import timedelta
from torch.distributed import TCPStore
from agent import ports

job = os.environ["SLURM_JOB_ID"]
held = socket.socket()  # another job's store, on the port the old formula gives this job
held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
held.bind(("", ports.derived_port(job, 1)))
held.listen()

async def plan():
    return await asyncio.gather(*(
        ports.rendezvous_port(node, os.environ, sys.executable, job_id=job, attempt=1)
        for node in ("node1", "node2", "node2")
    ))

chosen = asyncio.run(plan())
bindable = []
for port in chosen:
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                     wait_for_workers=False)
    bindable.append(port)
    del store
json.dump({"held": held.getsockname()[1], "chosen": chosen, "bindable": bindable,
           "here": os.environ.get("SLURMD_NODENAME")}, open(sys.argv[1], "w"))
"""


def test_concurrent_launches_on_one_master_node_get_distinct_free_ports(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.py"
    plan.write_text(PLAN)
    result = tmp_path / "result.json"
    job_id = slurm_cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=1", "--nodelist=node1,node2",
        f"--output={tmp_path / 'out.txt'}", "--time=2",
        f"--wrap={sys.executable} {plan} {result}",
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
    )  # fmt: skip

    def ended() -> bool:
        job = slurm_cluster.job(job_id)
        return job is None or job["job_state"] not in ("PENDING", "CONFIGURING", "RUNNING")

    try:
        slurm_cluster.wait_for(f"job {job_id} to end", ended, timeout_s=180)
    finally:
        slurm_cluster.run(["scancel", str(job_id)])
    output = tmp_path / "out.txt"
    log = output.read_text() if output.exists() else "(no output)"
    assert result.exists(), log
    found = json.loads(result.read_text())
    assert found["here"] == "node1", log
    assert found["held"] not in found["chosen"], log
    assert len(set(found["chosen"])) == 3, log
    assert found["bindable"] == found["chosen"], log
    assert "derived port" not in log, log
