"""supervisor.store: real SQLite files in tmp_path, every table, the exactly-once rules."""

from __future__ import annotations

import enum
import hashlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.wire.protocol import Command, CommandKind, Event, EventKind, make_event
from supervisor.errors import (
    ActionStateError,
    StoreCorrupt,
    StoreError,
    StoreMissing,
    StoreSchemaError,
    UnknownJob,
)
from supervisor.store import (
    SCHEMA_VERSION,
    ActionState,
    Actor,
    EventSource,
    Lemon,
    StepRow,
    Store,
    schema,
)
from supervisor.store import steps as step_sql

NOW = 1_700_000_000.0
JOB = "1234"
INCARNATION = "0123abcd"


class JobState(enum.Enum):
    """Stands in for the decision core's job-state enum: the store keeps its values."""

    RUNNING = "running"
    RECOVERING = "recovering"
    STOPPED = "stopped"


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "resurgo.db"


@pytest.fixture
def store(path: Path) -> Iterator[Store]:
    with Store.open(path) as opened:
        opened.upsert_job(
            JOB,
            state=JobState.RUNNING,
            record={"v": 1},
            now_s=NOW,
            name="train",
            original_nodes=4,
            min_nodes=2,
            secret_path="/state/1234/secret",
        )
        yield opened


def event(seq: int, node: str = "node1", job_id: str = JOB) -> Event:
    return make_event(
        EventKind.AGENT_STOPPED, job_id, node, INCARNATION, seq, NOW + seq, {"reason": f"r{seq}"}
    )


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---------------------------------------------------------------------------
# Opening, schema, corruption.


def test_a_new_store_is_wal_with_foreign_keys_and_the_current_schema(path: Path) -> None:
    Store.open(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
    db.close()
    with Store.open(path) as store:
        assert store._db.execute("PRAGMA foreign_keys").fetchone() == (1,)


def test_opening_a_missing_store_without_create_raises_store_missing(path: Path) -> None:
    with pytest.raises(StoreMissing, match="does not exist"):
        Store.open(path, create=False)
    assert not path.exists()


def test_everything_written_survives_close_and_reopen(store: Store, path: Path) -> None:
    store.record_events(JOB, [event(1)], now_s=NOW)
    store.plan_action("a1", JOB, "drain", {"node": "node3"}, NOW)
    store.touch_lease(JOB, "node1", INCARNATION, NOW)
    store.close()
    with Store.open(path, create=False) as again:
        assert again.get_job(JOB) is not None
        assert [row.event_id for row in again.events_for(JOB)] == [event(1).event_id]
        assert [row.action_id for row in again.unfinished_actions()] == ["a1"]
        assert [lease.node for lease in again.leases_for(JOB)] == ["node1"]


def test_a_newer_schema_is_refused_and_left_untouched(path: Path) -> None:
    Store.open(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.commit()
    db.close()
    before = digest(path)
    with pytest.raises(StoreSchemaError, match=f"schema version {SCHEMA_VERSION + 1}, newer"):
        Store.open(path)
    assert digest(path) == before


def test_an_sqlite_file_that_is_not_a_resurgo_store_is_refused(path: Path) -> None:
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE grafana (x)")
    db.commit()
    db.close()
    with pytest.raises(StoreSchemaError, match="not a Resurgo store"):
        Store.open(path)


def test_an_older_schema_is_backed_up_then_migrated_in_one_transaction(path: Path) -> None:
    Store.open(path).close()
    extra = "ALTER TABLE jobs ADD COLUMN priority INTEGER NOT NULL DEFAULT 0;"
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, (*schema.MIGRATIONS, extra)) == SCHEMA_VERSION + 1
    assert db.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION + 1,)
    assert "priority" in {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    db.close()
    backup = path.with_name(f"{path.name}.schema-v{SCHEMA_VERSION}.bak")
    old = sqlite3.connect(backup)
    assert old.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    old.close()


def test_a_version_1_store_migrates_keeping_its_rows_and_gains_step_reports(path: Path) -> None:
    db = sqlite3.connect(path, isolation_level=None)
    assert schema.migrate(db, path, schema.MIGRATIONS[:1]) == 1
    db.execute(
        "INSERT INTO jobs (job_id, name, state, original_nodes, world_size, min_nodes, record,"
        " record_version, created_s, updated_s) VALUES (?, 't', 'running', 2, 2, 1, '{}', 1,"
        " ?, ?)",
        (JOB, NOW, NOW),
    )
    db.close()
    with Store.open(path) as store:
        job = store.get_job(JOB)
        assert job is not None and job.state == "running"
        assert store.record_steps(JOB, 1, 0, [{"step": 3, "loss": 0.5, "cursor": 12}], NOW) == 1
        assert store.steps_for(JOB) == [StepRow(JOB, 1, 3, 0, 0.5, 12, NOW)]
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    db.close()
    backup = sqlite3.connect(path.with_name(f"{path.name}.schema-v1.bak"))
    assert backup.execute("SELECT version FROM schema_version").fetchone() == (1,)
    tables = {row[0] for row in backup.execute("SELECT name FROM sqlite_schema")}
    assert "jobs" in tables and "step_reports" not in tables
    backup.close()


def test_a_failing_migration_leaves_the_old_version_intact(path: Path) -> None:
    Store.open(path).close()
    broken = "ALTER TABLE jobs ADD COLUMN fine INTEGER; ALTER TABLE nowhere ADD COLUMN x;"
    db = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(sqlite3.OperationalError, match="nowhere"):
        schema.migrate(db, path, (*schema.MIGRATIONS, broken))
    assert db.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    assert "fine" not in {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    db.close()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "empty file"),
        (b"this is a YAML config, not a store\n" * 20, "not an SQLite database"),
        (schema.SQLITE_MAGIC + b"\x00" * 20, "truncated"),
    ],
)
def test_a_file_that_is_not_a_store_raises_store_corrupt_and_stays_untouched(
    path: Path, content: bytes, message: str
) -> None:
    path.write_bytes(content)
    with pytest.raises(StoreCorrupt, match=message) as raised:
        Store.open(path)
    assert "restore" in str(raised.value) or "delete the empty file" in str(raised.value)
    assert path.read_bytes() == content


