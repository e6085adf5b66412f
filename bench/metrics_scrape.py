"""Metrics scrape cost: walking every job's whole history vs the incremental timelines.

A store holds ``--jobs`` running jobs with ``--hours`` of history each (a
progress sample every 5 s, a checkpoint and its save statistics every 5
minutes, one recovery). Measured side by side in one run:

- ``cold_s``: the first scrape of a fresh collector, which reads every
  job's whole history: what every scrape cost before the per-job timelines
  were kept between scrapes;
- ``full_walk_s``: the part of that same scrape spent in the per-job
  timelines (``JobTimeline.advance`` + ``goodput``), timed inside it: no
  separate pass reads the history first and warms the caches for it;
- ``warm_s``: the median of later scrapes, 15 s of new progress per job
  apart (the Prometheus scrape interval): what a scrape costs now.

Run: ``python -m bench.metrics_scrape [--jobs 64] [--hours 24]``. The last
line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:
    sys.exit("run the benchmarks from the repository root: python -m bench.metrics_scrape")

from supervisor import metrics
from supervisor.core.goodput import Goodput
from supervisor.metrics import StoreCollector, build_registry, exposition
from supervisor.store import Store
from supervisor.views.timeline import CHECKPOINT_STATS_KIND, JobTimeline

STEP_EVERY_S = 5.0
SAVE_EVERY_S = 300.0
SCRAPE_EVERY_S = 15.0


class TimedTimeline(JobTimeline):
    """The collector's per-job timeline, adding the time spent in it to ``spent_s``."""

    spent_s = 0.0

    def advance(self, store: Store, now_s: float) -> None:
        started = time.perf_counter()
        try:
            super().advance(store, now_s)
        finally:
            TimedTimeline.spent_s += time.perf_counter() - started

    def goodput(self, now_s: float) -> Goodput:
        started = time.perf_counter()
        try:
            return super().goodput(now_s)
        finally:
            TimedTimeline.spent_s += time.perf_counter() - started


def _fill(store: Store, jobs: int, start_s: float, end_s: float) -> None:
    for index in range(jobs):
        job_id = str(1000 + index)
        record = {"attempt": 2, "nodes": [f"n{index}-{k}" for k in range(16)],
                  "restarts": [["rank_signal", 1]], "final_reason": ""}  # fmt: skip
        store.upsert_job(job_id, state="running", record=record, now_s=start_s, name="llm",
                         original_nodes=16, world_size=16, min_nodes=8)  # fmt: skip
        detail = {"explanation": "", "attempt": 1, "actions": []}
        store.record_decision(job_id, None, "submitted", "starting", "none", detail, start_s + 10)
        store.start_attempt(job_id, 1, nodes=["a"], resumed_from=None, now_s=start_s + 10)
        fault_s = start_s + (end_s - start_s) / 2
        step, t = 0, start_s + 20
        resumed = False
        while t < end_s:
            if not resumed and t >= fault_s:
                store.record_decision(job_id, None, "running", "recovering", "rank_signal",
                                      detail, t)  # fmt: skip
                store.start_attempt(job_id, 2, nodes=["a"], resumed_from="/c/step-1", now_s=t + 60)
                t, resumed = t + 70, True
            step += 1
            store.record_progress(job_id, step, t)
            if int(t) % int(SAVE_EVERY_S) < STEP_EVERY_S:
                store.record_checkpoint(job_id, step, f"/ckpt/{job_id}/step-{step}", t)
                store.record_observation(job_id, CHECKPOINT_STATS_KIND,
                                         {"stall_s": 0.2, "write_s": 4.0}, t)  # fmt: skip
            t += STEP_EVERY_S


def _advance(store: Store, jobs: int, from_s: float, to_s: float) -> None:
    """Every job trains on from ``from_s`` to ``to_s``."""
    for index in range(jobs):
        job_id = str(1000 + index)
        last = store.progress_for(job_id, since_s=from_s - 60)
        step = last[-1].step if last else 0
        t = from_s
        while t < to_s:
            step += 1
            store.record_progress(job_id, step, t)
            t += STEP_EVERY_S


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--scrapes", type=int, default=5)
    args = parser.parse_args()
    end_s = time.time()
    start_s = end_s - args.hours * 3600
    with tempfile.TemporaryDirectory() as where, Store.open(Path(where) / "resurgo.db") as store:
        built = time.perf_counter()
        _fill(store, args.jobs, start_s, end_s)
        print(f"bench: {args.jobs} jobs, {args.hours:g} h each, filled in "
              f"{time.perf_counter() - built:.1f} s", file=sys.stderr)  # fmt: skip

        clock = [end_s]
        collector = StoreCollector(store, cluster_nodes=lambda: args.jobs * 16,
                                   connected_agents=lambda: 0, drains_allowed_per_hour=lambda: 1,
                                   clock=lambda: clock[0])  # fmt: skip
        registry = build_registry(collector)

        metrics.JobTimeline = TimedTimeline  # type: ignore[misc]
        started = time.perf_counter()
        exposition(registry)
        cold_s = time.perf_counter() - started
        full_walk_s = TimedTimeline.spent_s

        warm = []
        for _ in range(args.scrapes):
            _advance(store, args.jobs, clock[0], clock[0] + SCRAPE_EVERY_S)
            clock[0] += SCRAPE_EVERY_S
            started = time.perf_counter()
            exposition(registry)
            warm.append(time.perf_counter() - started)
        warm_s = statistics.median(warm)
        rows = store.progress_for("1000")
    result = {
        "jobs": args.jobs,
        "hours": args.hours,
        "progress_rows_per_job": len(rows),
        "full_walk_s": round(full_walk_s, 3),
        "cold_s": round(cold_s, 3),
        "warm_s": round(warm_s, 3),
        "cold_over_warm": round(cold_s / warm_s, 1) if warm_s > 0 else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
