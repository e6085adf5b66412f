"""What a hostile job owner's reports cost a live supervisor (issue 34's acceptance numbers).

One real ``resurgo-supervisor`` (fake Slurm, one running two-node job; the
harness of ``tests/adversarial_world.py``), its job's own secret, 127.0.0.1:

- made-up ranks: ``--rank-requests`` requests of ``--ranks`` loss reports
  each, for ranks the job's world never had (``global_rank`` from 1,000 up).
  Every one must be refused 400 ``unknown_rank``, and the daemon's settled
  RSS must grow by at most 16 MiB (``ranks_rss_grown_mib``);
- flood: ``--flood-requests`` signed requests of ``--flood-batch`` events,
  all at once, with the default event budget (6,000 a minute) and an event
  quota of ``--quota`` events, while ``/healthz`` is probed from a process
  of its own. Past the budget the answer must be 429; the store must hold at
  most the quota of the job's agent events; ``/healthz`` p99 during the burst
  must be under 100 ms (``flood_healthz_p99_ms``).

Run: ``python -m bench.tenant_abuse [--rank-requests 20] [--ranks 1000]
[--flood-requests 200] [--flood-batch 100] [--quota 2000]``. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections import Counter

if not __package__:
    sys.exit("run the benchmarks from the repository root: python -m bench.tenant_abuse")

from agent.wire.protocol import EventKind
from bench.load_stats import percentile
from tests.adversarial_world import MIB, World, a_world, healthz_under, post_all, settled_rss

RSS_TARGET_MIB = 16
HEALTHZ_P99_TARGET_S = 0.100


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _status(line: bytes) -> int:
    """The status code of an HTTP status line (0 when there was none)."""
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def made_up_ranks(world: World, requests: int, ranks: int) -> dict[str, object]:
    """RSS before and after ``requests`` requests of ``ranks`` loss reports each."""
    warm = [world.signed_post([world.event(EventKind.AGENT_STOPPED, {"reason": "warm"})])]
    asyncio.run(post_all(world.daemon.port, warm * 5))
    before = settled_rss(world)
    posts = []
    for request in range(requests):
        first = 1000 + request * ranks
        events = [
            world.event(
                EventKind.STEP_LOSSES,
                {"global_rank": rank, "steps": [{"step": 1, "loss": 2.5, "cursor": 0}]},
            )
            for rank in range(first, first + ranks)
        ]
        posts.append(world.signed_post(events))
    statuses = Counter(_status(line) for line in asyncio.run(post_all(world.daemon.port, posts)))
    after = settled_rss(world)
    grown = after - before
    return {
        "ranks_requests": requests,
        "ranks_per_request": ranks,
        "ranks_statuses": {str(code): n for code, n in sorted(statuses.items())},
        "ranks_rss_before_mib": round(before / MIB, 1),
        "ranks_rss_after_mib": round(after / MIB, 1),
        "ranks_rss_grown_mib": round(grown / MIB, 1),
        "ranks_target_met": set(statuses) == {400} and grown <= RSS_TARGET_MIB * MIB,
    }


def flood(world: World, requests: int, batch: int, quota: int) -> dict[str, object]:
    """``/healthz`` while ``requests`` requests of ``batch`` events arrive at once."""
    posts = [
        world.signed_post(
            [world.event(EventKind.AGENT_STOPPED, {"reason": "flood"}) for _ in range(batch)]
        )
        for _ in range(requests)
    ]
    probes = healthz_under(world, posts)
    statuses = Counter(_status(line) for line in probes.statuses)
    with contextlib.closing(world.store()) as db:
        kept = db.execute(
            "SELECT count(*) FROM events WHERE job_id = ? AND source = 'agent'", (world.job_id,)
        ).fetchone()[0]
    p99 = percentile(probes.burst, 0.99) or 0.0
    return {
        "flood_events": requests * batch,
        "flood_statuses": {str(code): n for code, n in sorted(statuses.items())},
        "flood_events_kept": kept,
        "flood_quota": quota,
        "flood_healthz_probes": len(probes.burst),
        "flood_healthz_p99_ms": _ms(p99),
        "flood_healthz_worst_ms": _ms(max(probes.burst)),
        "flood_target_met": (
            statuses.get(429, 0) > 0 and kept <= quota and p99 < HEALTHZ_P99_TARGET_S
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rank-requests", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=1000)
    parser.add_argument("--flood-requests", type=int, default=200)
    parser.add_argument("--flood-batch", type=int, default=100)
    parser.add_argument("--quota", type=int, default=2000)
    args = parser.parse_args()
    budget = {
        # The product's defaults, but a quota small enough to be reached in one burst.
        "RESURGO_SUPERVISOR_EVENTS_PER_MINUTE": "6000",
        "RESURGO_SUPERVISOR_EVENT_QUOTA": str(args.quota),
    }
    with a_world(budget) as world:
        result: dict[str, object] = {
            "targets": {
                "ranks_rss_grown_mib_at_most": RSS_TARGET_MIB,
                "flood_healthz_p99_ms_under": _ms(HEALTHZ_P99_TARGET_S),
            },
            **made_up_ranks(world, args.rank_requests, args.ranks),
            **flood(world, args.flood_requests, args.flood_batch, args.quota),
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