def _filled_store(path: Path) -> None:
    with Store.open(path) as store:
        store.upsert_job(
            JOB, state="running", record={}, now_s=NOW, name="t", original_nodes=4, min_nodes=1
        )
        for batch in range(20):
            events = [event(batch * 50 + seq + 1) for seq in range(50)]
            store.record_events(JOB, events, now_s=NOW)
    # Fold the WAL into the main file so the damage below hits real pages.
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.execute("PRAGMA journal_mode = DELETE")
    db.close()


def test_a_store_with_its_middle_cut_out_raises_store_corrupt_and_stays_untouched(
    path: Path,
) -> None:
    _filled_store(path)
    data = path.read_bytes()
    assert len(data) > 64 * 4096
    third = len(data) // 3
    path.write_bytes(data[:third] + data[2 * third :])
    before = digest(path)
    with pytest.raises(StoreCorrupt, match="restore"):
        Store.open(path)
    assert digest(path) == before


def test_a_store_with_garbage_over_its_pages_raises_store_corrupt_and_stays_untouched(
    path: Path,
) -> None:
    _filled_store(path)
    data = bytearray(path.read_bytes())
    start = 4096 * 3
    data[start : start + 8 * 4096] = bytes(range(256)) * 128
    path.write_bytes(bytes(data))
    before = digest(path)
    with pytest.raises(StoreCorrupt, match=r"integrity check|damaged"):
        Store.open(path)
    assert digest(path) == before


# ---------------------------------------------------------------------------
# Jobs and attempts.


def test_a_new_job_needs_its_name_and_sizes(store: Store) -> None:
    with pytest.raises(ValueError, match="give name, original_nodes and min_nodes"):
        store.upsert_job("99", state="running", record={}, now_s=NOW)
    assert store.get_job("99") is None


def test_upsert_replaces_state_and_record_and_keeps_fields_left_unset(store: Store) -> None:
    row = store.upsert_job(
        JOB, state=JobState.RECOVERING, record={"b": [1, 2], "a": None}, now_s=NOW + 5,
        world_size=3, record_version=2,
    )  # fmt: skip
    assert row.state == "recovering"
    assert row.record == {"a": None, "b": [1, 2]}
    assert (row.record_version, row.world_size, row.original_nodes, row.min_nodes) == (2, 3, 4, 2)
    assert (row.name, row.secret_path) == ("train", "/state/1234/secret")
    assert (row.created_s, row.updated_s) == (NOW, NOW + 5)
    stored = store._db.execute("SELECT record FROM jobs WHERE job_id = ?", (JOB,)).fetchone()
    assert stored == ('{"a":null,"b":[1,2]}',)


