"""The supervisor load benchmark's measurements and the figures of one run.

CPU and run-queue samples at both ends of the window, the supervisor's loop-lag
histogram from its /metrics, the store read after the run, and the percentiles.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.load_harness import Supervisor
from supervisor.store import EventSource, Store


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def runqueue_wait_s(pid: int) -> float:
    """Seconds the process's threads were runnable but waiting for a CPU (schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def percentile(values: list[float], share: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


class Scraper:
    """A Prometheus-style scrape of ``/metrics`` every ``every_s`` in a thread of its own,
    with Prometheus' default 10 s timeout: each scrape's seconds, and how many failed."""

    def __init__(self, url: str, every_s: float = 15.0, timeout_s: float = 10.0) -> None:
        self.url, self.every_s, self.timeout_s = url, every_s, timeout_s
        self.seconds: list[float] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the scrapes (a scrape under way first ends or times out)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while True:
            started = time.perf_counter()
            try:
                urllib.request.urlopen(self.url + "/metrics", timeout=self.timeout_s).read()
            except OSError:
                self.failed += 1
            else:
                self.seconds.append(time.perf_counter() - started)
            if self._stop.wait(max(0.0, self.every_s - (time.perf_counter() - started))):
                return

    def figures(self) -> dict[str, Any]:
        """The scrapes' count, slowest and failures, for the run's JSON line."""
        return {
            "scrapes": len(self.seconds) + self.failed,
            "scrape_max_s": round(max(self.seconds), 3) if self.seconds else None,
            "scrapes_failed": self.failed,
        }


def loop_lag_buckets(url: str) -> dict[float, float]:
    """The supervisor's loop lag histogram from its /metrics: upper bound -> cumulative count."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "resurgo_supervisor_loop_lag_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }


def lag_quantile_ms(before: dict[float, float], after: dict[float, float], share: float) -> float:
    """The upper bound (ms) of the bucket holding the ``share`` quantile of the window's lags."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts[math.inf] if counts else 0.0
    for bound, count in counts.items():
        if total and count >= share * total:
            return bound * 1000
    return math.nan


def sample_usage(supervisor: Supervisor, generators: list[psutil.Process]) -> dict[str, float]:
    busy = psutil.cpu_times()
    return {
        "wall": time.monotonic(),
        "supervisor_cpu": cpu_seconds(supervisor.ps),
        "supervisor_system": supervisor.ps.cpu_times().system,
        "supervisor_wait": runqueue_wait_s(supervisor.process.pid),
        "generator_cpu": sum(cpu_seconds(process) for process in generators),
        "machine_busy": busy.user
        + busy.system
        + busy.nice
        + busy.irq
        + busy.softirq
        + getattr(busy, "steal", 0.0),
    }


def read_store(path: Path) -> tuple[set[str], dict[str, str]]:
    """Agents' event ids in the store, and each job's state."""
    with Store.open(path, create=False) as store:
        stored = {
            row.event_id
            for job in store.list_jobs()
            for row in store.events_for(job.job_id)
            if row.source is EventSource.AGENT
        }
        states = {job.job_id: job.state for job in store.list_jobs()}
    return stored, states


def run_figures(
    agents: int, jobs: int, args: argparse.Namespace, before: dict[str, float],
    after: dict[str, float], rss_mib: float, results: list[dict[str, Any]], stored: set[str],
    job_states: dict[str, str], logs: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    wall = after["wall"] - before["wall"]
    heartbeat_ms = [value for result in results for value in result["heartbeat_ms"]]
    event_ms = [value for result in results for value in result["event_ms"]]
    every_ms = heartbeat_ms + event_ms
    sent = {event_id for result in results for event_id in result["sent"]}
    acked = {event_id for result in results for event_id in result["acked"]}
    supervisor_cores = (after["supervisor_cpu"] - before["supervisor_cpu"]) / wall
    generator_cores = (after["generator_cpu"] - before["generator_cpu"]) / wall
    machine_cores = (after["machine_busy"] - before["machine_busy"]) / wall

    def rounded(value: float | None, digits: int = 2) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "agents": agents,
        "heartbeats": args.heartbeats,
        "jobs": jobs,
        "ranks_per_node": args.ranks_per_node,
        "window_s": round(wall, 1),
        "requests_per_s": round(len(every_ms) / wall, 1),
        "p50_ms": rounded(percentile(every_ms, 0.50)),
        "p99_ms": rounded(percentile(every_ms, 0.99)),
        "max_ms": rounded(max(every_ms, default=None)),
        "heartbeat_p50_ms": rounded(percentile(heartbeat_ms, 0.50)),
        "heartbeat_p99_ms": rounded(percentile(heartbeat_ms, 0.99)),
        "event_p50_ms": rounded(percentile(event_ms, 0.50)),
        "event_p99_ms": rounded(percentile(event_ms, 0.99)),
        "supervisor_cpu_cores": round(supervisor_cores, 3),
        "supervisor_system_cores": round(
            (after["supervisor_system"] - before["supervisor_system"]) / wall, 3
        ),
        "supervisor_cpu_us_per_request": round(
            supervisor_cores / max(len(every_ms), 1) * wall * 1e6
        ),
        "supervisor_rss_mib": round(rss_mib, 1),
        "supervisor_runqueue_wait_share": round(
            (after["supervisor_wait"] - before["supervisor_wait"]) / wall, 3
        ),
        "generator_cpu_cores": round(generator_cores, 3),
        "machine_busy_cores": round(machine_cores, 3),
        "other_cpu_cores": round(max(0.0, machine_cores - supervisor_cores - generator_cores), 3),
        "cpu_count": os.cpu_count(),
        "supervisor_pinned": bool(args.pin and len(os.sched_getaffinity(0)) >= 2),
        "events_sent": len(sent),
        "events_acknowledged": len(acked),
        "lost_events": None if args.floor else len(acked - stored) + len(sent - acked),
        # Acknowledged, yet not in the store: a broken promise of the supervisor.
        "acknowledged_not_stored": None if args.floor else len(acked - stored),
        # Still unacknowledged when the drain ended (a real agent keeps them spooled).
        "never_acknowledged": len(sent - acked),
        "heartbeats_sent": sum(result["heartbeats_sent"] for result in results),
        "heartbeat_failures": sum(result["heartbeat_failures"] for result in results),
        # Of those, in the measured window (the rest: the start, when every
        # agent connects within a second).
        "window_heartbeat_failures": sum(r["window_heartbeat_failures"] for r in results),
        "streams_opened": sum(result["streams_opened"] for result in results),
        "event_post_failures": sum(result["event_failures"] for result in results),
        "first_failure": next((r["first_failure"] for r in results if r["first_failure"]), ""),
        "jobs_not_running": sum(1 for state in job_states.values() if state != "running"),
        "supervisor_log_warnings": logs["WARNING"],
        "supervisor_log_errors": logs["ERROR"],
    }
