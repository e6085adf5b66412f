"""The fault matrix, end to end, on the live 4-node cluster.

Each test runs ``resurgo-supervisor``, submits the demo trainer with
``resurgo submit``, injects one kind of fault, and checks the outcome: the
right node drained (or none), the resume from the newest valid checkpoint,
the final step reached, and against an unfaulted reference run of the same
job, the exact global sample of every step (every resume) and bitwise-equal
final parameters (same-size resumes). A straggler slows every rank of a
synchronous job alike; the supervisor names it from the ranks' own compute
times, alerts, and drains it only when the policy says so. Already covered
elsewhere, on the same
cluster: a corrupted newest checkpoint, the crash loop and the supervisor
SIGKILLed during a recovery (tests/integration/test_recovery_live.py).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from supervisor.store import EventSource
from tests.conftest import CLUSTER_SCRIPT, LiveCluster
from tests.e2e.jobs import (
    STEPS,
    Run,
    assert_resumed_from,
    assert_same_samples,
    attempts,
    drained,
    finish,
    story,
    submit,
    supervisor_state,
    unfaulted,
)
from tests.supervisor_harness import SupervisorProcess

pytestmark = pytest.mark.slurm


def agents_of(job_id: int) -> str:
    """The job's node agents as the OS sees them, each with its Python stack: what an
    agent that went quiet was doing."""
    lines = []
    for process in psutil.process_iter(["pid", "cmdline", "status"]):
        cmdline = process.info["cmdline"] or []
        if "agent.node.agent" not in cmdline:
            continue
        try:
            environ = process.environ()
        except psutil.Error:
            continue
        if environ.get("SLURM_JOB_ID") != str(job_id):
            continue
        dump = subprocess.run(
            [str(Path(sys.executable).with_name("py-spy")), "dump", "--pid", str(process.pid)],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        lines.append(
            f"agent pid {process.pid} on {environ.get('SLURMD_NODENAME')}: "
            f"{process.info['status']}\n{dump.stdout or dump.stderr}"
        )
    return "\n".join(lines) or "no agent process of the job is left"


@pytest.fixture(scope="module")
def reference(slurm_cluster: LiveCluster, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The same job without faults, on 4 nodes: the samples and parameters to match."""
    return unfaulted(slurm_cluster, tmp_path_factory)