def test_a_record_that_is_not_json_is_refused_with_a_hint(store: Store) -> None:
    with pytest.raises(ValueError, match=r"enums by \.value"):
        store.upsert_job(JOB, state="running", record={"state": JobState.RUNNING}, now_s=NOW)


def test_list_jobs_filters_by_states_given_as_enums_or_text(store: Store) -> None:
    store.upsert_job(
        "2", state=JobState.STOPPED, record={}, now_s=NOW + 1, name="b", original_nodes=1,
        min_nodes=1,
    )  # fmt: skip
    assert [job.job_id for job in store.list_jobs()] == [JOB, "2"]
    assert [job.job_id for job in store.list_jobs([JobState.STOPPED])] == ["2"]
    assert [job.job_id for job in store.list_jobs(["running", "stopped"])] == [JOB, "2"]
    assert store.list_jobs([]) == []


def test_an_attempt_started_twice_keeps_the_first_and_ends_once(store: Store) -> None:
    first = store.start_attempt(JOB, 0, nodes=["n1", "n2"], resumed_from=None, now_s=NOW)
    again = store.start_attempt(JOB, 0, nodes=["n9"], resumed_from="/x", now_s=NOW + 9)
    assert again == first
    assert first.nodes == ("n1", "n2")
    store.start_attempt(JOB, 1, nodes=["n1"], resumed_from="/ckpt/step-10", now_s=NOW + 20)
    ended = store.end_attempt(JOB, 0, cause="rank_crash", now_s=NOW + 10)
    assert (ended.ended_s, ended.end_cause) == (NOW + 10, "rank_crash")
    assert store.end_attempt(JOB, 0, cause="other", now_s=NOW + 30) == ended
    assert [a.attempt for a in store.attempts_for(JOB)] == [0, 1]


def test_an_attempt_of_an_unknown_job_raises_unknown_job(store: Store) -> None:
    with pytest.raises(UnknownJob, match="upsert_job"):
        store.start_attempt("404", 0, nodes=[], resumed_from=None, now_s=NOW)


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
# Actions.


def test_planning_the_same_action_twice_returns_the_first_plan(store: Store) -> None:
    first = store.plan_action("j/1/drain/node3", JOB, "drain", {"node": "node3"}, NOW)
    again = store.plan_action("j/1/drain/node3", JOB, "drain", {"node": "other"}, NOW + 5)
    assert again == first
    assert (first.state, first.starts, first.args) == (ActionState.PLANNED, 0, {"node": "node3"})
    assert len(store.list_actions()) == 1


def test_an_action_goes_planned_started_done_and_records_each_time(store: Store) -> None:
    store.plan_action("a", JOB, "requeue", {"nodes": 3}, NOW)
    started = store.mark_started("a", NOW + 1)
    assert (started.state, started.starts, started.started_s) == (ActionState.STARTED, 1, NOW + 1)
    done = store.mark_done("a", {"job": JOB}, NOW + 2)
    assert (done.state, done.result, done.finished_s) == (ActionState.DONE, {"job": JOB}, NOW + 2)
    assert store.unfinished_actions() == []


@pytest.mark.parametrize(
    ("setup", "verb", "message"),
    [
        ([], "done", "cannot finish action a: it is planned"),
        (["start", "done"], "start", "cannot start action a: it is done"),
        (["start", "done"], "fail", "cannot fail action a: it is done"),
        (["start", "done"], "done", "cannot finish action a: it is done"),
        (["start", "fail"], "start", r"it is failed \(not retryable\)"),
        (["fail"], "done", "cannot finish action a: it is failed"),
    ],
)
def test_a_forbidden_action_transition_raises_and_changes_nothing(
    store: Store, setup: list[str], verb: str, message: str
) -> None:
    store.plan_action("a", JOB, "drain", {}, NOW)
    apply = {
        "start": lambda: store.mark_started("a", NOW),
        "done": lambda: store.mark_done("a", {}, NOW),
        "fail": lambda: store.mark_failed("a", "boom", NOW, retryable=False),
    }
    for step in setup:
        apply[step]()
    before = store.get_action("a")
    with pytest.raises(ActionStateError, match=message):
        apply[verb]()
    assert store.get_action("a") == before


