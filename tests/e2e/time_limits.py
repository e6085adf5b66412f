"""Jobs that cross their time limit: raising the limit as an operator would, waiting for the end.

Shared by ``test_time_limit.py`` and ``test_frameworks.py``. A job here is
named by its id and output file (not the demo trainer's ``Run`` of
:mod:`tests.e2e.jobs`), and a failed wait shows the supervisor's log too.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import ENDED, LiveCluster
from tests.supervisor_harness import SupervisorProcess

RAISED_LIMIT_MIN = 10


def raise_limit_after_crossings(cluster: LiveCluster, job_id: int, crossings: int) -> None:
    """Once the job was requeued ``crossings`` times, raise its limit (as root) so that
    the allocation running or next finishes the training. The driver reads the time
    left again before its planned stop, so a running allocation takes the new limit
    unless its stop has begun: then the next one does."""

    def crossed() -> bool:
        job = cluster.job(job_id)
        return job is not None and job["restart_cnt"] >= crossings

    cluster.wait_for(f"job {job_id} requeued {crossings} times", crossed, timeout_s=420)

    def raised() -> bool:
        done = subprocess.run(
            ["scontrol", "update", f"JobId={job_id}", f"TimeLimit={RAISED_LIMIT_MIN}"],
            env=cluster.env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        return done.returncode == 0

    cluster.wait_for(f"job {job_id}'s limit raised", raised, timeout_s=60)


def finish(cluster: LiveCluster, supervisor: SupervisorProcess, job_id: int, output: Path) -> dict:  # type: ignore[type-arg]
    """Wait until Slurm ended the job and the supervisor recorded it; return Slurm's record."""
    try:
        job = cluster.wait_job_state(job_id, ENDED, timeout_s=480)
        cluster.wait_for(
            "the supervisor to record the end",
            lambda: job_state(supervisor, job_id) in ("completed", "failed", "cancelled"),
            timeout_s=30,
        )
    except AssertionError as error:
        raise AssertionError(f"{error}\n{job_story(supervisor, job_id, output)}") from None
    return job


def job_state(supervisor: SupervisorProcess, job_id: int) -> str | None:
    """The job's state in the supervisor's store, or None before it registered the job."""
    with supervisor.store() as store:
        row = store.get_job(str(job_id))
        return None if row is None else row.state


def job_story(supervisor: SupervisorProcess, job_id: int, output: Path) -> str:
    """The job's decisions, its output's tail and the supervisor's: what a failed wait shows."""
    with supervisor.store() as store:
        decisions = [
            f"{d.from_state}->{d.to_state} [{d.cause}] {d.detail.get('explanation', '')}"
            for d in store.decisions_for(str(job_id))
        ]
    text = output.read_text(errors="replace") if output.exists() else ""
    return "\n".join(
        ["--- decisions ---", *decisions, "--- job ---", text[-5000:], "--- supervisor ---",
         supervisor.log()[-4000:]]
    )  # fmt: skip
