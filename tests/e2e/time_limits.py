"""Jobs that cross their time limit: raising the limit as an operator would, waiting for the end.

Shared by ``test_time_limit.py`` and ``test_frameworks.py``. A job here is
named by its id and output file (not the demo trainer's ``Run`` of
:mod:`tests.e2e.jobs`); :func:`tests.e2e.jobs.ended` waits for its end.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

from tests.conftest import LiveCluster

RAISED_LIMIT_MIN = 10


def raise_limit_after_crossings(
    cluster: LiveCluster,
    job_id: int,
    crossings: int,
    counted: Callable[[], int] | None = None,
) -> None:
    """Once the job crossed its limit ``crossings`` times, raise it (as root) so that
    the allocation running or next finishes the training. The driver reads the time
    left again before its planned stop, so a running allocation takes the new limit
    unless its stop has begun: then the next one does.

    A crossing is a requeue, or what ``counted`` counts when given: on a loaded
    machine an allocation's start-up can take all its time, and a test about
    resuming counts only the crossings that left something to resume from."""

    def crossed() -> bool:
        if counted is not None:
            return counted() >= crossings
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