def test_a_retryable_failure_can_be_started_again_and_counts_starts(store: Store) -> None:
    store.plan_action("a", JOB, "drain", {}, NOW)
    store.mark_started("a", NOW)
    failed = store.mark_failed("a", "scontrol timed out", NOW + 1, retryable=True)
    assert (failed.state, failed.error, failed.retryable) == (
        ActionState.FAILED,
        "scontrol timed out",
        True,
    )
    restarted = store.mark_started("a", NOW + 2)
    assert (restarted.state, restarted.starts, restarted.error) == (ActionState.STARTED, 2, None)


def test_unfinished_actions_are_planned_or_started_in_plan_order(store: Store) -> None:
    for action_id in ("c", "a", "b", "d"):
        store.plan_action(action_id, JOB, "drain", {}, NOW)
    store.mark_started("a", NOW)
    store.mark_started("b", NOW)
    store.mark_done("b", {}, NOW)
    store.mark_failed("d", "no", NOW, retryable=True)
    assert [row.action_id for row in store.unfinished_actions()] == ["c", "a"]
    assert [row.action_id for row in store.unfinished_actions(JOB)] == ["c", "a"]
    assert store.unfinished_actions("other") == []
    failed = store.list_actions(states=[ActionState.FAILED])
    assert [row.action_id for row in failed] == ["d"]


def test_an_unplanned_action_cannot_be_started(store: Store) -> None:
    with pytest.raises(StoreError, match="plan_action"):
        store.mark_started("ghost", NOW)


# ---------------------------------------------------------------------------
# Transactions.


def test_a_transaction_rolls_back_every_write_when_its_block_raises(store: Store) -> None:
    with pytest.raises(RuntimeError, match="core crashed"), store.transaction():
        store.record_decision(JOB, None, "running", "recovering", "hang", {}, NOW)
        store.plan_action("a", JOB, "drain", {}, NOW)
        store.upsert_job(JOB, state="recovering", record={"v": 2}, now_s=NOW)
        store.record_progress(JOB, 10, NOW)
        raise RuntimeError("core crashed")
    assert store.decisions_for(JOB) == []
    assert store.list_actions() == []
    job = store.get_job(JOB)
    assert job is not None and (job.state, job.record) == ("running", {"v": 1})
    assert store.record_progress(JOB, 10, NOW) is True  # the cache forgot the rolled-back step


def test_a_transaction_commits_all_its_writes_together(store: Store, path: Path) -> None:
    with store.transaction():
        store.record_decision(JOB, None, "running", "recovering", "hang", {}, NOW)
        store.plan_action("a", JOB, "drain", {}, NOW)
        other = sqlite3.connect(path)
        assert other.execute("SELECT COUNT(*) FROM actions").fetchone() == (0,)
    assert other.execute("SELECT COUNT(*) FROM actions").fetchone() == (1,)
    other.close()


def test_an_error_caught_inside_a_transaction_undoes_only_the_inner_block(store: Store) -> None:
    with store.transaction():
        store.plan_action("kept", JOB, "drain", {}, NOW)
        with pytest.raises(ActionStateError), store.transaction():
            store.plan_action("undone", JOB, "drain", {}, NOW)
            store.mark_done("undone", {}, NOW)  # not started: refused
    assert [row.action_id for row in store.list_actions()] == ["kept"]


def test_a_second_writer_waits_for_the_busy_timeout_then_fails_clearly(path: Path) -> None:
    with Store.open(path, busy_timeout_s=0.05) as store:
        store.upsert_job(
            JOB, state="r", record={}, now_s=NOW, name="t", original_nodes=1, min_nodes=1
        )
        with (
            store.transaction(),
            Store.open(path, busy_timeout_s=0.05) as other,
            pytest.raises(sqlite3.OperationalError, match="locked"),
        ):
            other.plan_action("a", JOB, "drain", {}, NOW)


def test_the_store_can_be_used_from_a_worker_thread(store: Store) -> None:
    results: list[object] = []
    worker = threading.Thread(
        target=lambda: results.append(store.plan_action("t", JOB, "drain", {}, NOW))
    )
    worker.start()
    worker.join()
    assert [row.action_id for row in store.list_actions()] == ["t"] and len(results) == 1


# ---------------------------------------------------------------------------
# Drains.