def test_a_sigkilled_rank_drains_its_node_and_the_job_resumes_on_three(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    run = submit(supervisor, tmp_path, "--fault", "sigkill@6:2")
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    (victim,) = run.faulted_nodes()
    assert drained(supervisor, run.job_id) == [(victim, "rank_signal")], story(supervisor, run)
    assert_resumed_from(supervisor, run, 4)
    assert victim not in attempts(supervisor, run.job_id)[-1].nodes
    assert run.steps()[STEPS]["world"] == 3
    assert_same_samples(run, reference)


def test_an_instrumented_hang_is_blamed_on_the_stopped_ranks_node(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    run = submit(supervisor, tmp_path, "--fault", "hang@6:2")
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    (victim,) = run.faulted_nodes()
    assert drained(supervisor, run.job_id) == [(victim, "hang")], story(supervisor, run)
    assert_resumed_from(supervisor, run, 4)
    assert_same_samples(run, reference)


def test_an_uninstrumented_hang_is_found_from_stacks(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    # No step signal at all: no heartbeats, and no automatic progress either.
    run = submit(
        supervisor, tmp_path, "--no-heartbeat", "--fault", "hang@6:2",
        env={"RESURGO_AUTO_PROGRESS": "0"},
    )  # fmt: skip
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    (victim,) = run.faulted_nodes()
    assert drained(supervisor, run.job_id) == [(victim, "hang")], story(supervisor, run)
    with supervisor.store() as store:
        hangs = store.events_for(str(run.job_id), kinds=["hang"])
        assert any(h["detector"] == "stack" for e in hangs for h in e.payload["hung"])
    assert_same_samples(run, reference)


@pytest.mark.parametrize(
    ("lost", "requeued"),
    # node1 runs the batch script, and with it the job's heartbeat aggregator: the
    # requeue path, found by Slurm first (the supervisor paused) or by either.
    [("node3", False), ("node1", True), ("node1", False)],
    ids=["compute-node", "batch-host-slurm-requeues-first", "batch-host-with-its-aggregator"],
)
@pytest.mark.long  # over a minute in CI: started before the short tests
def test_a_lost_node_is_excluded_and_the_job_resumes_without_it(
    slurm_cluster: LiveCluster,
    supervisor: SupervisorProcess,
    reference: Run,
    tmp_path: Path,
    lost: str,
    requeued: bool,
) -> None:
    """A lost compute node is the supervisor's to find. A lost batch host is also
    Slurm's: here Slurm requeues the job before the supervisor sees anything (it is
    paused), as it does whenever the supervisor is slow or every agent went silent at
    once. Slurm's requeue still asks for four nodes; the supervisor resizes it.
    The batch host is the first node: it runs the job's heartbeat aggregator and hosts
    the rendezvous store, so its loss ends every other node's torchrun too; with the
    supervisor watching, those launchers' exits must not take the blame from it."""
    run = submit(supervisor, tmp_path, "--fault", "idle@6:*")
    slurm_cluster.wait_for("step 6", lambda: "injecting idle at step 6" in run.text(), 180)
    aggregated = f"job {run.job_id}: heartbeats arrive through the job's aggregator"
    slurm_cluster.wait_for("aggregated heartbeats", lambda: aggregated in supervisor.log(), 60)
    assert supervisor.process is not None
    if requeued:
        supervisor.process.send_signal(signal.SIGSTOP)
    try:
        subprocess.run([str(CLUSTER_SCRIPT), "kill-node", lost], env=slurm_cluster.env, check=True)
        if requeued:
            slurm_cluster.wait_job_state(run.job_id, {"PENDING"}, timeout_s=120)
    finally:
        supervisor.process.send_signal(signal.SIGCONT)
    batch_host_lost = lost == "node1"
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    if batch_host_lost:
        assert job["restart_cnt"] >= 1, story(supervisor, run)  # the batch script ran again
        with supervisor.store() as store:
            causes = [d.cause for d in store.decisions_for(str(run.job_id))]
        # Slurm's requeue adopted, or - when the supervisor's first poll after the pause
        # straddled it (squeue read before, sinfo after) - the node's loss recovered and
        # the job Slurm already requeued resized: never a requeue on top of Slurm's.
        # Watching, the supervisor may find the loss first and requeue the job itself.
        assert {"slurm_requeue", "node_lost"} & set(causes), story(supervisor, run)
        if requeued:
            requeued_by_us = f"scontrol requeuehold {run.job_id}"
            assert requeued_by_us not in supervisor.log(), story(supervisor, run)
    elif job["restart_cnt"] >= 1:
        # The shrunk step could not start (Slurm kept the nodes of the dead node's
        # step busy): the supervisor fell back to the requeue path, as it must.
        with supervisor.store() as store:
            causes = [d.cause for d in store.decisions_for(str(run.job_id))]
        assert "relaunch_failed" in causes, story(supervisor, run)
    last = attempts(supervisor, run.job_id)[-1]
    assert lost not in last.nodes and len(last.nodes) == 3
    assert last.resumed_from == str(run.ckpt / "step-4")
    node = slurm_cluster.nodes()[lost]
    # Slurm takes a dead node out by itself (DOWN); Resurgo drains it when Slurm has not.
    assert node["state"] == "down" or "DRAIN" in node["state_flags"], node
    assert_same_samples(run, reference)


def process_of(job_id: int, module: str) -> psutil.Process:
    """The job's process running ``python -m module`` (the first found)."""
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if module not in cmdline or cmdline[cmdline.index(module) - 1] != "-m":
            continue
        try:
            if process.environ().get("SLURM_JOB_ID") == str(job_id):
                return process
        except psutil.Error:
            continue
    raise AssertionError(f"no `python -m {module}` process of job {job_id}")


def test_agents_whose_aggregator_stops_answering_report_straight_and_training_goes_on(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    """The job's heartbeat aggregator lives in the in-job driver on the batch host. When
    it stops answering (the driver wedged, its host unreachable) while the ranks train
    on, every agent sends its heartbeats and its routine events (the step reports, the
    checkpoints it relayed) straight to the supervisor: no agent goes silent, no event
    waits, nothing is recovered, and the run is the unfaulted one."""
    run = submit(supervisor, tmp_path, "--step-s", "3")  # 16 steps: 48 s of training
    aggregated = f"job {run.job_id}: heartbeats arrive through the job's aggregator"
    slurm_cluster.wait_for("aggregated heartbeats", lambda: aggregated in supervisor.log(), 120)
    slurm_cluster.wait_for(
        "training", lambda: supervisor_state(supervisor, run.job_id) == "running", 120
    )
    driver = process_of(run.job_id, "agent.driver")
    straight = rf"job {run.job_id}: node (\S+)'s agent reports straight to the supervisor"

    def step_reports_since(since_s: float) -> int:
        """Step reports (rank 0's node sends them) the supervisor stored after ``since_s``."""
        with supervisor.store() as store:
            rows = store.events_for(str(run.job_id), kinds=["step_losses"])
        return sum(row.received_s > since_s for row in rows)

    slurm_cluster.wait_for(
        "step reports relayed", lambda: step_reports_since(time.time() - 10), timeout_s=60
    )
    driver.send_signal(signal.SIGSTOP)
    stopped_s = time.time()
    try:
        slurm_cluster.wait_for(
            "every agent reporting straight",
            lambda: len({*re.findall(straight, supervisor.log())}) == 4,
            timeout_s=30,
        )
        # The step reports go on reaching the supervisor without the aggregator.
        slurm_cluster.wait_for(
            "step reports sent straight", lambda: step_reports_since(stopped_s + 1.0) >= 2, 30
        )
        time.sleep(5)
        silent = [line for line in supervisor.log().splitlines()
                  if f"job {run.job_id}:" in line and "silent" in line]  # fmt: skip
        assert not silent, story(supervisor, run)
        assert supervisor_state(supervisor, run.job_id) == "running", story(supervisor, run)
    except AssertionError as missing:
        raise AssertionError(
            f"{missing}\n--- the job's agents now ---\n{agents_of(run.job_id)}\n"
            f"{story(supervisor, run)}"
        ) from None
    finally:
        driver.send_signal(signal.SIGCONT)
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    assert job["restart_cnt"] == 0 and len(attempts(supervisor, run.job_id)) == 1
    assert drained(supervisor, run.job_id) == [], story(supervisor, run)
    assert_same_samples(run, reference)


def test_a_python_exception_once_is_retried_on_the_same_nodes_bitwise(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    run = submit(supervisor, tmp_path, "--fault", "exception@6:1")
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    assert drained(supervisor, run.job_id) == [], story(supervisor, run)
    assert len(attempts(supervisor, run.job_id)) == 2
    assert_resumed_from(supervisor, run, 4)
    assert run.steps()[STEPS]["world"] == 4
    assert_same_samples(run, reference)
    final, expected = run.final(), reference.final()
    assert final.keys() == expected.keys()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name
    with supervisor.store() as store:
        checks = store.events_for(str(run.job_id), kinds=["resume_verification"])
        assert [c.payload["verified"] for c in checks] == [True], checks


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_two_faults_in_a_row_shrink_the_job_twice(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    run = submit(supervisor, tmp_path, "--fault", "sigkill@6:1", "--fault", "sigkill@10:2")
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    victims = run.faulted_nodes()
    assert len(victims) == 2
    expected = sorted((victim, "rank_signal") for victim in victims)
    assert sorted(drained(supervisor, run.job_id)) == expected, story(supervisor, run)
    sizes = [len(a.nodes) for a in attempts(supervisor, run.job_id)]
    assert sizes == [4, 3, 2]
    assert_resumed_from(supervisor, run, 8)
    assert run.steps()[STEPS]["world"] == 2
    assert_same_samples(run, reference)


def straggler_reports(supervisor: SupervisorProcess, run: Run) -> list[tuple[str, int]]:
    """(node, rank) of every straggler the supervisor found, from its own observations."""
    with supervisor.store() as store:
        found = store.events_for(str(run.job_id), kinds=["straggler"])
    return [(e.node, e.payload["global_rank"]) for e in found if e.source is EventSource.SUPERVISOR]


def test_a_straggler_is_found_across_nodes_and_alerted_but_not_drained(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    """Synchronous training: every rank's step is as slow as rank 2's; its compute time is not."""
    run = submit(supervisor, tmp_path, "--fault", "slow@2:2")
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    (victim,) = run.faulted_nodes()
    reports = straggler_reports(supervisor, run)
    assert reports and set(reports) == {(victim, 2)}, story(supervisor, run)
    with supervisor.store() as store:
        alerts = [a.payload["message"] for a in store.events_for(str(run.job_id), kinds=["alert"])]
    assert len(alerts) == 1 and f"straggler on {victim}" in alerts[0], alerts
    # Slow is not broken: straggler_drain is off.
    assert drained(supervisor, run.job_id) == [], story(supervisor, run)
    assert len(attempts(supervisor, run.job_id)) == 1
    assert_same_samples(run, reference)
    final, expected = run.final(), reference.final()
    for name in expected:
        assert torch.equal(final[name], expected[name]), name


@pytest.mark.policy(straggler_drain="true", straggler_reports_to_drain="2")
def test_a_persistent_straggler_is_drained_when_the_policy_says_so(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    run = submit(supervisor, tmp_path, "--fault", "slow@2:2")
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    (victim,) = run.faulted_nodes()
    assert drained(supervisor, run.job_id) == [(victim, "straggler")], story(supervisor, run)
    last = attempts(supervisor, run.job_id)[-1]
    assert victim not in last.nodes and len(last.nodes) == 3
    assert run.steps()[STEPS]["world"] == 3
    assert_same_samples(run, reference)


def test_the_demo_trainer_resumes_fsdp2_state_across_a_resize(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, reference: Run, tmp_path: Path
) -> None:
    """FSDP2 shards saved by 4 ranks, loaded by 3: the trainer says it loaded step 4
    on 3 ranks, the replayed step's loss continues the interrupted run's, every
    step trains on the reference's global samples, and only the culprit is
    drained."""
    run = submit(supervisor, tmp_path, "--model", "fsdp", "--fault", "sigkill@6:3")
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    (victim,) = run.faulted_nodes()
    assert drained(supervisor, run.job_id) == [(victim, "rank_signal")], story(supervisor, run)
    starts = re.findall(r"toy: world (\d+), starting at step (\d+)(?: from (\S+))?", run.text())
    assert starts == [("4", "0", ""), ("3", "4", str(run.ckpt / "step-4"))], starts
    assert run.steps()[STEPS]["world"] == 3  # sharded model and optimizer loaded on 3 ranks
    assert_same_samples(run, reference)
    # Step 5 ran twice: on 4 ranks before the kill, on 3 after the load. The model
    # has dropout, whose masks follow the ranks' samples, so the two differ by
    # about 1% (measured: 10.31 and 10.26); the step-to-step spread is 2-10x.
    records = [json.loads(line) for line in (run.record / "steps.jsonl").read_text().splitlines()]
    first, replayed = [r["loss"] for r in records if r["step"] == 5][:2]
    assert replayed == pytest.approx(first, rel=0.05), (first, replayed)
