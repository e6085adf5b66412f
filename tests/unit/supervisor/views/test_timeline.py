"""A job's timeline read back from a real SQLite store, and the goodput it gives."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.core.goodput import Badput, account
from supervisor.metrics import recovery_durations
from supervisor.store import Store
from supervisor.views.timeline import (
    CHECKPOINT_STATS_KIND,
    JobTimeline,
    goodput_of,
    node_faults,
    timeline_of,
)

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


@pytest.mark.parametrize(("resumed_step", "lost_s"), [(5, 10.0), (1, 20.0)])
def test_a_script_with_its_own_checkpoint_loses_the_work_since_the_step_it_resumed_at(
    store: Store, resumed_step: int, lost_s: float
) -> None:
    """No checkpoint of ours: the relaunch's first progress sample says where the script
    resumed (step 5 from its own file; step 1: it started over)."""
    _decide(store, 10, "submitted", "starting")
    store.start_attempt(JOB, 1, nodes=["n1", "n2"], resumed_from=None, now_s=10)
    for at, step in ((20, 1), (30, 5), (40, 10)):
        store.record_progress(JOB, step, at)
    _decide(store, 45, "running", "recovering", "hang")
    _decide(store, 55, "recovering", "relaunching", "hang")
    store.start_attempt(JOB, 2, nodes=["n1"], resumed_from=None, now_s=55)
    store.record_progress(JOB, resumed_step, 70)
    _decide(store, 100, "running", "completed", "slurm_ended")
    goodput = goodput_of(store, JOB, now_s=500)
    assert goodput.badput_s[Badput.LOST_WORK] == lost_s


def test_a_requeue_slurm_made_itself_charges_its_lost_work_to_the_requeues_cause(
    store: Store,
) -> None:
    """The driver requeued its own job at the time limit (its ranks were slow to stop):
    the supervisor adopted the requeue, straight from running. The steps since the
    checkpoint the next allocation resumed from are lost to the time limit."""
    _decide(store, 10, "submitted", "starting")
    store.start_attempt(JOB, 1, nodes=["n1", "n2"], resumed_from=None, now_s=10)
    for at, step in ((20, 1), (30, 20), (40, 30)):
        store.record_progress(JOB, step, at)
    _decide(store, 45, "running", "requeued", "time_limit")
    _decide(store, 60, "requeued", "starting")
    store.start_attempt(JOB, 2, nodes=["n1", "n2"], resumed_from="/out/checkpoint-20", now_s=60)
    store.record_progress(JOB, 21, 70)
    _decide(store, 100, "running", "completed", "slurm_ended")
    goodput = goodput_of(store, JOB, now_s=500)
    assert goodput.badput_s[Badput.LOST_WORK] == 10  # step 20 (t=30) to the last step
    assert goodput.badput_s[Badput.QUEUE_WAIT] == 10 + 15  # submitted, and requeued
    assert set(goodput.by_fault_cause_s) == {"time_limit"}


def test_a_rank_dead_in_its_teardown_after_the_last_step_costs_shutdown_not_a_fault(
    store: Store,
) -> None:
    """The exit window a teardown abort opens ends the job completed: the time from the
    last step to the end is the shutdown's, no restart cause is charged."""
    _decide(store, 10, "submitted", "starting")
    store.start_attempt(JOB, 1, nodes=["n1", "n2"], resumed_from=None, now_s=10)
    for at, step in ((20, 1), (40, 80)):
        store.record_progress(JOB, step, at)
    _decide(store, 45, "running", "recovering", "rank_signal")  # the window opens
    _decide(store, 65, "recovering", "completed", "none")  # every rank had finished
    goodput = goodput_of(store, JOB, now_s=500)
    assert goodput.by_fault_cause_s == {}
    assert goodput.badput_s[Badput.SHUTDOWN] == 25  # the last step (t=40) to the end
    assert goodput.badput_s[Badput.DETECTION] == goodput.badput_s[Badput.RECOVERY] == 0


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