def test_a_drain_is_audited_once_per_action_and_closed_by_an_undrain(store: Store) -> None:
    drain = store.record_drain(
        "node3", cause="rank_crash", job_id=JOB, reason="resurgo: rank_crash job=1234",
        now_s=NOW, action_id="a1",
    )  # fmt: skip
    again = store.record_drain(
        "node3", cause="rank_crash", job_id=JOB, reason="other", now_s=NOW + 9, action_id="a1"
    )
    assert again == drain and drain.drained_by is Actor.SUPERVISOR
    assert store.open_drains() == [drain]
    assert store.record_undrain("node3", now_s=NOW + 60, by=Actor.OPERATOR) == 1
    assert store.open_drains() == []
    (closed,) = store.blame_history("node3")
    assert (closed.undrained_s, closed.undrained_by) == (NOW + 60, Actor.OPERATOR)


def test_drains_since_counts_the_last_hour_and_filters_by_actor(store: Store) -> None:
    store.record_drain("n1", cause="hang", job_id=JOB, reason="r", now_s=NOW - 4000)
    store.record_drain("n2", cause="hang", job_id=None, reason="r", now_s=NOW - 100)
    store.record_drain("n3", cause="maint", job_id=None, reason="r", now_s=NOW, by=Actor.OPERATOR)
    assert [d.node for d in store.drains_since(NOW - 3600)] == ["n2", "n3"]
    assert [d.node for d in store.drains_since(NOW - 3600, by=Actor.SUPERVISOR)] == ["n2"]


def test_lemons_are_nodes_drained_by_the_supervisor_often_within_the_window(store: Store) -> None:
    for offset in (0, 100, 200):
        store.record_drain("bad", cause="hang", job_id=JOB, reason="r", now_s=NOW - offset)
    store.record_drain("old", cause="hang", job_id=JOB, reason="r", now_s=NOW - 90_000)
    store.record_drain("old", cause="hang", job_id=JOB, reason="r", now_s=NOW - 10)
    for _ in range(3):
        store.record_drain(
            "maint", cause="m", job_id=None, reason="r", now_s=NOW, by=Actor.OPERATOR
        )
    assert store.lemons(threshold=2, window_s=86_400, now_s=NOW) == [Lemon("bad", 3, NOW)]
    assert [lemon.node for lemon in store.lemons(1, 86_400, NOW)] == ["bad", "old"]
    assert len(store.blame_history("old")) == 2


# ---------------------------------------------------------------------------
# Commands.


def _stop(command_id: str) -> Command:
    return Command(CommandKind.STOP_RANKS, command_id, {"grace_s": 10.0})


def test_a_command_for_one_node_is_pending_there_until_acknowledged(store: Store) -> None:
    assert store.queue_command(JOB, "node1", _stop("c1"), NOW) is True
    assert store.queue_command(JOB, "node1", _stop("c1"), NOW) is False
    assert store.pending_commands(JOB, "node1") == [_stop("c1")]
    assert store.pending_commands(JOB, "node2") == []
    assert store.ack_command("c1", "node2", NOW) is False
    assert store.ack_command("c1", "node1", NOW) is True
    assert store.ack_command("c1", "node1", NOW) is False
    assert store.pending_commands(JOB, "node1") == []


def test_a_command_for_every_node_stays_pending_on_each_until_it_acks(store: Store) -> None:
    interval = Command(
        CommandKind.SET_CHECKPOINT_INTERVAL, "c2", {"interval_s": 600.0, "every_steps": None}
    )
    store.queue_command(JOB, None, interval, NOW)
    store.queue_command(JOB, "node2", _stop("c3"), NOW)
    store.ack_command("c2", "node1", NOW)
    assert store.pending_commands(JOB, "node1") == []
    assert store.pending_commands(JOB, "node2") == [interval, _stop("c3")]
    assert store.ack_command("ghost", "node1", NOW) is False


def test_wal_checkpoints_can_be_left_to_a_worker_thread(store: Store, path: Path) -> None:
    wal = path.with_name(path.name + "-wal")

    def fill(first: int) -> None:
        for batch in range(first, first + 80):
            events = [event(batch * 50 + seq + 1, node=f"node{seq}") for seq in range(50)]
            store.record_events(JOB, events, now_s=NOW)

    store.checkpoint_in_background()
    fill(0)
    assert wal.stat().st_size > 1500 * 4096  # well past the 1,000 pages SQLite checkpoints at
    one_fill, copied = store.checkpoint_wal()
    assert one_fill > 1000 and copied == one_fill
    done: list[tuple[int, int]] = []
    worker = threading.Thread(target=lambda: done.append(store.checkpoint_wal()))
    worker.start()
    fill(80)  # the store stays usable meanwhile
    worker.join()
    assert done and store.checkpoint_wal()[0] == store.checkpoint_wal()[1]  # all copied now
    # Once copied, the log is written again from its start, not grown without end.
    store.record_events(JOB, [event(99_999)], now_s=NOW)
    assert store.checkpoint_wal()[0] < 100
    assert len(store.events_for(JOB)) == 160 * 50 + 1


