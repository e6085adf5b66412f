"""supervisor.store: opening, schema and corruption, jobs, transactions, backup.

Migrations back up then migrate in one transaction, a file that is not a store is
refused untouched, transactions are all or nothing, writers wait then fail clearly.
The other tables are in ``test_store_records.py``, ``test_store_actions.py`` and
``test_store_nodes.py``.

Real SQLite files in tmp_path; the ``path`` and ``store`` fixtures (a store holding
job ``JOB``) are in ``tests/unit/conftest.py``, the helpers in ``store_world``.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from supervisor.errors import (
    ActionStateError,
    StoreCorrupt,
    StoreError,
    StoreMissing,
    StoreSchemaError,
    UnknownJob,
)
from supervisor.store import SCHEMA_VERSION, StepRow, Store, schema
from tests.unit.store_world import INCARNATION, JOB, NOW, JobState, digest, event

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


def test_update_record_replaces_state_and_record_only_and_knows_no_new_job(
    store: Store,
) -> None:
    store.update_record(JOB, state=JobState.RECOVERING, record={"b": 1}, now_s=NOW + 5)
    row = store.get_job(JOB)
    assert row is not None
    assert (row.state, row.record, row.updated_s) == ("recovering", {"b": 1}, NOW + 5)
    assert (row.name, row.original_nodes, row.world_size, row.min_nodes) == ("train", 4, 4, 2)
    assert (row.created_s, row.secret_path) == (NOW, "/state/1234/secret")
    store.update_record(JOB, state="running", record={}, now_s=NOW + 6, world_size=3)
    assert store.get_job(JOB).world_size == 3  # type: ignore[union-attr]
    with pytest.raises(UnknownJob, match="upsert_job"):
        store.update_record("99", state="running", record={}, now_s=NOW)
    assert store.get_job("99") is None


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


def test_relaunches_are_the_attempts_after_the_first_started_after_a_time(store: Store) -> None:
    assert store.relaunches_for(JOB) == []
    store.start_attempt(JOB, 1, nodes=["n1", "n2"], resumed_from=None, now_s=NOW)
    assert store.relaunches_for(JOB) == []  # the first launch is no relaunch
    for attempt in (2, 3):
        store.start_attempt(JOB, attempt, nodes=["n1"], resumed_from=None, now_s=NOW + attempt)
    assert store.relaunches_for(JOB) == store.attempts_for(JOB)[1:]
    assert [a.attempt for a in store.relaunches_for(JOB, started_after_s=NOW + 2)] == [3]
    assert store.relaunches_for(JOB, started_after_s=NOW + 3) == []


def test_an_attempt_of_an_unknown_job_raises_unknown_job(store: Store) -> None:
    with pytest.raises(UnknownJob, match="upsert_job"):
        store.start_attempt("404", 0, nodes=[], resumed_from=None, now_s=NOW)


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


def test_a_job_over_its_event_quota_loses_its_oldest_reports_down_to_nine_tenths(
    store: Store,
) -> None:
    store.record_events(JOB, [event(seq) for seq in range(1, 121)], now_s=NOW)
    named = store.events_for(JOB)[2].event_id
    store.record_decision(JOB, named, "running", "recovering", "hang", {}, NOW)
    store.record_observation(JOB, "slurm_state", {"state": "RUNNING"}, NOW)
    assert store.event_usage(JOB)[0] == 120
    assert store.prune_events(JOB, 200, 1 << 20, 1000) == (0, 0)
    pruned, freed = store.prune_events(JOB, 100, 1 << 20, 1000)
    assert pruned == 30 and freed > 0
    kept = store.events_for(JOB)
    agents = [row for row in kept if row.source.value == "agent"]
    # 90 stay: the event a decision names, and the newest; the supervisor's own stay too.
    assert len(agents) == 90 and agents[0].event_id == named
    assert [row.agent_seq for row in agents[1:]] == list(range(32, 121))
    assert any(row.source.value == "supervisor" for row in kept)
    cached = store.event_usage(JOB)
    store._forget_caches()
    assert cached == store.event_usage(JOB) and cached[0] == 90  # counted as SQL counts


def test_the_event_quota_counts_bytes_too_and_duplicates_once(store: Store) -> None:
    store.record_events(JOB, [event(seq) for seq in range(1, 11)], now_s=NOW)
    store.record_events(JOB, [event(seq) for seq in range(5, 21)], now_s=NOW)  # 5-10 again
    count, size = store.event_usage(JOB)
    store._forget_caches()
    assert (count, size) == store.event_usage(JOB) and count == 20
    pruned, _ = store.prune_events(JOB, 1000, size // 2, 1000)
    assert pruned > 0 and store.event_usage(JOB)[1] <= (size // 2) * 0.9


def test_one_pruning_deletes_at_most_what_it_is_allowed(store: Store) -> None:
    store.record_events(JOB, [event(seq) for seq in range(1, 101)], now_s=NOW)
    assert store.prune_events(JOB, 10, 1 << 20, 25)[0] == 25
    assert store.event_usage(JOB)[0] == 75


def test_decisions_after_a_time_start_at_the_first_one_past_it(store: Store) -> None:
    """A scrape's window reads from its start on: every later decision, in order, even
    one dated earlier (a clock stepped back), and none before."""
    for t, cause in ((NOW, "a"), (NOW + 10, "b"), (NOW + 5, "c"), (NOW + 20, "d")):
        store.record_decision(JOB, None, "running", "running", cause, {}, t)
    assert [d.cause for d in store.decisions_for(JOB)] == ["a", "b", "c", "d"]
    assert [d.cause for d in store.decisions_for(JOB, after_s=NOW + 1)] == ["b", "c", "d"]
    assert [d.cause for d in store.decisions_for(JOB, after_s=NOW + 15)] == ["d"]
    assert store.decisions_for(JOB, after_s=NOW + 20) == []
