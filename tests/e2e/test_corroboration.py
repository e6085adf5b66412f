"""Corroboration before a drain, on the live cluster with the default policy.

A job owner's script can SIGKILL its own rank on a healthy node. With
``corroborate_drains`` on (the default) that takes the node out of that job
only: the supervisor then checks the node with a Slurm job of its own
(``agent.node.nodecheck`` pinned with ``--nodelist``) once the job left it,
and drains it only when the check fails, with the check's words as the
drain's reason.

One job, two faults: its rank on node3 is SIGKILLed (node3's check passes:
it stays in service), then, on the three nodes left, its rank on node2, where
the operator's check command fails (node2 is drained, naming the check).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import LiveCluster
from tests.e2e.jobs import Run, drained, finish, story, submit
from tests.supervisor_harness import SupervisorProcess

FAILS_ON = "node2"
CHECK = f"sh -c 'echo bad disk on $SLURMD_NODENAME; test \"$SLURMD_NODENAME\" != {FAILS_ON}'"

pytestmark = [
    pytest.mark.slurm,
    pytest.mark.policy(corroborate_drains="true"),
    pytest.mark.daemon_env(RESURGO_SUPERVISOR_NODE_CHECK=CHECK),
]


def checks(supervisor: SupervisorProcess, run: Run) -> dict[str, tuple[str, str]]:
    """Node -> (the check's result, its words) for the job's ended checks."""
    with supervisor.store() as store:
        return {
            check.node: (check.result.value, check.detail)
            for check in store.node_checks_since(0)
            if check.job_id == str(run.job_id) and check.result is not None
        }


def drain_reasons(cluster: LiveCluster) -> dict[str, str]:
    return {
        name: node.get("reason", "")
        for name, node in cluster.nodes().items()
        if "DRAIN" in node.get("state_flags", [])
    }


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_a_job_that_kills_its_own_rank_loses_the_node_and_a_failed_check_alone_drains(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    run = submit(
        supervisor, tmp_path, "--fault", "sigkill@6:node3", "--fault", f"sigkill@11:{FAILS_ON}"
    )
    job = finish(slurm_cluster, supervisor, run)
    told = story(supervisor, run) + "\n--- supervisor ---\n" + supervisor.log()[-4000:]
    assert job["job_state"] == "COMPLETED", told
    assert run.faulted_nodes() == ["node3", FAILS_ON], told
    ended = slurm_cluster.wait_for(
        "both node checks to end",
        lambda: len(checks(supervisor, run)) == 2 and checks(supervisor, run),
        120,
    )
    assert ended["node3"][0] == "passed", (ended, told)
    assert ended[FAILS_ON][0] == "failed", (ended, told)
    assert f"bad disk on {FAILS_ON}" in ended[FAILS_ON][1]
    # Both nodes left the job; only the one whose check failed is drained.
    last = run.steps()[max(run.steps())]
    assert last["world"] == 2, told
    reasons = slurm_cluster.wait_for("node2's drain", lambda: drain_reasons(slurm_cluster), 30)
    assert set(reasons) == {FAILS_ON}, reasons
    assert "failed the supervisor" in reasons[FAILS_ON] and "user=root" in reasons[FAILS_ON]
    assert drained(supervisor, run.job_id) == [(FAILS_ON, "rank_signal")]
    with supervisor.store() as store:
        outcomes = {b.node: b.outcome.value for b in store.blames_for("node3")}
        outcomes |= {b.node: b.outcome.value for b in store.blames_for(FAILS_ON)}
        kinds = [
            e.kind for e in store.events_for(str(run.job_id)) if e.kind.startswith("node_check")
        ]
    assert outcomes == {"node3": "checking", FAILS_ON: "checking"}
    assert sorted(kinds) == ["node_check_failed", "node_check_passed"]
