"""An event flood from a job owner against a live ``resurgo-supervisor`` (docs/security.md, 11).

The daemon (fake Slurm, one job submitted and running, from
``tests/adversarial_world.py``) budgets each job's events a minute; this
module has a daemon of its own, since the flood spends its job's budget for
the minute and other attacks on the same job would be refused 429.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from agent.wire.protocol import EventKind
from tests.adversarial_world import EVENTS_PER_MINUTE, World, healthz_under


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    built = World(tmp_path_factory.mktemp("adversarial-flood"))
    try:
        yield built
    finally:
        built.close()


def test_an_event_flood_is_refused_429_past_the_jobs_budget_and_stores_no_more(
    world: World,
) -> None:
    stored_before = world.stored_events()
    statuses = []
    started = time.monotonic()
    for _ in range(20):  # 10,000 events, as fast as one client can sign them
        batch = [world.event(EventKind.AGENT_STOPPED, {"reason": "flood"}) for _ in range(500)]
        statuses.append(world.post_events(batch)[0])
    took = time.monotonic() - started
    stored = world.stored_events() - stored_before
    assert 429 in statuses, statuses
    assert statuses[0] == 200
    # Within the minute: at most the budget (the sliding window also counts what
    # this module's other tests sent in the minute before).
    assert took < 60 and stored <= EVENTS_PER_MINUTE, (took, stored)
    assert world.healthz()["status"] == "ok"


QUOTA = 1000


def test_a_flood_within_the_rate_is_kept_to_the_jobs_store_quota(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """No rate budget (0): 4,000 events in 40 requests at once. The store keeps the
    job's newest reports within its quota, says so once per pruning, and answers."""
    quota_env = {
        "RESURGO_SUPERVISOR_EVENTS_PER_MINUTE": "0",
        "RESURGO_SUPERVISOR_EVENT_QUOTA": str(QUOTA),
    }
    world = World(tmp_path_factory.mktemp("adversarial-quota"), extra_env=quota_env)
    try:
        requests = [
            world.signed_post(
                [world.event(EventKind.AGENT_STOPPED, {"reason": "flood"}) for _ in range(100)]
            )
            for _ in range(40)
        ]
        probes = healthz_under(world, requests, probe_s=4.0)
        assert all(b" 200 " in status for status in probes.statuses), probes.statuses
        newest = world.seq
        with contextlib.closing(world.store()) as db:
            seqs = [
                row[0]
                for row in db.execute(
                    "SELECT agent_seq FROM events WHERE job_id = ? AND source = 'agent'",
                    (world.job_id,),
                )
            ]
            pruned = db.execute(
                "SELECT count(*) FROM events WHERE job_id = ? AND kind = 'events_pruned'",
                (world.job_id,),
            ).fetchone()[0]
        assert len(seqs) <= QUOTA and newest in seqs, (len(seqs), newest)
        assert 1 <= pruned <= 4000 // (QUOTA // 10), pruned
        assert "over its store quota" in world.daemon.log_path.read_text(errors="replace")
        assert world.healthz()["status"] == "ok"
    finally:
        world.close()
