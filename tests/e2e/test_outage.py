"""Supervisor outages on the live 4-node cluster: one recovery for one fault, none for silence.

A supervisor SIGKILLed just before a rank dies comes back after 60 s: the
agents kept the rank's exit spooled (their ranks gone, they wait to deliver
it), so exactly the culprit's node is drained, as without the outage, and the
job resumes from its newest committed checkpoint. A
supervisor paused for 60 s while training goes on hears nothing from any
agent: one common silence, no drain, no restart.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.checkpoint.format import MARKER_NAME
from tests.conftest import LiveCluster
from tests.e2e.jobs import (
    AGENTS,
    DAEMON,
    POLICY,
    Run,
    attempts,
    drained,
    finish,
    story,
    submit,
)
from tests.supervisor_harness import SupervisorProcess, rank_pids

# Minutes of waiting (limits, outages): started first, so other tests fill the wait.
pytestmark = [pytest.mark.slurm, pytest.mark.long]

VICTIM = "node2"
# Longer than every window an outage could cross: the agents' longest wait between
# two tries (agent.wire.protocol.RETRY_MAX_S, 10 s), the lease (8 s here), the exit
# evidence window (20 s). What would end the wait comes much later: the driver's
# wait for an answer (600 s) and the agents' drain timeout (30 min). A longer outage
# (120 s was also run) crosses no further window, so it proves nothing more.
OUTAGE_S = 60


@pytest.fixture
def supervisor(slurm_cluster: LiveCluster, tmp_path: Path) -> Iterator[SupervisorProcess]:
    """The supervisor under test; at the end its jobs are cancelled and its drains undone
    (only its own: other jobs may share the cluster)."""
    process = SupervisorProcess(slurm_cluster, tmp_path / "state", POLICY, AGENTS | DAEMON)
    process.start()
    try:
        yield process
    finally:
        if process.process is not None and process.process.poll() is None:
            process.process.send_signal(signal.SIGCONT)
        process.stop()
        with process.store() as store:
            jobs = [row.job_id for row in store.list_jobs()]
            nodes = {drain.node for drain in store.drains_since(0)}
        for argv in [
            *(["scancel", job_id] for job_id in jobs),
            *(["scontrol", "update", f"nodename={node}", "state=resume"] for node in sorted(nodes)),
        ]:
            subprocess.run(
                argv, env=slurm_cluster.env, capture_output=True, timeout=30, check=False
            )


def committed_steps(run: Run) -> list[int]:
    return sorted(
        int(path.name.split("-")[1])
        for path in run.ckpt.glob("step-*")
        if (path / MARKER_NAME).exists()
    )


def starts(run: Run) -> list[tuple[int, str]]:
    """What rank 0 loaded at each start: (step, checkpoint path or '')."""
    return [
        (int(step), origin)
        for step, origin in re.findall(
            r"toy: world \d+, starting at step (\d+)(?: from (\S+))?", run.text()
        )
    ]


def ranks_of(run: Run, node: str) -> list[int]:
    """Pids of ``run``'s training ranks on ``node`` (not another job's on the shared cluster)."""
    mine = f"SLURM_JOB_ID={run.job_id}".encode()
    found = []
    for pid in rank_pids(node):
        with contextlib.suppress(OSError):
            if mine in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def wait_training(cluster: LiveCluster, run: Run, step: int) -> None:
    cluster.wait_for(
        f"step {step} committed and every node training",
        lambda: (
            step in committed_steps(run) and all(ranks_of(run, f"node{i}") for i in range(1, 5))
        ),
        timeout_s=180,
    )


def test_a_rank_killed_while_the_supervisor_is_down_drains_only_its_node(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    run = submit(supervisor, tmp_path, "--step-s", "1")
    wait_training(slurm_cluster, run, 4)
    supervisor.kill()
    killed_at = time.monotonic()
    time.sleep(5)
    os.kill(ranks_of(run, VICTIM)[0], signal.SIGKILL)
    time.sleep(3)  # the rank's peers fail their collective; nothing more is committed
    newest = committed_steps(run)[-1]
    time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - killed_at)))  # time is the subject
    supervisor.stop()  # closes the log the killed process had open
    supervisor.start()
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    assert drained(supervisor, run.job_id) == [(VICTIM, "rank_signal")], story(supervisor, run)
    resumed = starts(run)[-1]
    assert resumed == (newest, str(run.ckpt / f"step-{newest}")), story(supervisor, run)
    assert attempts(supervisor, run.job_id)[-1].resumed_from == resumed[1]
    assert VICTIM not in attempts(supervisor, run.job_id)[-1].nodes


def test_every_agent_silent_for_60_s_at_once_drains_nothing_and_restarts_nothing(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    run = submit(supervisor, tmp_path, "--step-s", "5")
    wait_training(slurm_cluster, run, 4)
    assert supervisor.process is not None
    supervisor.process.send_signal(signal.SIGSTOP)
    try:
        time.sleep(60)
    finally:
        supervisor.process.send_signal(signal.SIGCONT)
    job = finish(slurm_cluster, supervisor, run)
    assert job["job_state"] == "COMPLETED", story(supervisor, run)
    assert drained(supervisor, run.job_id) == [], story(supervisor, run)
    assert len(attempts(supervisor, run.job_id)) == 1, story(supervisor, run)
    assert [step for step, _ in starts(run)] == [0], story(supervisor, run)
