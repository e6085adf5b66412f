"""The supervisor's Prometheus metrics, read from the store at scrape time.

One explicit :class:`~prometheus_client.CollectorRegistry` holds one
collector, :class:`StoreCollector`: nothing is counted in the daemon's hot
paths, every scrape reads the store (the single source of truth, so a
restarted supervisor reports the same totals). Goodput and the recovery
durations come from a :class:`~supervisor.views.timeline.JobTimeline` per job,
which reads only what is new since the previous scrape: a week-long job
costs a scrape no more than a new one (``bench/metrics_scrape.py``). Each
timeline's summary is kept in the store (at most every ``summary_every_s``,
and by :meth:`StoreCollector.keep_summaries`, which the daemon calls as
often), so the first scrape after a restart reads only what came after it,
not every job's whole history. ``docs/operations.md``
lists every metric with its labels; names and units follow Prometheus
conventions (``_seconds``, ``_ratio``, ``_total``; ``promtool check metrics``
runs in the tests).

Per job (label ``job_id``, plus ``name`` on ``resurgo_job_info``): state,
goodput ratio, productive and badput seconds by cause, restarts by cause,
failures by class (``resurgo_failures_total``), time-to-detect and
time-to-recover histograms, world size now and original, last committed
step and checkpoint age, save stall and background write seconds of the
newest checkpoint, the recommended checkpoint interval.
Cluster: drains by cause, nodes drained by Resurgo, the per-node MTBF
estimate, connected agents, whether the supervisor may drain and its open
drain tickets by node, and ``resurgo_up`` (the supervisor answers).

Only jobs that are running or ended within ``ended_job_window_s`` are
exported, so series of long-gone jobs disappear instead of piling up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from supervisor.core.anomaly import AnomalyKind
from supervisor.core.goodput import Fact, RecoveryDurations, mtbf_estimate, recommended_interval
from supervisor.core.model import JobState
from supervisor.failure_config import CLASS_ACTIONS
from supervisor.store import JobRow, Store, TicketRow
from supervisor.views.documents import skipped_count
from supervisor.views.timeline import CHECKPOINT_STATS_KIND, JobTimeline, node_faults

logger = logging.getLogger(__name__)

STATES = (
    "submitted", "starting", "running", "recovering", "relaunching", "requeued",
    "completed", "failed", "cancelled",
)  # fmt: skip
TERMINAL = {"completed", "failed", "cancelled"}
# The node checks' results on /metrics, each from zero (and "open": not ended yet).
CHECK_RESULTS = ("passed", "failed", "expired", "open")
# The failure classes a rank's death is counted under, each from zero for every job.
FAILURE_CLASSES = tuple(failure_class.value for failure_class in CLASS_ACTIONS)
# Detection is seconds; recovery (validation, backoff, srun, checkpoint load) minutes.
DETECT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RECOVER_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
# How far a job's timeline may run ahead of the summary the store keeps of it: the
# most of its history (beyond the settling seconds) a restart's first scrape reads.
SUMMARY_EVERY_S = 60.0


def recovery_durations(facts: Iterable[Fact]) -> tuple[list[float], list[float]]:
    """(time to detect, time to recover) of each recovery in a timeline (see
    :class:`~supervisor.core.goodput.RecoveryDurations`)."""
    durations = RecoveryDurations()
    for fact in sorted(facts, key=lambda f: f.time_s):
        durations.feed(fact)
    return durations.detect_s, durations.recover_s


def _histogram(
    name: str, documentation: str, buckets: tuple[float, ...], samples: dict[str, list[float]]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=["job_id"])
    for job_id, values in samples.items():
        cumulative = [(str(bound), float(sum(v <= bound for v in values))) for bound in buckets]
        cumulative.append(("+Inf", float(len(values))))
        family.add_metric([job_id], cumulative, sum_value=sum(values))
    return family


class StoreCollector(Collector):
    """Everything in the module docstring, computed from the store on each scrape."""

    def __init__(
        self,
        store: Store,
        *,
        cluster_nodes: Callable[[], int],
        connected_agents: Callable[[], int],
        drains_allowed_per_hour: Callable[[], int],
        clock: Callable[[], float] = time.time,
        ended_job_window_s: float = 86400.0,
        may_drain: Callable[[], bool] = lambda: True,
        open_tickets: Callable[[], list[TicketRow]] = list,
        drain_storm: Callable[[], bool] = lambda: False,
        summary_every_s: float = SUMMARY_EVERY_S,
    ) -> None:
        """``may_drain``: whether the supervisor has Slurm operator rights;
        ``open_tickets``: the drain tickets that keep their node out now;
        ``drain_storm``: whether the storm brake holds now; ``summary_every_s``:
        how far a job's timeline runs ahead of its summary in the store."""
        self._drain_storm = drain_storm
        self._may_drain = may_drain
        self._open_tickets = open_tickets
        self._store = store
        self._cluster_nodes = cluster_nodes
        self._connected_agents = connected_agents
        self._drains_allowed_per_hour = drains_allowed_per_hour
        self._clock = clock
        self._ended_job_window_s = ended_job_window_s
        self._summary_every_s = summary_every_s
        # Per exported job: its timeline so far, so a scrape reads only what is new,
        # and up to when the store's summary of it goes.
        self._timelines: dict[str, JobTimeline] = {}
        self._kept: dict[str, float] = {}
        # Scrapes (two Prometheus servers) and keep_summaries() run in worker threads.
        self._lock = threading.Lock()

    def describe(self) -> list[Metric]:
        """No description up front: the families depend on the store (see collect)."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Read the store once and yield every family."""
        with self._lock:
            families = list(self._families(self._clock()))
        yield from families

    def keep_summaries(self) -> int:
        """Bring every exported job's timeline up to now and keep the summaries that
        moved in the store; return how many. The daemon calls this every
        ``summary_every_s``, so that a restart's first scrape reads little of each
        job's history even where nobody scraped before it."""
        with self._lock:
            now = self._clock()
            for row in self._exported(self._store.list_jobs(), now):
                self._timelines[row.job_id].advance(self._store, now, row)
            return self._keep(now, every_s=0.0)

    def _exported(self, rows: list[JobRow], now: float) -> list[JobRow]:
        """The jobs on /metrics, each with its timeline (from the store's summary, if
        it keeps a readable one); the timelines of the others are let go."""
        jobs = [
            row
            for row in rows
            if row.state not in TERMINAL or now - row.updated_s <= self._ended_job_window_s
        ]
        exported = {row.job_id for row in jobs}
        for job_id in set(self._timelines) - exported:
            del self._timelines[job_id]
            self._kept.pop(job_id, None)
        new = [row.job_id for row in jobs if row.job_id not in self._timelines]
        kept = self._store.timeline_summaries(new) if new else {}
        unread = []
        for job_id in new:
            timeline = JobTimeline(job_id)
            if job_id in kept:
                try:
                    timeline = JobTimeline.from_summary(job_id, kept[job_id])
                except ValueError as error:
                    unread.append(str(error))
            self._timelines[job_id] = timeline
            if timeline.upto_s is not None:
                self._kept[job_id] = timeline.upto_s
        if unread:
            logger.info("%d timeline summaries could not be read (first: %s); those jobs' "
                        "histories are read whole, once", len(unread), unread[0])  # fmt: skip
        return jobs

    def _keep(self, now: float, every_s: float) -> int:
        """Keep the summary of each timeline that ran ``every_s`` past its kept one."""
        due = []
        for job_id, timeline in self._timelines.items():
            upto_s, kept_s = timeline.upto_s, self._kept.get(job_id)
            if upto_s is None or (kept_s is not None and upto_s - kept_s <= every_s):
                continue
            summary = timeline.summary()
            if summary is not None:
                due.append((job_id, upto_s, summary))
        kept = self._store.keep_timeline_summaries(due, now)
        self._kept.update((job_id, upto_s) for job_id, upto_s, _ in due)
        return kept

    def _families(self, now: float) -> Iterator[Metric]:
        rows = self._store.list_jobs()
        jobs = self._exported(rows, now)
        per_job = self._job_families()
        detect: dict[str, list[float]] = {}
        recover: dict[str, list[float]] = {}
        faults = node_faults(self._store, rows)
        span = now - min((row.created_s for row in rows), default=now)
        cluster = self._cluster_nodes()
        node_mtbf = mtbf_estimate(faults, span, cluster) if span > 0 and cluster > 0 else None
        for row in jobs:
            self._collect_job(row, now, per_job, node_mtbf, detect, recover)
        try:
            self._keep(now, every_s=self._summary_every_s)
        except Exception:
            # The scrape stands without it: the next one keeps what is due then.
            logger.exception("keeping the jobs' timeline summaries in the store failed")
        yield from per_job.values()
        yield _histogram("resurgo_job_time_to_detect_seconds",
                         "Seconds from a fault (last progress) to its detection.",
                         DETECT_BUCKETS, detect)  # fmt: skip
        yield _histogram("resurgo_job_time_to_recover_seconds",
                         "Seconds from a detected fault to the first training step after it.",
                         RECOVER_BUCKETS, recover)  # fmt: skip
        yield from self._cluster_families(node_mtbf, now)

    def _job_families(self) -> dict[str, Any]:
        def gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        job = ["job_id"]
        return {
            "info": gauge("resurgo_job_info", "A supervised job (value 1), with its name.",
                          ["job_id", "name"]),
            "state": gauge("resurgo_job_state", "1 for the job's current state.",
                           ["job_id", "state"]),
            "goodput": gauge("resurgo_job_goodput_ratio",
                             "Productive share of the job's wall time so far.", job),
            "productive": gauge("resurgo_job_productive_seconds",
                                "Seconds of training that survive into the run.", job),
            "badput": gauge("resurgo_job_badput_seconds",
                            "Seconds lost, by cause.", ["job_id", "cause"]),
            "restarts": CounterMetricFamily("resurgo_job_restarts",
                                            "Restarts of the job, by cause.",
                                            labels=["job_id", "cause"]),
            "failures": CounterMetricFamily(
                "resurgo_failures",
                "Recoveries by their root cause's failure class (user_error, oom, storage, "
                "network, hardware, unknown).",
                labels=["job_id", "class"]),
            "storage_wait": gauge(
                "resurgo_job_storage_wait",
                "1 while the job waits for its checkpoint root's file system (a storage "
                "incident: jobs with the same filesystem label wait on one).",
                ["job_id", "filesystem"]),
            "world": gauge("resurgo_job_world_size_nodes", "Nodes the job runs on now.", job),
            "original": gauge("resurgo_job_original_world_size_nodes",
                              "Nodes the job was submitted with.", job),
            "spares": gauge("resurgo_job_spare_nodes",
                            "Hot spare nodes the job holds ready now.", job),
            "spares_wanted": gauge("resurgo_job_spare_nodes_wanted",
                                   "Hot spare nodes the job was submitted with.", job),
            "swaps": CounterMetricFamily("resurgo_job_spare_swaps",
                                         "Blamed nodes replaced by a hot spare, by cause.",
                                         labels=["job_id", "cause"]),
            "rollbacks": CounterMetricFamily("resurgo_job_rollbacks",
                                             "Rollbacks past a training anomaly, by its kind.",
                                             labels=["job_id", "kind"]),
            "skipped": CounterMetricFamily("resurgo_job_skipped_samples",
                                           "Global samples the rollbacks skipped.", labels=job),
            "progress": gauge("resurgo_job_step", "The job's latest training step.", job),
            "ended": gauge("resurgo_job_end_cause",
                           "1 for an ended job, labelled with why it ended.",
                           ["job_id", "cause"]),
            "nondeterministic": CounterMetricFamily(
                "resurgo_job_nondeterministic_resumes",
                "Resumes whose replayed steps differed from the run before the fault.",
                labels=["job_id"]),
            "stragglers": CounterMetricFamily(
                "resurgo_job_straggler_reports",
                "Times a node of the job was reported as a straggler.",
                labels=["job_id", "node"]),
            "step": gauge("resurgo_job_last_committed_step",
                          "Step of the newest committed checkpoint.", job),
            "age": gauge("resurgo_job_checkpoint_age_seconds",
                         "Seconds since the newest checkpoint was committed.", job),
            "stall": gauge("resurgo_job_save_stall_seconds",
                           "Seconds the newest save blocked training.", job),
            "write": gauge("resurgo_job_save_write_seconds",
                           "Seconds the newest save wrote in the background.", job),
            "interval": gauge("resurgo_job_recommended_checkpoint_interval_seconds",
                              "Daly's interval from the cluster MTBF and the save cost.", job),
        }  # fmt: skip

    def _collect_job(
        self,
        row: JobRow,
        now: float,
        families: dict[str, Any],
        node_mtbf: float | None,
        detect: dict[str, list[float]],
        recover: dict[str, list[float]],
    ) -> None:
        job_id = row.job_id
        record = row.record
        families["info"].add_metric([job_id, row.name], 1.0)
        for state in STATES:
            families["state"].add_metric([job_id, state], 1.0 if row.state == state else 0.0)
        timeline = self._timelines[job_id]
        timeline.advance(self._store, now, row)
        goodput = timeline.goodput(now)
        families["goodput"].add_metric([job_id], goodput.ratio)
        families["productive"].add_metric([job_id], goodput.productive_s)
        for kind, seconds in goodput.badput_s.items():
            families["badput"].add_metric([job_id, kind.value], seconds)
        for cause, count in record.get("restarts", []):
            families["restarts"].add_metric([job_id, cause], float(count))
        # Every class from zero, as for the node checks: a dashboard's increase() needs
        # a first sample of 0 to see the job's first failure of a class.
        failures = dict.fromkeys(FAILURE_CLASSES, 0.0)
        failures.update((name, float(count)) for name, count in record.get("failures", []))
        for name, count in sorted(failures.items()):
            families["failures"].add_metric([job_id, name], count)
        waiting_on = (record.get("recovery") or {}).get("storage_fs")
        if waiting_on and row.state == JobState.RECOVERING.value:
            families["storage_wait"].add_metric([job_id, waiting_on], 1.0)
        # Every node of the job from the start (at 0): a counter's first report
        # is then an increase that rate() and increase() can see.
        reports = {node: 0.0 for node in record.get("nodes", [])}
        reports.update((node, float(count)) for node, count in record.get("straggler_reports", []))
        for node, count in sorted(reports.items()):
            families["stragglers"].add_metric([job_id, node], count)
        if timeline.latest_step is not None:
            families["progress"].add_metric([job_id], float(timeline.latest_step))
        if row.state in TERMINAL:
            decisions = self._store.decisions_for(job_id)
            cause = decisions[-1].cause if decisions else "unknown"
            families["ended"].add_metric([job_id, cause], 1.0)
        diverged = self._store.count_events(job_id, "nondeterministic_resume")
        families["nondeterministic"].add_metric([job_id], float(diverged))
        nodes = len(record.get("nodes", []))
        families["world"].add_metric([job_id], float(nodes))
        families["original"].add_metric([job_id], float(row.original_nodes))
        families["spares"].add_metric([job_id], float(len(record.get("spare_nodes", []))))
        families["spares_wanted"].add_metric([job_id], float(record.get("spares_wanted", 0)))
        # Every restart cause at 0 swaps first: a counter's first report is then an
        # increase, and a job with no spare shows that none of its restarts was a swap.
        swaps = {cause: 0.0 for cause, _ in record.get("restarts", [])}
        swaps.update((cause, float(count)) for cause, count in record.get("swaps", []))
        for cause, count in sorted(swaps.items()):
            families["swaps"].add_metric([job_id, cause], count)
        # Every kind at 0 first, as for the swaps: the first rollback is an increase.
        rollbacks = {anomaly.value: 0.0 for anomaly in AnomalyKind}
        for seen in record.get("anomalies", []):
            if seen.get("action") in ("rollback", "drain"):
                rollbacks[seen["kind"]] = rollbacks.get(seen["kind"], 0.0) + 1.0
        for anomaly_kind, count in sorted(rollbacks.items()):
            families["rollbacks"].add_metric([job_id, anomaly_kind], count)
        skipped = float(skipped_count(record.get("skipped_samples", [])))
        families["skipped"].add_metric([job_id], skipped)
        newest = self._store.newest_checkpoint(job_id)
        if newest is not None:
            families["step"].add_metric([job_id], float(newest.step))
            families["age"].add_metric([job_id], max(0.0, now - newest.committed_s))
        stats = self._store.latest_event(job_id, CHECKPOINT_STATS_KIND)
        if stats is not None:
            stall, write = float(stats.payload["stall_s"]), float(stats.payload["write_s"])
            families["stall"].add_metric([job_id], stall)
            families["write"].add_metric([job_id], write)
            if node_mtbf is not None and nodes > 0:
                interval = recommended_interval(stall, write, node_mtbf / nodes)
                families["interval"].add_metric([job_id], interval)
        detect[job_id] = timeline.durations.detect_s
        recover[job_id] = timeline.durations.recover_s

    def _cluster_families(self, node_mtbf: float | None, now: float) -> Iterator[Metric]:
        drains = CounterMetricFamily(
            "resurgo_drains", "Nodes drained by Resurgo, by cause.", labels=["cause"]
        )
        counts: dict[str, int] = {}
        for drain in self._store.drains_since(0):
            counts[drain.cause] = counts.get(drain.cause, 0) + 1
        for cause, count in sorted(counts.items()):
            drains.add_metric([cause], float(count))
        yield drains
        blames = CounterMetricFamily(
            "resurgo_blames",
            "Nodes blamed by a decision, by what was done (drained, ticketed, checking, "
            "excluded, storm, slurm).",
            labels=["outcome"],
        )
        for outcome, count in sorted(self._store.blame_counts().items()):
            blames.add_metric([outcome], float(count))
        yield blames
        checks = CounterMetricFamily(
            "resurgo_node_checks",
            "The supervisor's own checks of nodes one job blamed, by result (passed, failed: "
            "drained; expired: no verdict; open: waiting or running).",
            labels=["result"],
        )
        counted = self._store.node_check_counts()
        # Every result from zero, so that a rate or an increase exists before the first check.
        for result in sorted({*CHECK_RESULTS, *counted}):
            checks.add_metric([result], float(counted.get(result, 0)))
        yield checks
        yield GaugeMetricFamily(
            "resurgo_drain_storm",
            "1 while the storm brake holds (many nodes blamed by several jobs at once): no "
            "node is drained or ticketed.",
            value=1.0 if self._drain_storm() else 0.0,
        )
        yield GaugeMetricFamily(
            "resurgo_drains_last_hour",
            "Nodes Resurgo drained in the last hour (the rate limit counts these).",
            value=float(len(self._store.drains_since(now - 3600.0))),
        )
        yield GaugeMetricFamily(
            "resurgo_drains_allowed_per_hour",
            "Drains the policy allows per hour (its share of the cluster, rounded down).",
            value=float(self._drains_allowed_per_hour()),
        )
        yield GaugeMetricFamily(
            "resurgo_drained_nodes",
            "Nodes Resurgo drained that are not back in service.",
            value=float(len({d.node for d in self._store.open_drains()})),
        )
        if node_mtbf is not None:
            yield GaugeMetricFamily(
                "resurgo_node_mtbf_seconds",
                "Estimated mean time between faults of one node.",
                value=node_mtbf,
            )
        yield GaugeMetricFamily(
            "resurgo_connected_agents",
            "Node agents whose lease is current.",
            value=float(self._connected_agents()),
        )
        yield GaugeMetricFamily(
            "resurgo_may_drain",
            "1: the supervisor has Slurm operator rights and drains blamed nodes; 0: it "
            "excludes them and raises drain tickets.",
            value=1.0 if self._may_drain() else 0.0,
        )
        tickets = GaugeMetricFamily(
            "resurgo_drain_tickets_open",
            "Open drain tickets by node: a blamed node the supervisor may not drain; an "
            "admin should drain and check it.",
            labels=["node"],
        )
        per_node: dict[str, int] = {}
        for ticket in self._open_tickets():
            per_node[ticket.node] = per_node.get(ticket.node, 0) + 1
        for node, count in sorted(per_node.items()):
            tickets.add_metric([node], float(count))
        yield tickets
        yield GaugeMetricFamily("resurgo_up", "The supervisor is serving (1).", value=1.0)


def build_registry(collector: StoreCollector) -> CollectorRegistry:
    """An explicit registry with the store collector (and nothing process-global)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(registry: CollectorRegistry) -> bytes:
    """The text exposition format of every metric in ``registry``."""
    return bytes(generate_latest(registry))
