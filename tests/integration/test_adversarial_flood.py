"""An event flood from a job owner against a live ``resurgo-supervisor`` (docs/security.md, 11).

The daemon (fake Slurm, one job submitted and running, from
``tests/adversarial_world.py``) budgets each job's events a minute; this
module has a daemon of its own, since the flood spends its job's budget for
the minute and other attacks on the same job would be refused 429.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from agent.wire.protocol import EventKind
from tests.adversarial_world import EVENTS_PER_MINUTE, World


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
