"""A job's timeline read back from a real SQLite store, and the goodput it gives."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor.goodput import Badput
from supervisor.store import Store
from supervisor.timeline import CHECKPOINT_STATS_KIND, goodput_of, node_faults

JOB = "4711"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store.open(tmp_path / "resurgo.db")
    store.upsert_job(
        JOB, state="submitted", record={}, now_s=0.0, name="llm", original_nodes=4, min_nodes=2
    )
    return store


def _decide(store: Store, at: float, source: str, target: str, cause: str = "none") -> None:
    store.record_decision(JOB, None, source, target, cause, {"explanation": ""}, at)


def test_a_killed_rank_costs_detection_lost_work_and_recovery(store: Store) -> None:
    _decide(store, 10, "submitted", "starting")
    store.start_attempt(JOB, 1, nodes=["n1", "n2"], resumed_from=None, now_s=10)
    for at, step in ((20, 1), (30, 5), (40, 10)):
        store.record_progress(JOB, step, at)
    store.record_observation(JOB, CHECKPOINT_STATS_KIND, {"stall_s": 0.5}, 30.0)
    _decide(store, 45, "running", "recovering")  # the exit window opens
    _decide(store, 48, "recovering", "recovering", "rank_signal")  # the root cause
    _decide(store, 55, "recovering", "relaunching", "rank_signal")
    store.start_attempt(JOB, 2, nodes=["n1"], resumed_from="/ckpt/step-5", now_s=55)
    store.record_progress(JOB, 6, 70)
    _decide(store, 100, "running", "completed", "slurm_ended")

    goodput = goodput_of(store, JOB, now_s=500)

    assert goodput.wall_s == 100
    assert goodput.badput_s[Badput.QUEUE_WAIT] == 10
    assert goodput.badput_s[Badput.STARTUP] == 10
    assert goodput.badput_s[Badput.DETECTION] == 5  # last progress at 40, detected at 45
    assert goodput.badput_s[Badput.LOST_WORK] == 9.5  # step 5 (t=30) to the fault, less a stall
    assert goodput.badput_s[Badput.RECOVERY] == 25  # detected at 45, training again at 70
    assert goodput.badput_s[Badput.CHECKPOINT_STALL] == 0.5
    assert goodput.by_fault_cause_s["rank_signal"] == pytest.approx(39.5)
    assert node_faults(store) == [45]


def test_a_running_job_is_accounted_up_to_now_and_a_user_error_is_no_node_fault(
    store: Store,
) -> None:
    _decide(store, 10, "submitted", "running")
    store.record_progress(JOB, 1, 12)
    _decide(store, 20, "running", "recovering", "user_exception")
    goodput = goodput_of(store, JOB, now_s=50)
    assert goodput.wall_s == 50
    assert goodput.badput_s[Badput.RECOVERY] == 30
    assert node_faults(store) == []
