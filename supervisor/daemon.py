"""``resurgo-supervisor``: the head-node daemon that turns what it hears into recoveries.

One asyncio loop holds it together (DESIGN §2-§3):

- the API (:mod:`supervisor.api`) takes agents' events and heartbeats and the
  in-job drivers' questions; the :class:`~supervisor.intake.Intake` component
  is its :class:`~supervisor.api.JobDirectory` over the SQLite store;
- a poll task registers newly submitted jobs (:mod:`supervisor.jobs`) and
  reads Slurm (``squeue``/``sinfo``) every ``poll_s``; a failed read is
  "unknown" and changes nothing (:mod:`supervisor.polling`);
- a tick task releases waits (evidence windows, backoff), turns expired
  agent leases into :class:`~supervisor.core.observations.LeaseExpired`
  (:mod:`supervisor.timers`) and retries unfinished actions every ``reconcile_s``;
- every ``straggler_check_s`` each running job's ranks are compared by the
  compute time they measure (:mod:`supervisor.core.stragglers`): a straggler is
  reported to the core as long as it lasts;
- a WAL task folds the store's write-ahead log into the database
  from a worker thread every ``WAL_CHECKPOINT_S``, off the event loop;
- one decision task takes observations in arrival order, runs the pure
  :func:`~supervisor.core.policy.decide`, stores the new record, the decision and
  the planned actions in ONE transaction, then has the
  :class:`~supervisor.act.executor.Executor` carry them out, feeding what they
  report back in (:mod:`supervisor.deciding`).

At start nothing is decided before Slurm answered once (the cluster view
decides where a job relaunches). Then the executor reconciles: an action
half done when the previous daemon died is finished exactly once; each
unfinished job's last decision is carried on, and the agents' events stored
after the newest one a decision names are decided on again (they were
acknowledged, perhaps never decided on). Agents' leases count from the
start, not from before the daemon went down. A Slurm sighting of a job read
before the supervisor's requeue of it finished is dropped and read again.
Reports from agents of an earlier launch (their ``agent_started`` names an
older attempt) are stored but not decided on: they describe ranks that are
already gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import json
import logging
import shlex
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import uvloop

from agent.wire.errors import ConfigError, ResurgoError
from agent.wire.periodic import every
from agent.wire.protocol import EventKind
from supervisor import jobs as jobfiles
from supervisor.act.executor import Executor, Validator
from supervisor.act.node_checks import CheckSettings, NodeCheckRunner
from supervisor.act.ticket_hook import ticket_hook
from supervisor.act.validation import Limits, ValidationProcess, WarmWhileNeeded
from supervisor.api import bound_port, build_app, build_metrics_app, serve, shutdown
from supervisor.cluster import Cluster
from supervisor.config import SupervisorConfig, describe, load_settings
from supervisor.core.drains import storm_holds
from supervisor.core.failure_rules import DEFAULT_RULES, Rule
from supervisor.core.model import record_from_json
from supervisor.core.policy import Policy
from supervisor.deciding import Deciding
from supervisor.failure_config import rules_table
from supervisor.intake import Intake
from supervisor.jobtable import JobTable, TrackedJob
from supervisor.logs import setup_logging
from supervisor.looplag import LoopLag
from supervisor.metrics import SUMMARY_EVERY_S, StoreCollector, build_registry, exposition
from supervisor.polling import SlurmWatch
from supervisor.slurm import Slurm, SlurmClient
from supervisor.store import Store
from supervisor.store.modes import make_private
from supervisor.timers import Timers

log = logging.getLogger("resurgo.supervisor")


class Supervisor:
    """The daemon: its components wired over one job table, and their lifecycle.

    - :attr:`jobs`: the :class:`~supervisor.jobtable.JobTable` every component shares;
    - :attr:`cluster`: the cluster view the poll refreshes and the decisions read;
    - :attr:`intake` (:class:`~supervisor.intake.Intake`): the API's
      :class:`~supervisor.api.JobDirectory`;
    - :attr:`polling` (:class:`~supervisor.polling.SlurmWatch`): job registration
      and Slurm polling;
    - :attr:`timers` (:class:`~supervisor.timers.Timers`): leases, waits,
      probation, intervals, stragglers;
    - :attr:`deciding` (:class:`~supervisor.deciding.Deciding`): the decision
      task, which the others hand what they observe.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        policy: Policy,
        *,
        slurm: Slurm | None = None,
        validate_fn: Validator | None = None,
        clock: Callable[[], float] = time.time,
        rules: tuple[Rule, ...] = DEFAULT_RULES,
    ) -> None:
        self.config = config
        self.policy = policy
        self.rules = rules
        self.clock = clock
        self.slurm = slurm or SlurmClient(timeout_s=config.slurm_timeout_s)
        state_dir = Path(config.state_dir)
        others_search = config.jobs_path.resolve().is_relative_to(state_dir.resolve())
        # Private before the store exists: nobody else can open it while it is created.
        make_private(state_dir, config.store_path, group=config.state_group,
                     others_search=others_search)  # fmt: skip
        self.store = Store.open(config.store_path)
        make_private(state_dir, config.store_path, group=config.state_group,
                     others_search=others_search)  # fmt: skip
        self.store.checkpoint_in_background()
        self.jobs = JobTable()
        self.executor = Executor(
            self.store,
            self.slurm,
            checkpoint_root_of=self._checkpoint_root,
            validate_fn=validate_fn,
            validation=ValidationProcess(
                Limits(
                    memory_mib=config.validation_memory_mib,
                    cpu_s=config.validation_cpu_s,
                    timeout_s=config.validation_timeout_s,
                )
            ),
            clock=clock,
            ticket_hook=ticket_hook(config.ticket_hook),
            observe_only=config.observe_only,
            storage_min_free_bytes=int(policy.storage_min_free_gb * 1e9),
            validate_ahead=config.validate_ahead,
        )
        node_checks = NodeCheckRunner(
            self.store,
            self.slurm,
            CheckSettings(
                command=config.node_check,
                sbatch_options=tuple(shlex.split(config.node_check_sbatch)),
                wait_s=config.node_check_wait_s,
                time_s=config.node_check_time_s,
            ),
            clock,
        )
        self.cluster = Cluster(self.store, policy, observe_only=config.observe_only)
        self.deciding = Deciding(
            self.jobs, self.store, self.executor, self.cluster, policy, clock, rules
        )
        self.intake = Intake(
            self.jobs, self.store, self.executor, self.deciding, config, policy, clock
        )
        self.polling = SlurmWatch(
            self.jobs, self.store, self.slurm, node_checks, self.cluster, self.deciding,
            config, policy, clock,
        )  # fmt: skip
        self.timers = Timers(
            self.jobs, self.store, self.slurm, self.cluster, self.deciding,
            self.intake.settle_waits, config, policy, clock,
        )  # fmt: skip
        self._stop = asyncio.Event()
        self.port: int | None = None
        # Why the daemon stopped on its own (a task that must run forever ended).
        self.failed: str | None = None

    # ------------------------------------------------------------------
    # Lifecycle.

    async def run(self) -> None:
        """Serve until SIGTERM/SIGINT (or :meth:`request_stop`), then shut down cleanly."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        self.load_jobs()
        collector = StoreCollector(
            self.store,
            cluster_nodes=lambda: self.cluster.view.size,
            connected_agents=self.connected_agents,
            drains_allowed_per_hour=self.polling.drains_allowed_per_hour,
            clock=self.clock,
            may_drain=lambda: self.cluster.view.may_drain,
            open_tickets=self.polling.open_tickets,
            drain_storm=lambda: storm_holds(
                self.policy, self.cluster.blamed(self.cluster.view, self.clock()).recent_blames
            ),
        )
        registry = build_registry(collector)

        async def keep_summaries() -> None:
            # In a worker thread: a store without summaries is read whole, once.
            await asyncio.to_thread(collector.keep_summaries)

        lag = LoopLag(registry)
        jobs_dir = str(self.config.jobs_path.resolve())
        scrape = functools.partial(exposition, registry)
        metrics_at = self.config.metrics_address()
        app = build_app(
            self.intake,
            metrics=scrape if metrics_at is None else None,
            jobs_dir=jobs_dir,
            facts=self.polling.public_facts,
            body_timeout_s=self.config.body_timeout_s,
            unauthenticated_buffer_bytes=self.config.unauthenticated_buffer_bytes,
            events_per_minute=self.config.events_per_minute,
        )
        runner = await serve(
            app,
            self.config.listen_host,
            self.config.listen_port,
            header_timeout_s=self.config.header_timeout_s,
        )
        self.port = bound_port(runner)
        runners = [runner]
        if metrics_at is not None:
            runners.append(
                await serve(
                    build_metrics_app(scrape),
                    *metrics_at,
                    header_timeout_s=self.config.header_timeout_s,
                )
            )
        log.info(
            "supervisor started: %s",
            json.dumps({**describe(self.config, self.policy), "url": self.url}),
        )
        config = self.config
        tasks = [
            asyncio.create_task(lag.run(), name="loop-lag"),
            asyncio.create_task(self.deciding.loop(), name="decide"),
            asyncio.create_task(self._every(config.poll_s, self.polling.poll), name="poll"),
            asyncio.create_task(self._every(config.tick_s, self.timers.tick), name="tick"),
            asyncio.create_task(
                self._every(config.reconcile_s, self.deciding.ask_reconcile), name="reconcile"
            ),
            asyncio.create_task(
                self._every(config.interval_check_s, self.timers.recommend), name="interval"
            ),
            asyncio.create_task(
                self._every(config.interval_check_s, self.timers.probation), name="probation"
            ),
            asyncio.create_task(
                self._every(config.straggler_check_s, self.timers.check_stragglers),
                name="stragglers",
            ),
            asyncio.create_task(
                self._every(WAL_CHECKPOINT_S, self.timers.checkpoint_wal), name="wal"
            ),
            asyncio.create_task(self._every(SUMMARY_EVERY_S, keep_summaries), name="summaries"),
        ]
        if self.executor.ahead is not None:
            tasks.append(asyncio.create_task(self.executor.ahead.run(), name="validate-ahead"))
        keeper = WarmWhileNeeded(
            self.executor.validation,
            also_stop=(self.executor.background,),
            start_early=config.validation_keep_warm,
        )
        warm = asyncio.create_task(
            self._every(VALIDATION_CHECK_S, lambda: keeper.check(len(self.jobs.unfinished()))),
            name="warm-validation",
        )
        try:
            await self._until_stopped(tasks)
        finally:
            log.info("supervisor stopping")
            for each in runners:
                await shutdown(each)
            for task in (*tasks, warm):
                task.cancel()
            await self.intake.manifest_reader.aclose()
            await asyncio.gather(*tasks, warm, return_exceptions=True)
            await self.executor.validation.aclose()
            await self.executor.background.aclose()
            self.store.close()  # writes every lease's last renewal

    async def _until_stopped(self, tasks: Sequence[asyncio.Task[None]]) -> None:
        """Wait for a stop request, or for one of the tasks that must run forever to end.

        A supervisor whose decision task died still answers agents and stores
        their events, and never decides on them again: a recovery stuck for
        good while everything looks alive. Such a supervisor stops with an
        error instead (:attr:`failed`), and its service manager restarts it;
        the restart finishes what was under way from the store.
        """
        stop = asyncio.create_task(self._stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait([stop, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        for task in done:
            if task is stop or task.cancelled():
                continue
            error = task.exception()
            self.failed = f"its {task.get_name()} task ended: {error!r}"
            log.critical(
                "supervisor stopping with an error: %s; its service manager restarts it "
                "and the restart carries every recovery on from the store",
                self.failed, exc_info=error,
            )  # fmt: skip

    def connected_agents(self) -> int:
        """Agents of unfinished jobs whose lease is current."""
        unfinished = [job_id for job_id, _ in self.jobs.unfinished()]
        return self.store.lease_count(unfinished, self.clock() - self.config.lease_s)

    def request_stop(self) -> None:
        """Ask :meth:`run` to stop (signal handlers call this)."""
        self._stop.set()

    @property
    def url(self) -> str:
        """How agents and drivers reach this supervisor."""
        return self.config.public_url(self.port)

    async def _every(self, period_s: float, tick: Callable[[], Awaitable[object]]) -> None:
        await every(period_s, tick, log, "supervisor")

    def load_jobs(self) -> None:
        """Rebuild memory from the store: records, secrets, specs, agent incarnations."""
        for row in self.store.list_jobs():
            record = record_from_json(json.dumps(row.record))
            directory = jobfiles.job_dir(self.config.jobs_path, row.job_id)
            try:
                spec = jobfiles.read_spec(directory)
                secret = jobfiles.read_secret(directory)
            except ConfigError as error:
                if not record.state.terminal:
                    log.error("job %s: its directory is unusable (%s)", row.job_id, error)
                continue
            job = TrackedJob(record=record, secret=secret, spec=spec)
            kinds = [EventKind.AGENT_STARTED, EventKind.AGENT_STOPPED]
            for event in self.store.events_for(row.job_id, kinds=kinds):
                incarnation = event.event_id.split("/")[2]
                if event.kind is EventKind.AGENT_STOPPED:
                    job.stopped.add(incarnation)  # its clean exit is no lost node
                    continue
                attempt = event.payload.get("attempt")
                if isinstance(attempt, int):
                    job.incarnations[incarnation] = attempt
            self.jobs.add(row.job_id, job)

    def _checkpoint_root(self, job_id: str) -> Path | None:
        job = self.jobs.get(job_id)
        return None if job is None else Path(job.spec.ckpt_root)


# How often the store's write-ahead log is checkpointed off the event loop
# (Store.checkpoint_in_background): at 4,096 agents it grows ~1,000 pages in 10 s.
WAL_CHECKPOINT_S = 2.0
# How often the validation child is started for a job, or stopped without one
# (supervisor.act.validation.WarmWhileNeeded).
VALIDATION_CHECK_S = 5.0
# How long a thread holds the GIL while another waits for it (main() says why).
SWITCH_INTERVAL_S = 0.0005


# glibc's M_MMAP_THRESHOLD and M_TRIM_THRESHOLD (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_BYTES = 64 << 10


def _return_freed_buffers() -> None:
    """Have glibc give large freed buffers back to the OS at once.

    The network hands the server its bytes in pieces of up to 256 KiB. glibc
    maps such a block on its own only until the first one is freed; from then
    on it raises its threshold and carves them out of the heap, where a burst
    of aborted uploads leaves free memory that is not returned (with this and
    the API's heap trim, 1.5 MiB kept after 300 aborted 8 MiB uploads against
    20.7 MiB without: bench/RESULTS.md, docs/security.md 7). A fixed threshold
    keeps every block from 64 KiB up in a mapping of its own, unmapped when
    freed. No-op off glibc.
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, 4 * _MMAP_THRESHOLD_BYTES)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``resurgo-supervisor``."""
    try:
        settings = load_settings(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as error:
        print(f"resurgo-supervisor: {error}", file=sys.stderr)
        return 2
    if settings.print_rules:
        print(rules_table(settings.rules))
        return 0
    config, policy = settings.config, settings.policy
    setup_logging(config.log_json)
    # The daemon holds ~10^5 long-lived objects per thousand agents; CPython's
    # default thresholds ran a full collection every few seconds, each a
    # 25-120 ms stop of the event loop (bench/RESULTS.md: p99 at 1,024 agents
    # 39 -> 11 ms). Young collections every 50,000 allocations, full ones rare.
    gc.set_threshold(50_000, 50, 1000)
    # The scrape, the Slurm answers' decoding and the WAL checkpoint run in threads
    # (each a second of CPU at 16,384 nodes). The event loop gives the GIL up at each
    # socket call and waits for it back: up to a switch interval each time, CPython's
    # 5 ms by default, so a frame of a few calls waited tens of ms behind a scrape.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    _return_freed_buffers()
    try:
        supervisor = Supervisor(config, policy, rules=settings.rules)
    except (ResurgoError, OSError) as error:
        print(f"resurgo-supervisor: {error}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        # uvloop's loop and transports cost about half of asyncio's per
        # heartbeat frame (bench/RESULTS.md), which is most of what the
        # supervisor does; nothing in it depends on which loop runs it.
        uvloop.run(supervisor.run())
    return 0 if supervisor.failed is None else 1


__all__ = ["Supervisor", "main"]


if __name__ == "__main__":
    sys.exit(main())
