"""What hostile API traffic costs a live supervisor: memory kept, and ``/healthz`` delayed.

One real ``resurgo-supervisor`` (fake Slurm, one running job; the harness of
``tests/adversarial_world.py``), attacked over 127.0.0.1. Measured in one run:

- memory (issue 19: RSS within 64 MiB of its start after 300 aborted 8 MiB
  uploads): after a warm-up of 20 uploads, the daemon's RSS once it closed
  every connection (``rss_baseline_mib``), its highest sample while
  ``--waves`` waves of ``--uploads`` concurrent uploads of ``--size-mib``
  are sent and reset before their last KiB (``rss_peak_mib``), once settled
  after each wave (``rss_after_wave_mib``), and at the end
  (``rss_after_mib``);
- latency (issue 19: 100 commits with 64 MiB manifests never delay
  ``/healthz`` by 100 ms): ``/healthz`` probed from a process of its own
  while ``--commits`` signed events are sent at once, side by side: plain
  events (before and after, ``plain``), and ``checkpoint_committed`` events
  whose manifests have ``--manifest-mib`` each (``commits``: while the
  burst is answered; ``reading``: after it, while the manifests are read).
  The target is met when no probe, during the commit burst or while its
  manifests are read, waited over 100 ms; the plain burst beside it says
  what a burst costs without manifests.

Run: ``python -m bench.api_abuse [--waves 3] [--uploads 100] [--size-mib 8]
[--commits 100] [--manifest-mib 64]``. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading

if not __package__:
    sys.exit("run the benchmarks from the repository root: python -m bench.api_abuse")

from agent.wire.protocol import EventKind
from tests.adversarial_world import (
    MIB,
    World,
    a_world,
    healthz_under,
    manifest,
    settled_rss,
    waves,
)

RSS_TARGET_MIB = 64
HEALTHZ_TARGET_S = 0.100
MANIFEST_STATS: dict[str, object] = {
    "stall_s": 0.5,
    "write_s": 2.0,
    "total_bytes": 10,
    "filesystem": "ext4",
    "mode": "async",
}


def _mib(size: int) -> float:
    return round(size / MIB, 1)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _p99(lags: list[float]) -> float:
    ordered = sorted(lags)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def memory(world: World, count: int, uploads: int, size: int) -> dict[str, object]:
    """RSS before, during and after ``count`` waves of ``uploads`` aborted uploads."""
    port, job = world.daemon.port, world.job_id
    asyncio.run(waves(port, job, 20, size, 10))  # warm-up: pools, arenas, imports
    baseline = settled_rss(world)
    peak = [baseline]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            peak[0] = max(peak[0], world.rss())

    after_wave = []
    for _ in range(count):
        sampling.clear()
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            asyncio.run(waves(port, job, uploads, size, uploads))
        finally:
            sampling.set()
            sampler.join()
        after_wave.append(settled_rss(world))
    after = after_wave[-1]
    return {
        "aborted_uploads": count * uploads,
        "upload_mib": _mib(size),
        "rss_baseline_mib": _mib(baseline),
        "rss_peak_mib": _mib(peak[0]),
        "rss_after_wave_mib": [_mib(rss) for rss in after_wave],
        "rss_after_mib": _mib(after),
        "rss_kept_mib": _mib(after - baseline),
        "rss_target_met": after - baseline <= RSS_TARGET_MIB * MIB,
    }


def latency(world: World, commits: int, manifest_size: int) -> dict[str, object]:
    """``/healthz`` under a burst of plain events and of commits with large manifests."""
    big = world.root / "big.manifest.json"
    big.write_bytes(manifest(manifest_size, MANIFEST_STATS))
    steps = range(1000, 1000 + commits)
    for step in steps:
        (world.ckpt_root / f"step-{step}").mkdir()
        os.link(big, world.ckpt_root / f"step-{step}" / "resurgo.manifest.json")

    def plain() -> list[bytes]:
        event = EventKind.AGENT_STOPPED
        return [world.signed_post([world.event(event, {"reason": "x"})]) for _ in steps]

    committed = [
        world.signed_post([world.event(
            EventKind.CHECKPOINT_COMMITTED,
            {"step": step, "path": str(world.ckpt_root / f"step-{step}")},
        )])
        for step in steps
    ]  # fmt: skip
    before = healthz_under(world, plain())
    during = healthz_under(world, committed)
    after = healthz_under(world, plain())
    answered = [*before.statuses, *during.statuses, *after.statuses]
    refused = sorted({line.decode().strip() for line in answered if b" 200 " not in line})
    plain_burst = [*before.burst, *after.burst]
    burst_delay = max(during.burst) - max(plain_burst)
    reading = during.later
    return {
        "commits": commits,
        "manifest_mib": _mib(manifest_size),
        "manifests_read": during.readers,
        "not_200": refused,
        "plain_worst_ms": _ms(max(plain_burst)),
        "plain_p99_ms": _ms(_p99(plain_burst)),
        "commits_worst_ms": _ms(max(during.burst)),
        "commits_p99_ms": _ms(_p99(during.burst)),
        "commits_over_plain_ms": _ms(burst_delay),
        "reading_worst_ms": _ms(max(reading)),
        "reading_p99_ms": _ms(_p99(reading)),
        "reading_probes": len(reading),
        "healthz_target_met": (
            not refused
            and during.readers >= 1
            and max(reading) <= HEALTHZ_TARGET_S
            and max(during.burst) <= HEALTHZ_TARGET_S
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--uploads", type=int, default=100)
    parser.add_argument("--size-mib", type=int, default=8)
    parser.add_argument("--commits", type=int, default=100)
    parser.add_argument("--manifest-mib", type=int, default=64)
    args = parser.parse_args()
    with a_world() as world:
        result: dict[str, object] = {
            "targets": {
                "rss_kept_mib_at_most": RSS_TARGET_MIB,
                "healthz_delay_ms_at_most": _ms(HEALTHZ_TARGET_S),
            },
            **memory(world, args.waves, args.uploads, args.size_mib * MIB),
            **latency(world, args.commits, args.manifest_mib * MIB),
            "load_average_1m": round(os.getloadavg()[0], 2),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
