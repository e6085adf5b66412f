"""supervisor.store: what happened to a job: events, observations, decisions, progress.

Events are stored once however often delivered, decisions point at stored events,
progress and checkpoint commits are the goodput raw data, and step reports (resume
verification) round-trip by attempt and step range through an index.

Real SQLite files in tmp_path; the ``path`` and ``store`` fixtures (a store holding
job ``JOB``) are in ``tests/unit/conftest.py``, the helpers in ``store_world``.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from agent.wire.protocol import EventKind
from supervisor.errors import UnknownJob
from supervisor.store import EventSource, StepRow, Store, schema
from supervisor.store import steps as step_sql
from supervisor.store import store as store_sql
from tests.unit.store_world import JOB, NOW, JobState, event

# ---------------------------------------------------------------------------
# Events, observations, decisions.


def test_a_redelivered_event_is_accepted_again_but_stored_once(store: Store) -> None:
    first = store.record_events(JOB, [event(1), event(2)], now_s=NOW)
    again = store.record_events(JOB, [event(2), event(3), event(3)], now_s=NOW + 1)
    assert first == [event(1).event_id, event(2).event_id]
    assert again == [event(2).event_id, event(3).event_id, event(3).event_id]
    rows = store.events_for(JOB)
    assert [row.event_id for row in rows] == [event(s).event_id for s in (1, 2, 3)]
    assert rows[1].received_s == NOW  # the first arrival is the one kept


def test_events_come_back_in_arrival_order_from_a_cursor_and_by_kind(store: Store) -> None:
    store.record_events(JOB, [event(5, "node2"), event(1, "node1")], now_s=NOW)
    seen = store.record_observation(JOB, "slurm_node_down", {"node": "node2"}, NOW, node="node2")
    rows = store.events_for(JOB)
    assert [row.event_id for row in rows] == [
        event(5, "node2").event_id, event(1, "node1").event_id, seen.event_id,
    ]  # fmt: skip
    assert [row.seq for row in store.events_for(JOB, since_seq=rows[0].seq)] == [
        rows[1].seq, rows[2].seq,
    ]  # fmt: skip
    assert store.events_for(JOB, kinds=["slurm_node_down"]) == [seen]
    assert len(store.events_for(JOB, kinds=[EventKind.AGENT_STOPPED], limit=1)) == 1


def test_a_stored_agent_event_reads_back_as_the_wire_event(store: Store) -> None:
    store.record_events(JOB, [event(7)], now_s=NOW)
    (row,) = store.events_for(JOB)
    assert row.source is EventSource.AGENT
    assert row.agent_event() == event(7)


def test_an_event_of_another_job_or_an_unknown_job_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="belongs to job 77"):
        store.record_events(JOB, [event(1, job_id="77")], now_s=NOW)
    with pytest.raises(UnknownJob):
        store.record_events("77", [event(1, job_id="77")], now_s=NOW)
    assert store.events_for(JOB) == []


def test_an_observation_gets_a_generated_id_or_keeps_a_given_one_once(store: Store) -> None:
    generated = store.record_observation(JOB, JobState.STOPPED, {}, NOW)
    assert generated.event_id.startswith(f"{JOB}/supervisor/")
    assert generated.source is EventSource.SUPERVISOR
    with pytest.raises(ValueError, match="observation"):
        generated.agent_event()
    first = store.record_observation(JOB, "lease_expired", {"n": 1}, NOW, observation_id="o1")
    again = store.record_observation(JOB, "lease_expired", {"n": 2}, NOW + 1, observation_id="o1")
    assert again == first


def test_a_decision_is_recorded_with_its_event_and_read_back(store: Store) -> None:
    store.record_events(JOB, [event(1)], now_s=NOW)
    decision = store.record_decision(
        JOB, event(1).event_id, JobState.RUNNING, JobState.RECOVERING, "rank_crash",
        {"blamed": "node3"}, NOW,
    )  # fmt: skip
    tick = store.record_decision(JOB, None, "recovering", "running", "relaunched", {}, NOW + 1)
    assert store.decisions_for(JOB) == [decision, tick]
    assert decision.from_state == "running" and decision.detail == {"blamed": "node3"}


def test_a_decision_on_an_event_never_stored_is_refused(store: Store) -> None:
    with pytest.raises(sqlite3.IntegrityError):
        store.record_decision(JOB, "no/such/event", "a", "b", "c", {}, NOW)


# ---------------------------------------------------------------------------
# Goodput raw data.


def test_progress_is_recorded_only_when_the_step_changes(store: Store, path: Path) -> None:
    written = [store.record_progress(JOB, step, NOW + i) for i, step in enumerate([1, 1, 2, 2, 1])]
    assert written == [True, False, True, False, True]
    assert [(p.step, p.time_s) for p in store.progress_for(JOB)] == [
        (1, NOW), (2, NOW + 2), (1, NOW + 4),
    ]  # fmt: skip
    assert [p.step for p in store.progress_for(JOB, since_s=NOW + 2)] == [2, 1]
    store.close()
    with Store.open(path) as again:
        assert again.record_progress(JOB, 1, NOW + 9) is False


def test_a_checkpoint_commit_is_recorded_once_per_path(store: Store) -> None:
    first = store.record_checkpoint(JOB, 100, "/ckpt/step-100", NOW)
    assert store.record_checkpoint(JOB, 100, "/ckpt/step-100", NOW + 3) == first
    store.record_checkpoint(JOB, 200, "/ckpt/step-200", NOW + 10)
    assert [c.step for c in store.checkpoints_for(JOB)] == [100, 200]


def test_the_newest_checkpoint_is_the_highest_step_first_committed(store: Store) -> None:
    assert store.newest_checkpoint(JOB) is None
    store.record_checkpoint(JOB, 200, "/a/step-200", NOW)
    store.record_checkpoint(JOB, 300, "/b/step-300", NOW + 5)
    store.record_checkpoint(JOB, 300, "/a/step-300", NOW + 9)  # a second copy, later
    store.record_checkpoint(JOB, 100, "/a/step-100", NOW + 20)  # after a rollback
    newest = store.newest_checkpoint(JOB)
    assert newest is not None and (newest.path, newest.committed_s) == ("/b/step-300", NOW + 5)


def test_the_latest_event_of_a_kind_and_how_many_there_are(store: Store) -> None:
    assert store.latest_event(JOB, "checkpoint_stats") is None
    assert store.count_events(JOB, "checkpoint_stats") == 0
    for index in range(3):
        store.record_observation(JOB, "checkpoint_stats", {"stall_s": index}, NOW + index)
        store.record_observation(JOB, "slurm_state", {"state": "RUNNING"}, NOW + index)
    latest = store.latest_event(JOB, "checkpoint_stats")
    assert latest is not None and latest.payload == {"stall_s": 2}
    assert store.count_events(JOB, "checkpoint_stats") == 3


def test_progress_since_a_time_is_one_range_of_an_index(store: Store) -> None:
    plan = " | ".join(
        row[3]
        for row in store._db.execute(
            f"EXPLAIN QUERY PLAN {store_sql.PROGRESS_SINCE_SQL}", (JOB, NOW)
        )
    )
    assert "SEARCH progress USING INDEX progress_by_time (job_id=? AND time_s>?)" in plan, plan


# ---------------------------------------------------------------------------
# Timeline summaries (what the metrics keep of each job's accounting).


def test_a_timeline_summary_is_kept_in_place_of_the_jobs_last_one(store: Store) -> None:
    assert store.timeline_summaries([JOB]) == {}
    assert store.keep_timeline_summaries([(JOB, NOW, {"version": 1, "n": 1})], NOW) == 1
    assert store.keep_timeline_summaries([(JOB, NOW + 60, {"version": 1, "n": 2})], NOW) == 1
    assert store.timeline_summaries([JOB, "404"]) == {JOB: {"version": 1, "n": 2}}
    assert store.keep_timeline_summaries([], NOW) == 0


def test_a_timeline_summary_that_is_not_json_is_left_out(store: Store) -> None:
    store.keep_timeline_summaries([(JOB, NOW, {"version": 1})], NOW)
    store._db.execute("UPDATE timeline_summaries SET summary = '{not json'")
    assert store.timeline_summaries([JOB]) == {}


def test_a_store_from_before_timeline_summaries_migrates_keeping_its_progress(
    path: Path,
) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, schema.MIGRATIONS[:6]) == 6
    db.execute(
        "INSERT INTO jobs (job_id, name, state, original_nodes, world_size, min_nodes, record,"
        " record_version, created_s, updated_s) VALUES (?, 't', 'running', 2, 2, 1, '{}', 1,"
        " ?, ?)",
        (JOB, NOW, NOW),
    )
    db.execute("INSERT INTO progress (job_id, step, time_s) VALUES (?, 7, ?)", (JOB, NOW))
    db.close()
    with Store.open(path) as store:
        assert [(p.step, p.time_s) for p in store.progress_for(JOB, since_s=NOW)] == [(7, NOW)]
        assert store.timeline_summaries([JOB]) == {}
        store.keep_timeline_summaries([(JOB, NOW, {"version": 1})], NOW)
        assert store.timeline_summaries([JOB]) == {JOB: {"version": 1}}


# ---------------------------------------------------------------------------
# Step reports (resume verification).


def test_step_reports_round_trip_by_attempt_and_step_range(store: Store) -> None:
    entries = [
        {"step": 11, "loss": 0.25, "cursor": 40},
        {"step": 12, "loss": None, "cursor": None},
        {"step": 13},
    ]
    assert store.record_steps(JOB, 1, 0, entries, NOW) == 3
    assert store.record_steps(JOB, 1, 4, [{"step": 11, "loss": 0.5, "cursor": 40}], NOW) == 1
    assert store.record_steps(JOB, 0, 0, [{"step": 12, "loss": 1.0, "cursor": 44}], NOW - 9) == 1
    assert store.steps_for(JOB) == [
        StepRow(JOB, 0, 12, 0, 1.0, 44, NOW - 9),
        StepRow(JOB, 1, 11, 0, 0.25, 40, NOW),
        StepRow(JOB, 1, 11, 4, 0.5, 40, NOW),
        StepRow(JOB, 1, 12, 0, None, None, NOW),
        StepRow(JOB, 1, 13, 0, None, None, NOW),
    ]
    assert [(r.step, r.global_rank) for r in store.steps_for(JOB, 1, first_step=12)] == [
        (12, 0), (13, 0),
    ]  # fmt: skip
    assert [r.step for r in store.steps_for(JOB, 1, last_step=11)] == [11, 11]
    assert [r.attempt for r in store.steps_for(JOB, first_step=12, last_step=12)] == [0, 1]
    assert store.steps_for(JOB, 2) == [] and store.steps_for("other") == []
    assert [(r.attempt, r.global_rank) for r in store.reports_of_step(JOB, 12)] == [(0, 0), (1, 0)]
    assert store.last_reported_step(JOB, 1) == 13
    assert store.last_reported_step(JOB, 0) == 12
    assert store.last_reported_step(JOB, 2) is None
    assert store.first_reported_step(JOB, 2) is None


def test_a_step_reported_again_in_the_same_attempt_keeps_its_first_report(store: Store) -> None:
    store.record_steps(JOB, 1, 0, [{"step": 5, "loss": 0.5, "cursor": 20}], NOW)
    again = [{"step": 5, "loss": 9.0, "cursor": 99}, {"step": 6, "loss": 0.4, "cursor": 24}]
    assert store.record_steps(JOB, 1, 0, again, NOW + 5) == 1
    assert store.record_steps(JOB, 2, 0, again[:1], NOW + 9) == 1  # another attempt: its own
    assert [(r.attempt, r.step, r.loss, r.cursor, r.received_s) for r in store.steps_for(JOB)] == [
        (1, 5, 0.5, 20, NOW), (1, 6, 0.4, 24, NOW + 5), (2, 5, 9.0, 99, NOW + 9),
    ]  # fmt: skip


def test_a_loss_that_is_not_finite_is_stored_as_none(store: Store) -> None:
    entries = [{"step": 1, "loss": float("nan")}, {"step": 2, "loss": float("inf")}]
    store.record_steps(JOB, 0, 0, entries, NOW)
    assert [r.loss for r in store.steps_for(JOB)] == [None, None]


@pytest.mark.parametrize(
    "entry",
    [{"loss": 1.0}, {"step": -1}, {"step": 1.5}, {"step": True}, {"step": 1, "cursor": -3},
     {"step": 1, "loss": "low"}, {"step": 1, "loss": False}],
)  # fmt: skip
def test_an_entry_that_is_not_a_step_report_is_refused_and_nothing_is_stored(
    store: Store, entry: dict[str, object]
) -> None:
    with pytest.raises(ValueError, match="not a step report"):
        store.record_steps(JOB, 0, 0, [{"step": 1}, entry], NOW)
    assert store.steps_for(JOB) == []


def test_step_reports_of_an_unknown_job_are_refused(store: Store) -> None:
    with pytest.raises(UnknownJob):
        store.record_steps("404", 0, 0, [{"step": 1}], NOW)


def test_step_report_queries_search_an_index_and_never_scan_the_table(store: Store) -> None:
    queries = [
        (step_sql.LAST_STEP_SQL, (JOB, 1)),
        (step_sql.FIRST_STEP_SQL, (JOB, 1)),
        (step_sql.STEP_SQL, (JOB, 5)),
        (step_sql.RANGE_SQL, (JOB, 1, 5, 9)),
    ]
    for sql, params in queries:
        plan = " | ".join(row[3] for row in store._db.execute(f"EXPLAIN QUERY PLAN {sql}", params))
        assert "SEARCH step_reports USING" in plan and "SCAN" not in plan, (sql, plan)
