"""Metrics scrape cost: a restarted supervisor's first scrape, with and without the
stored timeline summaries, and the scrapes after it.

A store holds ``--jobs`` running jobs with ``--hours`` of history each (a
progress sample every 5 s, a checkpoint and its save statistics every 5
minutes, one recovery). Measured side by side in one run, each first scrape
by a supervisor just started (the store opened anew, a fresh collector):

- ``cold_without_summaries_s``: the first scrape on the store as filled, with
  no summary: every job's whole history is read (what every first scrape
  after a start cost before the summaries, and what the first one after the
  upgrade costs, once); ``full_walk_s``: the part of it spent in the per-job
  timelines (``JobTimeline.advance`` + ``goodput``), timed inside it;
- ``cold_s``: the first scrape after a restart once the store keeps the
  summaries, which lag the history by as much as they may in the daemon
  (``SUMMARY_EVERY_S`` of new progress per job written after them);
  ``cold_timelines_s``: its part in the per-job timelines;
- ``warm_s``: the median of later scrapes by that supervisor, 15 s of new
  progress per job apart (the Prometheus scrape interval).

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

from prometheus_client import CollectorRegistry

from supervisor import metrics
from supervisor.core.goodput import Goodput
from supervisor.metrics import SUMMARY_EVERY_S, StoreCollector, build_registry, exposition
from supervisor.store import JobRow, Store
from supervisor.views.timeline import CHECKPOINT_STATS_KIND, JobTimeline

STEP_EVERY_S = 5.0
SAVE_EVERY_S = 300.0
SCRAPE_EVERY_S = 15.0


class TimedTimeline(JobTimeline):
    """The collector's per-job timeline, adding the time spent in it to ``spent_s``."""

    spent_s = 0.0

    def advance(self, store: Store, now_s: float, row: JobRow | None = None) -> None:
        started = time.perf_counter()
        try:
            super().advance(store, now_s, row)
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
        with store.transaction(durable=False):  # one commit per job: a faster fill
            _fill_job(store, str(1000 + index), index, start_s, end_s)


def _fill_job(store: Store, job_id: str, index: int, start_s: float, end_s: float) -> None:
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


def _restart(path: Path, jobs: int, clock: list[float]) -> tuple[Store, CollectorRegistry]:
    """A supervisor just started: the store opened anew, a fresh collector; its time is
    ``clock[0]``."""
    store = Store.open(path)
    collector = StoreCollector(store, cluster_nodes=lambda: jobs * 16,
                               connected_agents=lambda: 0, drains_allowed_per_hour=lambda: 1,
                               clock=lambda: clock[0])  # fmt: skip
    return store, build_registry(collector)


def _timed_scrape(registry: CollectorRegistry) -> tuple[float, float]:
    """(seconds the scrape took, seconds of it in the per-job timelines)."""
    TimedTimeline.spent_s = 0.0
    started = time.perf_counter()
    exposition(registry)
    return time.perf_counter() - started, TimedTimeline.spent_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--scrapes", type=int, default=5)
    args = parser.parse_args()
    end_s = time.time()
    start_s = end_s - args.hours * 3600
    metrics.JobTimeline = TimedTimeline  # type: ignore[misc]
    with tempfile.TemporaryDirectory() as where:
        path = Path(where) / "resurgo.db"
        with Store.open(path) as store:
            built = time.perf_counter()
            _fill(store, args.jobs, start_s, end_s)
            rows = len(store.progress_for("1000"))
        print(f"bench: {args.jobs} jobs, {args.hours:g} h each, filled in "
              f"{time.perf_counter() - built:.1f} s", file=sys.stderr)  # fmt: skip

        # Before: no summary in the store; the scrape reads every history (and keeps them).
        clock = [end_s]
        store, registry = _restart(path, args.jobs, clock)
        with store:
            whole_s, full_walk_s = _timed_scrape(registry)
            # The history the summaries lag behind by as much as the daemon lets them.
            _advance(store, args.jobs, clock[0], clock[0] + SUMMARY_EVERY_S)
            clock[0] += SUMMARY_EVERY_S

        # After: a restart with the summaries in the store, then that supervisor's scrapes.
        store, registry = _restart(path, args.jobs, clock)
        with store:
            cold_s, cold_timelines_s = _timed_scrape(registry)
            warm = []
            for _ in range(args.scrapes):
                _advance(store, args.jobs, clock[0], clock[0] + SCRAPE_EVERY_S)
                clock[0] += SCRAPE_EVERY_S
                warm.append(_timed_scrape(registry)[0])
            warm_s = statistics.median(warm)
    result = {
        "jobs": args.jobs,
        "hours": args.hours,
        "progress_rows_per_job": rows,
        "cold_without_summaries_s": round(whole_s, 3),
        "full_walk_s": round(full_walk_s, 3),
        "cold_s": round(cold_s, 3),
        "cold_timelines_s": round(cold_timelines_s, 3),
        "warm_s": round(warm_s, 3),
        "without_over_with_summaries": round(whole_s / cold_s, 1) if cold_s > 0 else None,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
