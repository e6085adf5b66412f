"""Hot spares, end to end, on the live 4-node cluster: a 3+1 job.

``resurgo submit -N 3 --spares 1`` allocates four nodes and trains on three; the
fourth runs nothing. A SIGKILLed rank, a hang and a lost node each put the spare
in the blamed node's place: the world stays at three, the job resumes from the
newest valid checkpoint with no reshard, and its final parameters are bitwise
those of an unfaulted 3-node run. A second fault with no spare left shrinks the
job as before, and a spare that fails its health check never runs a rank.

(The acceptance names a 4+1 job: the local cluster has four nodes, so the same
shape is tested one node smaller. ``deploy/slurm/cluster up --nodes 5`` runs it
as 4+1 with ``RESURGO_SPARES_WORLD=4``.)
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.conftest import CLUSTER_SCRIPT, LiveCluster
from tests.e2e import jobs
from tests.e2e.jobs import (
    STEPS,
    Run,
    assert_resumed_from,
    assert_same_samples,
    attempts,
    drained,
    finish,
    story,
)
from tests.supervisor_harness import SupervisorProcess

pytestmark = pytest.mark.slurm

WORLD = int(os.environ.get("RESURGO_SPARES_WORLD", "3"))
SPARE = f"node{WORLD + 1}"  # the allocation's last node: the spare
# The fault strikes the rank on node2, whatever rank the rendezvous gave it: node1
# runs the batch script, and its loss is a requeue into a new allocation instead.
VICTIM = "node2"


def submit(
    supervisor: SupervisorProcess,
    where: Path,
    *toy_args: str,
    spares: int = 1,
    env: dict[str, str] | None = None,
) -> Run:
    """The demo trainer's job on a world of ``WORLD`` nodes with ``spares`` beside it."""
    return jobs.submit(supervisor, where, *toy_args, nodes=WORLD, env=env, spares=spares)