# ---------------------------------------------------------------------------
# Leases.


def test_a_lease_renewal_returns_the_previous_one_and_ignores_older_reports(store: Store) -> None:
    assert store.touch_lease(JOB, "node1", INCARNATION, NOW) is None
    previous = store.touch_lease(JOB, "node1", "ffff0000", NOW + 5)
    assert previous is not None and previous.incarnation == INCARNATION
    stale = store.touch_lease(JOB, "node1", INCARNATION, NOW + 1)
    assert stale is not None and stale.last_seen_s == NOW + 5
    (lease,) = store.leases_for(JOB)
    assert (lease.incarnation, lease.last_seen_s) == ("ffff0000", NOW + 5)


def test_leases_expire_after_lease_s_oldest_first(store: Store) -> None:
    store.touch_lease(JOB, "node1", INCARNATION, NOW - 50)
    store.touch_lease(JOB, "node2", INCARNATION, NOW - 40)
    store.touch_lease(JOB, "node3", INCARNATION, NOW - 10)
    assert [lease.node for lease in store.expired_leases(NOW, 30)] == ["node1", "node2"]
    assert store.expired_leases(NOW, 30, job_id="other") == []
    assert store.expired_leases(NOW - 20, 30) == []


def test_leases_cost_no_sql_until_flushed_and_are_dropped_with_the_job(
    store: Store, path: Path
) -> None:
    store.touch_lease(JOB, "node1", INCARNATION, NOW)
    store.touch_lease(JOB, "node2", INCARNATION, NOW)
    other = sqlite3.connect(path)
    assert other.execute("SELECT COUNT(*) FROM leases").fetchone() == (0,)
    assert store.flush_leases() == 2
    assert store.flush_leases() == 0
    assert other.execute("SELECT COUNT(*) FROM leases").fetchone() == (2,)
    store.drop_leases(JOB, ["node1"])
    assert [lease.node for lease in store.leases_for(JOB)] == ["node2"]
    assert other.execute("SELECT node FROM leases").fetchall() == [("node2",)]
    other.close()


def test_only_new_holders_of_a_lease_are_flushed_and_close_writes_every_renewal(
    store: Store, path: Path
) -> None:
    # At thousands of agents a renewal per heartbeat written every tick held
    # the event loop for 10-25 ms a second; only who holds a lease must
    # survive a crash (leases count from the daemon's start).
    store.touch_lease(JOB, "node1", INCARNATION, NOW)
    store.touch_lease(JOB, "node2", INCARNATION, NOW)
    assert store.flush_leases() == 2
    store.touch_lease(JOB, "node1", INCARNATION, NOW + 1)
    store.touch_lease(JOB, "node2", "ffff0000", NOW + 1)
    assert store.flush_leases() == 1
    other = sqlite3.connect(path)
    query = "SELECT node, incarnation, last_seen_s FROM leases ORDER BY node"
    assert other.execute(query).fetchall() == [
        ("node1", INCARNATION, NOW), ("node2", "ffff0000", NOW + 1),
    ]  # fmt: skip
    store.touch_lease(JOB, "node1", INCARNATION, NOW + 2)
    store.close()
    assert other.execute(query).fetchall() == [
        ("node1", INCARNATION, NOW + 2), ("node2", "ffff0000", NOW + 1),
    ]  # fmt: skip
    other.close()
    with Store.open(path) as again:
        assert [(lease.node, lease.last_seen_s) for lease in again.leases_for(JOB)] == [
            ("node1", NOW + 2), ("node2", NOW + 1),
        ]  # fmt: skip


