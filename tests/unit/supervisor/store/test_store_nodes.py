"""supervisor.store: per-node state: drains and lemons, commands, leases.

Drains are audited once per action and counted per hour, commands stay pending on a
node until it acknowledges them, and leases are renewed in memory and flushed.

Real SQLite files in tmp_path; the ``path`` and ``store`` fixtures (a store holding
job ``JOB``) are in ``tests/unit/conftest.py``, the helpers in ``store_world``.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from agent.wire.protocol import Command, CommandKind
from supervisor.errors import UnknownJob
from supervisor.store import Actor, Lemon, Store
from tests.unit.store_world import INCARNATION, JOB, NOW, event

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


def test_a_lemon_needs_the_blames_of_jobs_of_enough_users(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s.db") as store:
        for job_id, user in (("1", "alice"), ("2", "alice"), ("3", "bob")):
            store.upsert_job(job_id, state="running", record={}, now_s=NOW, name="j",
                             original_nodes=2, min_nodes=1, slurm_user=user)  # fmt: skip
        for job_id, node in (("1", "n1"), ("2", "n1"), ("1", "n2"), ("3", "n2")):
            store.record_drain(node, cause="hang", job_id=job_id, reason="r", now_s=NOW,
                               action_id=f"{job_id}/1/drain/{node}")  # fmt: skip
        # n1: two blames, both alice's jobs; n2: alice's and bob's.
        assert [(x.node, x.users) for x in store.lemons(2, 86_400, NOW, users=2)] == [("n2", 2)]
        assert [x.node for x in store.lemons(2, 86_400, NOW, users=1)] == ["n1", "n2"]