@pytest.fixture(scope="module")
def reference(slurm_cluster: LiveCluster, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same job unfaulted, on the world's nodes and no spare: what to match bitwise."""
    return jobs.unfaulted(slurm_cluster, tmp_path_factory, nodes=WORLD)


def status_of(supervisor: SupervisorProcess, job_id: int) -> dict:  # type: ignore[type-arg]
    with supervisor.store() as store:
        row = store.get_job(str(job_id))
        assert row is not None
        return dict(row.record)


def assert_bitwise(run: Run, reference: Run) -> None:
    """Every step on the reference's samples and world, and the final parameters bit for bit."""
    assert_same_samples(run, reference)
    got = run.steps()
    for step in range(1, STEPS + 1):
        assert got[step]["world"] == WORLD, f"step {step} ran on world {got[step]['world']}"
    final, expected = run.final(), reference.final()
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name


def lose_a_node(cluster: LiveCluster, run: Run, node: str) -> None:
    cluster.wait_for("step 6", lambda: "injecting idle at step 6" in run.text(), 180)
    subprocess.run([str(CLUSTER_SCRIPT), "kill-node", node], env=cluster.env, check=True)


@pytest.mark.parametrize(
    ("fault", "cause"),
    [
        (f"sigkill@6:{VICTIM}", "rank_signal"),
        (f"hang@6:{VICTIM}", "hang"),
        ("idle@6:*", "node_lost"),
    ],
    ids=["sigkill", "hang", "kill-node"],
)
@pytest.mark.long  # over a minute in CI: started before the short tests
def test_the_spare_takes_the_blamed_nodes_place_and_the_run_is_bitwise_unfaulted(
    slurm_cluster: LiveCluster,
    supervisor: SupervisorProcess,
    reference: Run,
    tmp_path: Path,
    fault: str,
    cause: str,
) -> None:
    run = submit(supervisor, tmp_path, "--fault", fault)
    slurm_cluster.wait_for(
        "the job to start with its spare",
        lambda: status_of(supervisor, run.job_id).get("spare_nodes") == [SPARE],
        180,
    )
    first = attempts(supervisor, run.job_id)[0]
    assert SPARE not in first.nodes and len(first.nodes) == WORLD, first
    victim = VICTIM
    if cause == "node_lost":
        lose_a_node(slurm_cluster, run, victim)
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    if cause != "node_lost":
        assert run.faulted_nodes() == [victim]
    last = attempts(supervisor, run.job_id)[-1]
    assert victim not in last.nodes and SPARE in last.nodes, story(supervisor, run)
    assert len(last.nodes) == WORLD
    record = status_of(supervisor, run.job_id)
    # A killed rank or a hang is a swap inside the allocation; a lost node's step may
    # keep Slurm's nodes busy, and then the relaunch falls back to a requeue.
    assert cause == "node_lost" or job["restart_cnt"] == 0, story(supervisor, run)
    if job["restart_cnt"] == 0:
        swaps = dict(record["swaps"])
        assert sum(swaps.values()) == 1, story(supervisor, run)
        assert cause == "node_lost" or swaps == {cause: 1}, swaps
        with supervisor.store() as store:
            explained = [
                d.detail.get("explanation", "") for d in store.decisions_for(str(run.job_id))
            ]
        assert any(f"spare {SPARE} replaces {victim}" in e for e in explained), explained
    assert_resumed_from(supervisor, run, 4)
    assert_bitwise(run, reference)
    with urllib.request.urlopen(f"{supervisor.url}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
    assert f'resurgo_job_spare_nodes{{job_id="{run.job_id}"}} 0.0' in metrics


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_a_second_fault_with_no_spare_left_shrinks_the_job(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    run = submit(
        supervisor, tmp_path, "--fault", f"sigkill@6:{VICTIM}", "--fault", "sigkill@10:node3"
    )
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    victims = run.faulted_nodes()
    assert victims == [VICTIM, "node3"], story(supervisor, run)
    assert sorted(n for n, _ in drained(supervisor, run.job_id)) == sorted(victims)
    sizes = [len(a.nodes) for a in attempts(supervisor, run.job_id)]
    assert sizes == [WORLD, WORLD, WORLD - 1], story(supervisor, run)
    assert SPARE in attempts(supervisor, run.job_id)[1].nodes
    assert run.steps()[STEPS]["world"] == WORLD - 1


# The operator's health check fails on the spare only (the nodes share one host here).
FAILS_ON_THE_SPARE = f"sh -c 'test \"$SLURMD_NODENAME\" != {SPARE}'"


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_an_idle_spare_that_fails_its_health_check_is_released_while_the_job_trains(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """The gate runs on the idle spare as soon as the job trains (the policy's
    spare_check_interval_s, 300 s by default, after that): it fails there, and the
    spare leaves the allocation with nothing restarted. With no spare left, the
    fault that follows shrinks the job."""
    # Seconds-long steps: the check (at the driver's next poll once steps come in) ends
    # well before the fault at step 12.
    run = submit(
        supervisor, tmp_path, "--fault", f"sigkill@12:{VICTIM}", "--step-s", "1",
        env={"RESURGO_AGENT_HEALTH_CHECK": FAILS_ON_THE_SPARE},
    )  # fmt: skip
    slurm_cluster.wait_for(
        "the failing spare released",
        lambda: status_of(supervisor, run.job_id).get("blamed_nodes") == [SPARE],
        180,
    )
    record = status_of(supervisor, run.job_id)
    assert record["spare_nodes"] == [] and len(attempts(supervisor, run.job_id)) == 1
    job = slurm_cluster.job(run.job_id)
    assert job is not None
    held = slurm_cluster.run(["scontrol", "show", "hostnames", job["nodes"]]).stdout.split()
    assert held == [f"node{i}" for i in range(1, WORLD + 1)], story(supervisor, run)
    with supervisor.store() as store:
        explained = [d.detail.get("explanation", "") for d in store.decisions_for(str(run.job_id))]
    (released,) = [e for e in explained if e.startswith(f"spare {SPARE} lost")]
    assert f"health check failed on idle spare {SPARE}" in released, released
    assert "FAIL sh -c" in released and "0 left" in released, released
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    assert f"on {SPARE}" not in run.text()  # no rank ever ran there to report a step
    sizes = [len(a.nodes) for a in attempts(supervisor, run.job_id)]
    assert sizes == [WORLD, WORLD - 1], story(supervisor, run)
    assert run.steps()[STEPS]["world"] == WORLD - 1


@pytest.mark.policy(spare_check_interval_s="0")
def test_a_spare_that_fails_its_health_check_when_swapped_in_never_runs_a_rank(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """With idle checks off, the swap's own gate catches the spare: blamed, and the
    job shrinks instead."""
    check = FAILS_ON_THE_SPARE
    run = submit(
        supervisor, tmp_path, "--fault", f"sigkill@6:{VICTIM}",
        env={"RESURGO_AGENT_HEALTH_CHECK": check},
    )  # fmt: skip
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    with supervisor.store() as store:
        failed = store.events_for(str(run.job_id), kinds=["health_check_failed"])
        heard_from = {e.node for e in store.events_for(str(run.job_id), kinds=["rank_exited"])}
    assert failed and {e.node for e in failed} == {SPARE}, story(supervisor, run)
    assert SPARE not in heard_from
    assert f"on {SPARE}" not in run.text()  # no rank ever ran there to report a step
    last = attempts(supervisor, run.job_id)[-1]
    assert SPARE not in last.nodes and len(last.nodes) == WORLD - 1, story(supervisor, run)
    assert run.steps()[STEPS]["world"] == WORLD - 1
