"""Observe-only mode on the live cluster: every decision recorded, nothing done in Slurm.

An admin trying Resurgo beside a production cluster runs the supervisor with
``observe_only``. A hung rank, and then that rank SIGKILLed, are decided on as
when acting (the stop of the ranks, the drain), each recorded as what it would
have done; Slurm shows no drain and no requeue, and the job hangs, then ends,
as it would without Resurgo.
"""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ENDED, LiveCluster
from tests.e2e.jobs import Run, story, submit
from tests.supervisor_harness import SupervisorProcess

pytestmark = [pytest.mark.slurm, pytest.mark.daemon_env(RESURGO_SUPERVISOR_OBSERVE_ONLY="yes")]


def would(supervisor: SupervisorProcess, run: Run) -> list[str]:
    """What the supervisor recorded it would have done for the job, oldest first."""
    with supervisor.store() as store:
        return [e.payload["would"] for e in store.events_for(str(run.job_id), kinds=["would_act"])]


def assert_slurm_untouched(cluster: LiveCluster, run: Run) -> None:
    """No node drained, and the job never requeued."""
    drained = {
        name: node.get("reason", "")
        for name, node in cluster.nodes().items()
        if "DRAIN" in node.get("state_flags", [])
    }
    assert drained == {}, drained
    job = cluster.job(run.job_id)
    assert job is not None and job["restart_cnt"] == 0, job


def test_a_hang_then_its_rank_killed_are_decided_on_and_nothing_is_done(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """A rank hangs: the stop of the ranks and the drain are recorded, not done; the job
    keeps hanging, as it would without Resurgo. Then the hung rank is SIGKILLed (as an
    operator would): the step fails and the job ends with it, never requeued."""
    run = submit(supervisor, tmp_path, "--fault", "hang@6:2")
    slurm_cluster.wait_for(
        "the would-be drain after the hang",
        lambda: any(w.startswith("drain ") for w in would(supervisor, run)),
        timeout_s=180,
    )
    (victim,) = run.faulted_nodes()
    acts = would(supervisor, run)
    told = story(supervisor, run) + "\n--- would ---\n" + "\n".join(acts)
    assert any(w.startswith("stop every rank of the job") for w in acts), told
    assert any(w.startswith(f"drain {victim} (hang)") for w in acts), told
    job = slurm_cluster.job(run.job_id)
    assert job is not None and job["job_state"] == "RUNNING", told
    assert_slurm_untouched(slurm_cluster, run)
    with supervisor.store() as store:
        # Every action (the agents' stop command among them) was recorded, not done.
        acted = [a for a in store.list_actions(str(run.job_id)) if a.kind != "validate"]
        assert acted and all(a.result and a.result["observe_only"] for a in acted), acted
        hangs = store.events_for(str(run.job_id), kinds=["hang"])
    (hung_pid,) = {
        h["pid"] for e in hangs if e.node == victim for h in e.payload["hung"]
    }  # the ranks run on this machine: the local cluster's nodes share it
    os.kill(hung_pid, signal.SIGKILL)
    job = slurm_cluster.wait_job_state(run.job_id, ENDED, timeout_s=180)
    told = story(supervisor, run) + "\n--- would ---\n" + "\n".join(would(supervisor, run))
    assert job["job_state"] == "FAILED", told
    assert "observe-only: the step ended with exit code" in run.text(), told
    assert_slurm_untouched(slurm_cluster, run)
    with supervisor.store() as store:
        outcomes = [(b.node, b.outcome.value) for b in store.blames_since(0)]
        assert store.open_drains() == []
    assert outcomes == [(victim, "would_drain")], told
    health = json.loads(urllib.request.urlopen(f"{supervisor.url}/healthz", timeout=10).read())
    assert health["observe_only"] is True
    shown = supervisor.resurgo("status", str(run.job_id))
    assert "supervisor in observe-only mode" in shown.stdout, shown.stdout