def test_leases_are_counted_by_job_and_renewal(store: Store) -> None:
    store.upsert_job(
        "77", state="running", record={}, now_s=NOW, name="t", original_nodes=1, min_nodes=1
    )
    store.touch_lease(JOB, "node1", INCARNATION, NOW - 50)
    store.touch_lease(JOB, "node2", INCARNATION, NOW)
    store.touch_lease("77", "node3", INCARNATION, NOW)
    assert store.lease_count([JOB], NOW - 30) == 1
    assert store.lease_count([JOB, "77"], NOW - 30) == 2
    assert store.lease_count([JOB, "77"], NOW - 60) == 3
    assert store.lease_count(["missing"], NOW - 60) == 0
    store.drop_leases(JOB)
    assert store.leases_for(JOB) == [] and store.lease_count([JOB], 0) == 0


def test_a_lease_of_an_unknown_job_is_refused(store: Store) -> None:
    with pytest.raises(UnknownJob):
        store.touch_lease("404", "node1", INCARNATION, NOW)


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


# ---------------------------------------------------------------------------
# Backup.


def test_a_backup_opens_as_a_store_with_everything_committed(store: Store, tmp_path: Path) -> None:
    store.plan_action("a", JOB, "drain", {}, NOW)
    store.touch_lease(JOB, "node1", INCARNATION, NOW)
    dest = tmp_path / "backup.db"
    dest.write_bytes(b"an older backup")
    store.backup(dest)
    with Store.open(dest, create=False) as copy:
        assert [row.action_id for row in copy.unfinished_actions()] == ["a"]
        assert [lease.node for lease in copy.leases_for(JOB)] == ["node1"]


def test_a_backup_onto_the_store_itself_or_inside_a_transaction_is_refused(
    store: Store, path: Path, tmp_path: Path
) -> None:
    with pytest.raises(StoreError, match="is the store itself"):
        store.backup(path)
    with pytest.raises(StoreError, match="inside a transaction"), store.transaction():
        store.backup(tmp_path / "b.db")


# ---------------------------------------------------------------------------
# Property: random plan/start/done/fail sequences keep the action invariants.

_IDS = ("a", "b", "c", "d")
_OPS = st.lists(
    st.tuples(
        st.sampled_from(("plan", "start", "done", "fail", "fail_retry")), st.sampled_from(_IDS)
    ),
    max_size=25,
)
_ALLOWED = {
    "start": {"planned", "started", "failed_retryable"},
    "done": {"started"},
    "fail": {"planned", "started"},
    "fail_retry": {"planned", "started"},
}
_AFTER = {"start": "started", "done": "done", "fail": "failed", "fail_retry": "failed_retryable"}


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=_OPS)
def test_random_action_sequences_keep_the_exactly_once_invariants(
    tmp_path: Path, ops: list[tuple[str, str]]
) -> None:
    db_path = tmp_path / f"prop-{hashlib.sha256(repr(ops).encode()).hexdigest()[:16]}.db"
    db_path.unlink(missing_ok=True)
    model: dict[str, str] = {}
    order: list[str] = []
    starts: dict[str, int] = {}
    with Store.open(db_path) as store:
        store.upsert_job(
            JOB, state="r", record={}, now_s=NOW, name="t", original_nodes=1, min_nodes=1
        )
        for op, action_id in ops:
            if op == "plan":
                store.plan_action(action_id, JOB, "drain", {}, NOW)
                if action_id not in model:
                    model[action_id] = "planned"
                    order.append(action_id)
                    starts[action_id] = 0
                continue
            allowed = model.get(action_id) in _ALLOWED[op]
            call = {
                "start": lambda i=action_id: store.mark_started(i, NOW),
                "done": lambda i=action_id: store.mark_done(i, {}, NOW),
                "fail": lambda i=action_id: store.mark_failed(i, "e", NOW, retryable=False),
                "fail_retry": lambda i=action_id: store.mark_failed(i, "e", NOW, retryable=True),
            }[op]
            if allowed:
                call()
                model[action_id] = _AFTER[op]
                starts[action_id] += op == "start"
            else:
                with pytest.raises(StoreError):
                    call()
        rows = store.list_actions()
        assert [row.action_id for row in rows] == order
        for row in rows:
            expected = model[row.action_id]
            assert row.state.value == expected.removesuffix("_retryable")
            assert row.starts == starts[row.action_id]
            assert (row.retryable is True) == (expected == "failed_retryable")
            assert (row.finished_s is not None) == (expected.startswith(("done", "failed")))
        unfinished = [i for i in order if model[i] in ("planned", "started")]
        assert [row.action_id for row in store.unfinished_actions()] == unfinished
