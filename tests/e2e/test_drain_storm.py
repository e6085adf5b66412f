"""Simultaneous faults of one user's jobs on the live cluster: the hourly share and the storm
brake hold.

Three single-node jobs of one user each have their rank SIGKILLed at the same
moment (by the test, from outside, in one loop), as a bad minute of shared
storage or a user's script bug does to every job at once. The policy is the
default on four nodes (one drain an hour), drains on one job's word
(``corroborate_drains`` off, so that the budget is what is looked at): one
node is drained, the second blame finds the share used, the third starts a
storm, which raises one critical alert; the other two nodes are only kept
out of their jobs, and all three jobs are relaunched and complete.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest

from agent.node.procs import shim_worker
from tests.conftest import LiveCluster
from tests.e2e.jobs import Run, drained, finish, story, submit
from tests.supervisor_harness import SupervisorProcess

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.policy(max_drain_share_per_hour="0.1", corroborate_drains="false"),
]


def rank_pid(run: Run) -> int | None:
    """The pid of ``run``'s training rank: the worker of the rank's launcher shim
    (``python -m agent.node.rankexec`` with the job's record path: its child, or the warm
    pool's child it recorded); None while there is none. Killing the shim instead leaves
    the rank orphaned: a different fault."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            shim = process.info["cmdline"] or []
            if shim[1:3] == ["-m", "agent.node.rankexec"] and str(run.record) in shim:
                return shim_worker(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_three_jobs_faults_at_once_drain_one_node_and_raise_one_storm(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    runs = []
    for i in range(3):
        (tmp_path / f"job{i}").mkdir()
        runs.append(
            submit(
                supervisor,
                tmp_path / f"job{i}",
                "--fault",
                "idle@3:0",
                nodes=1,
                min_nodes=1,
                env={"SBATCH_EXCLUSIVE": "exclusive"},  # one node each, as on a GPU cluster
            )
        )
    pids = slurm_cluster.wait_for(
        "three ranks idling at step 3",
        lambda: (
            all("injecting idle at step 3" in run.text() for run in runs)
            and [rank_pid(run) for run in runs]
        ),
        timeout_s=240,
    )
    assert None not in pids and len(set(pids)) == 3, pids
    victims = {run.job_id: run.faulted_nodes()[0] for run in runs}
    assert len(set(victims.values())) == 3, victims
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    jobs = [finish(slurm_cluster, supervisor, run) for run in runs]
    told = "\n".join(story(supervisor, run) for run in runs)
    assert [job["job_state"] for job in jobs] == ["COMPLETED"] * 3, told
    with supervisor.store() as store:
        outcomes = sorted(b.outcome.value for b in store.blames_since(0))
        alerts = [
            a.payload["message"]
            for run in runs
            for a in store.events_for(str(run.job_id), kinds=["alert"])
        ]
    assert outcomes == ["drained", "excluded", "storm"], (outcomes, told)
    assert sum(message.startswith("drain storm:") for message in alerts) == 1, alerts
    drains = [d for run in runs for d in drained(supervisor, run.job_id)]
    assert len(drains) == 1 and drains[0][0] in victims.values(), drains
    in_slurm = [
        n for n, node in slurm_cluster.nodes().items() if "DRAIN" in node.get("state_flags", [])
    ]
    assert in_slurm == [drains[0][0]], in_slurm
    # Each job went on without the node it blamed.
    for run in runs:
        with supervisor.store() as store:
            last = list(store.attempts_for(str(run.job_id)))[-1]
        assert victims[run.job_id] not in last.nodes, (last, told)