def _history(store: Store) -> None:
    """Two faults (one through a requeue), save stalls, and a job still training at 400."""
    _decide(store, 10, "submitted", "starting")
    store.start_attempt(JOB, 1, nodes=["n1", "n2"], resumed_from=None, now_s=10)
    for at in range(20, 120, 7):
        store.record_progress(JOB, at // 7, at)
        if at % 3 == 0:
            store.record_observation(JOB, CHECKPOINT_STATS_KIND, {"stall_s": 0.25}, at + 1.0)
    _decide(store, 125, "running", "recovering")
    _decide(store, 128, "recovering", "recovering", "rank_signal")
    _decide(store, 140, "recovering", "relaunching", "rank_signal")
    store.start_attempt(JOB, 2, nodes=["n1"], resumed_from="/ckpt/step-9", now_s=140)
    for at in range(150, 250, 5):
        store.record_progress(JOB, 9 + (at - 150) // 5, at)
    _decide(store, 252, "running", "recovering", "hang")
    _decide(store, 260, "recovering", "requeued", "hang")
    _decide(store, 300, "requeued", "starting")
    store.start_attempt(JOB, 3, nodes=["n2", "n3"], resumed_from="/ckpt/step-20", now_s=300)
    for at in range(320, 400, 4):
        store.record_progress(JOB, 20 + (at - 320) // 4, at)
        if at % 5 == 0:
            store.record_observation(JOB, CHECKPOINT_STATS_KIND, {"stall_s": 0.5}, at + 0.5)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.floats(min_value=0, max_value=420), max_size=12), st.sampled_from([0.0, 5.0]))
def test_the_incremental_timeline_gives_what_walking_the_whole_history_gives(
    tmp_path_factory: pytest.TempPathFactory, scrapes: list[float], settle_s: float
) -> None:
    """However the scrapes fall, the metrics' per-job timeline ends where timeline_of does."""
    with Store.open(tmp_path_factory.mktemp("store") / "resurgo.db") as store:
        store.upsert_job(
            JOB, state="running", record={}, now_s=0.0, name="llm", original_nodes=4, min_nodes=2
        )
        _history(store)
        timeline = JobTimeline(JOB, settle_s=settle_s)
        for now in sorted(scrapes):
            timeline.advance(store, now)
        now = 500.0
        timeline.advance(store, now)
        facts = timeline_of(store, JOB, now)
        expected = account(facts)
        got = timeline.goodput(now)
        assert got.wall_s == pytest.approx(expected.wall_s)
        assert got.productive_s == pytest.approx(expected.productive_s)
        for kind in Badput:
            assert got.badput_s[kind] == pytest.approx(expected.badput_s[kind]), kind
        assert got.by_fault_cause_s == pytest.approx(expected.by_fault_cause_s)
        detect, recover = recovery_durations(facts)
        assert timeline.durations.detect_s == pytest.approx(detect)
        assert timeline.durations.recover_s == pytest.approx(recover)
        assert timeline.latest_step == 39
        assert expected.badput_s[Badput.LOST_WORK] > 0 and expected.badput_s[Badput.QUEUE_WAIT] > 0


@pytest.mark.parametrize(
    ("resume_step", "lost_s"),
    [(6, 15.0), (7, 10.0)],
    ids=["reached at the run's start", "reached at the summary's end"],
)
def test_a_timeline_from_a_summary_reads_back_the_run_its_next_resume_ends(
    store: Store, resume_step: int, lost_s: float
) -> None:
    """Kept after a scrape at 65 s (up to 60 s) in the run that resumed at 55 s: the
    next resume's lost work starts where that run reached the resume's step, a row the
    restored timeline never fed itself (the run's first, at 55 s, or the one at 60 s)."""
    _decide(store, 10, "submitted", "starting")
    store.start_attempt(JOB, 1, nodes=["n1"], resumed_from=None, now_s=10)
    for at, step in ((20, 1), (30, 5), (40, 10)):
        store.record_progress(JOB, step, at)
    _decide(store, 45, "running", "recovering", "rank_signal")
    _decide(store, 50, "recovering", "relaunching", "rank_signal")
    store.start_attempt(JOB, 2, nodes=["n1"], resumed_from="/ckpt/step-5", now_s=55)
    for at, step in ((55, 6), (60, 7)):
        store.record_progress(JOB, step, at)
    before = JobTimeline(JOB)
    before.advance(store, 65.0)
    summary = before.summary()
    assert summary is not None
    store.keep_timeline_summaries([(JOB, 60.0, summary)], 65.0)
    store.record_progress(JOB, 8, 70)
    _decide(store, 75, "running", "recovering", "hang")
    _decide(store, 80, "recovering", "relaunching", "hang")
    store.start_attempt(JOB, 3, nodes=["n1"], resumed_from=f"/ckpt/step-{resume_step}", now_s=85)
    store.record_progress(JOB, resume_step + 1, 90)

    restored = JobTimeline.from_summary(JOB, store.timeline_summaries([JOB])[JOB])
    restored.advance(store, 100.0)

    lost = restored.goodput(100.0).badput_s[Badput.LOST_WORK]
    assert lost == goodput_of(store, JOB, 100.0).badput_s[Badput.LOST_WORK]
    assert lost == 10.0 + lost_s  # the first resume's (step 5 at 30 s to 40 s), then this one's


def test_a_summary_of_another_format_is_not_read(store: Store) -> None:
    _decide(store, 10, "submitted", "starting")
    timeline = JobTimeline(JOB)
    timeline.advance(store, 30.0)
    summary = timeline.summary()
    assert summary is not None
    JobTimeline.from_summary(JOB, summary)
    with pytest.raises(ValueError, match="format 0, this Resurgo reads"):
        JobTimeline.from_summary(JOB, {**summary, "version": 0})
    with pytest.raises(ValueError, match="not a timeline summary"):
        JobTimeline.from_summary(JOB, {"version": summary["version"]})


def test_a_resume_whose_step_its_first_report_gives_waits_for_that_report(store: Store) -> None:
    """The script resumed from its own checkpoint (no step in the name): scraped while
    it loads (no report 20 s after the start), the resume is not taken as from step 0."""
    _decide(store, 10, "submitted", "starting")
    store.start_attempt(JOB, 1, nodes=["n1"], resumed_from=None, now_s=10)
    for at, step in ((20, 1), (30, 5), (40, 10)):
        store.record_progress(JOB, step, at)
    _decide(store, 45, "running", "recovering", "hang")
    _decide(store, 50, "recovering", "relaunching", "hang")
    store.start_attempt(JOB, 2, nodes=["n1"], resumed_from="/ckpt/ckpt.pt", now_s=55)
    timeline = JobTimeline(JOB)
    timeline.advance(store, 80.0)
    assert timeline.upto_s is not None and timeline.upto_s < 55  # the resume waits
    store.record_progress(JOB, 5, 90)  # resumed at step 5 (reached at 30 s before)
    timeline.advance(store, 100.0)
    lost = timeline.goodput(100.0).badput_s[Badput.LOST_WORK]
    assert lost == goodput_of(store, JOB, 100.0).badput_s[Badput.LOST_WORK] == 10.0


def test_node_faults_count_recoveries_a_node_caused_among_many_other_decisions(
    store: Store,
) -> None:
    _decide(store, 10, "submitted", "starting")
    for at in range(11, 40):
        _decide(store, at, "running", "running", "straggler")  # alerts: no recovery
    _decide(store, 45, "running", "recovering")  # named by the next decision with a cause
    _decide(store, 46, "recovering", "recovering", "hang")
    _decide(store, 60, "relaunching", "running")
    _decide(store, 70, "running", "recovering", "user_exception")  # not a node's fault
    _decide(store, 80, "running", "recovering", "node_lost")
    assert node_faults(store) == [45, 80]
