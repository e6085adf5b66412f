"""``resurgo-supervisor``: the head-node daemon that turns what it hears into recoveries.

One asyncio loop holds it together (DESIGN §2-§3):

- the API (:mod:`supervisor.api`) takes agents' events and heartbeats and the
  in-job drivers' questions; :class:`Supervisor`'s :class:`~supervisor.intake.Intake`
  layer is its :class:`~supervisor.api.JobDirectory` over the SQLite store;
- a poll task registers newly submitted jobs (:mod:`supervisor.jobs`) and
  reads Slurm (``squeue``/``sinfo``) every ``poll_s``; a failed read is
  "unknown" and changes nothing (:mod:`supervisor.polling`);
- a tick task releases waits (evidence windows, backoff), turns expired
  agent leases into :class:`~supervisor.core.observations.LeaseExpired` and
  retries unfinished actions every ``reconcile_s``;
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
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import uvloop

from agent.wire.errors import ConfigError, ResurgoError
from agent.wire.periodic import every
from agent.wire.protocol import RETRY_MAX_S, EventKind
from supervisor import jobs as jobfiles
from supervisor.act.executor import Executor, Validator
from supervisor.act.node_checks import CheckSettings, NodeCheckRunner
from supervisor.act.ticket_hook import ticket_hook
from supervisor.act.validation import Limits, ValidationProcess
from supervisor.api import bound_port, build_app, build_metrics_app, serve, shutdown
from supervisor.config import SupervisorConfig, describe, load_config
from supervisor.core import silence
from supervisor.core.drains import storm_holds
from supervisor.core.goodput import interval_push, mtbf_estimate
from supervisor.core.intents import DRAIN_REASON_PREFIX
from supervisor.core.model import (
    ClusterView,
    JobState,
    record_from_json,
)
from supervisor.core.observations import (
    AgentEvent,
    LeaseExpired,
    RelaunchFinished,
    SilenceShared,
    Tick,
)
from supervisor.core.policy import Policy
from supervisor.core.probation import NodeHistory, release
from supervisor.core.recovery import fast_path_started
from supervisor.core.stragglers import find_stragglers
from supervisor.errors import SlurmError
from supervisor.intake import TrackedJob
from supervisor.logs import setup_logging
from supervisor.looplag import LoopLag
from supervisor.manifests import ManifestReader
from supervisor.metrics import StoreCollector, build_registry, exposition
from supervisor.polling import SlurmWatch
from supervisor.slurm import Slurm, SlurmClient
from supervisor.slurm.parse import SlurmNode
from supervisor.store import Actor, CheckResult, LeaseRow, Store
from supervisor.store.modes import make_private
from supervisor.views.timeline import node_faults

log = logging.getLogger("resurgo.supervisor")


class Supervisor(SlurmWatch):
    """The daemon's state and tasks, in layers, each in a module of its own:

    - :class:`~supervisor.intake.Intake`: the API's :class:`~supervisor.api.JobDirectory`;
    - :class:`~supervisor.deciding.Deciding`: the decision task;
    - :class:`~supervisor.polling.SlurmWatch`: job registration and Slurm polling;
    - this class: the state they share, the lifecycle, and the timers.
    """

    def __init__(
        self,
        config: SupervisorConfig,
        policy: Policy,
        *,
        slurm: Slurm | None = None,
        validate_fn: Validator | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.policy = policy
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
        )
        self.node_checks = NodeCheckRunner(
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
        self.rights = None
        self.avoid = []
        self.jobs: dict[str, TrackedJob] = {}
        self.manifest_reader = ManifestReader(self._take_save_stats)
        self.cluster = ClusterView()
        self._queue = asyncio.Queue()
        self._bad_job_dirs = set()
        self._stop = asyncio.Event()
        self._cluster_known = asyncio.Event()
        self._policy_said_for = None
        # Leases in the store were renewed before this start; their agents
        # could not call in while no supervisor was up (see tick()).
        self._started_s = clock()
        # When this process itself was held up (an overloaded or stalled event
        # loop), agents' heartbeats waited in its sockets: (monotonic time,
        # seconds late) of each late tick, so leases get that time back.
        self._stalls: deque[tuple[float, float]] = deque()
        self._last_tick_mono: float | None = None
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
        self._load_jobs()
        collector = StoreCollector(
            self.store,
            cluster_nodes=lambda: self.cluster.size,
            connected_agents=self.connected_agents,
            drains_allowed_per_hour=self._drains_allowed_per_hour,
            clock=self.clock,
            may_drain=lambda: self.cluster.may_drain,
            open_tickets=self._open_tickets,
            drain_storm=lambda: storm_holds(
                self.policy, self.blamed(self.cluster, self.clock()).recent_blames
            ),
        )
        registry = build_registry(collector)
        lag = LoopLag(registry)
        jobs_dir = str(self.config.jobs_path.resolve())
        scrape = functools.partial(exposition, registry)
        metrics_at = self.config.metrics_address()
        app = build_app(
            self,
            metrics=scrape if metrics_at is None else None,
            jobs_dir=jobs_dir,
            facts=self.public_facts,
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
        tasks = [
            asyncio.create_task(lag.run(), name="loop-lag"),
            asyncio.create_task(self._decide_loop(), name="decide"),
            asyncio.create_task(self._every(self.config.poll_s, self.poll), name="poll"),
            asyncio.create_task(self._every(self.config.tick_s, self.tick), name="tick"),
            asyncio.create_task(
                self._every(self.config.reconcile_s, self._ask_reconcile), name="reconcile"
            ),
            asyncio.create_task(
                self._every(self.config.interval_check_s, self._recommend), name="interval"
            ),
            asyncio.create_task(
                self._every(self.config.interval_check_s, self.probation), name="probation"
            ),
            asyncio.create_task(
                self._every(self.config.straggler_check_s, self.check_stragglers),
                name="stragglers",
            ),
            asyncio.create_task(self._every(WAL_CHECKPOINT_S, self.checkpoint_wal), name="wal"),
        ]
        warm = asyncio.create_task(self._warm_validation(), name="warm-validation")
        try:
            await self._until_stopped(tasks)
        finally:
            log.info("supervisor stopping")
            for each in runners:
                await shutdown(each)
            for task in (*tasks, warm):
                task.cancel()
            await self.manifest_reader.aclose()
            await asyncio.gather(*tasks, warm, return_exceptions=True)
            await self.executor.validation.aclose()
            self.store.close()  # writes every lease's last renewal

    async def _warm_validation(self) -> None:
        """Start the checkpoint validation process now: the first recovery's choice of
        checkpoint would otherwise wait for its import of torch (seconds on a busy
        head node, between a fault and the relaunch)."""
        started = time.monotonic()
        try:
            await self.executor.validation.start()
        except Exception:
            log.exception("starting the checkpoint validation process failed; the first "
                          "validation starts it again")  # fmt: skip
            return
        log.info("checkpoint validation ready (started in %.1f s)", time.monotonic() - started)

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
        unfinished = [job_id for job_id, job in self.jobs.items() if not job.record.state.terminal]
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

    def _load_jobs(self) -> None:
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
            self.jobs[row.job_id] = job

    # ------------------------------------------------------------------
    # Timers: leases, waits, probation, intervals, stragglers.

    async def tick(self) -> None:
        """Release waits, expire leases, write new leases out.

        A lease counts from this daemon's start at the earliest: while no
        supervisor was up the agents could not renew theirs, and the time
        the previous one was down is no evidence that a node is lost. Agents
        that kept retrying through the outage wait up to
        :data:`agent.wire.protocol.RETRY_MAX_S` between tries, so the first
        leases after a start get that time on top.
        """
        now = self.clock()
        for job_id, job in self.jobs.items():
            if job.record.state is JobState.RECOVERING:
                self._enqueue(job_id, Tick())
            elif self._relaunch_never_started(job, now):
                reason = (
                    f"no agent of attempt {job.record.attempt} called in within "
                    f"{self.policy.relaunch_start_timeout_s:.0f} s of the relaunch"
                )
                log.warning("job %s: %s", job_id, reason)
                self._enqueue(job_id, RelaunchFinished(job.record.attempt, False, reason))
        self.settle_anomalies()
        self.settle_hangs()
        held_up_s = self._stalled_s(time.monotonic())
        if now - self._started_s > self.config.lease_s + RETRY_MAX_S:
            self._expire_leases(now, self.config.lease_s + held_up_s)
        self.store.flush_leases()

    def _relaunch_never_started(self, job: TrackedJob, now: float) -> bool:
        """A relaunched step whose agents never called in (Slurm kept its nodes busy)."""
        record = job.record
        if record.state is not JobState.STARTING or not fast_path_started(record):
            return False
        if now - record.state_since_s < self.policy.relaunch_start_timeout_s:
            return False
        return record.attempt not in job.incarnations.values()

    def _stalled_s(self, mono_s: float) -> float:
        """Seconds this process was held up within the last lease period (late ticks).

        An overloaded supervisor answers heartbeats late; without this it
        would take its own slowness for lost nodes and recover (even drain)
        healthy ones.
        """
        tick_s = self.config.tick_s
        if self._last_tick_mono is not None:
            late = mono_s - self._last_tick_mono - tick_s
            if late > max(tick_s, 1.0):
                self._stalls.append((mono_s, late))
                log.warning("supervisor held up %.1f s: leases get the time back", late)
        self._last_tick_mono = mono_s
        while self._stalls and mono_s - self._stalls[0][0] > self.config.lease_s:
            self._stalls.popleft()
        return sum(late for _, late in self._stalls)

    def _expire_leases(self, now: float, lease_s: float) -> None:
        expired = self.store.expired_leases(now, lease_s)
        if not expired:
            return
        live = {
            job_id: [
                lease
                for lease in self.store.leases_for(job_id)
                if lease.incarnation not in job.stopped and self._current(job, lease.incarnation)
            ]
            for job_id, job in self.jobs.items()
            if not job.record.state.terminal
        }
        silent_s = {
            (lease.job_id, lease.node): now - lease.last_seen_s
            for leases in live.values()
            for lease in leases
        }
        quiet = silence.quiet_by_job(silent_s, silence.quiet_after_s(lease_s))
        all_quiet = sum(len(nodes) for nodes in quiet.values())
        shared: set[str] = set()
        for lease in expired:
            owner = self.jobs.get(lease.job_id)
            if lease.job_id in shared:
                continue
            if lease.job_id not in live or owner is None:
                self.store.drop_leases(lease.job_id, [lease.node])
                continue
            agents = frozenset(row.node for row in live[lease.job_id])
            if lease.node not in agents:
                self.store.drop_leases(lease.job_id, [lease.node])
                continue
            job_quiet = quiet.get(lease.job_id, frozenset())
            verdict = silence.common_cause(
                agents,
                job_quiet,
                len(silent_s),
                all_quiet,
                self.policy.silence_share,
                self.policy.silence_min_agents,
            )
            if verdict.common:
                shared.add(lease.job_id)
                self._excuse_silence(lease.job_id, owner, live[lease.job_id], job_quiet, now)
                log.warning(
                    "job %s: agents on %s silent for up to %.0f s (lease %.0f s): %s; "
                    "no node blamed, Slurm decides",
                    lease.job_id, ",".join(sorted(job_quiet)), now - lease.last_seen_s,
                    lease_s, verdict.reason,
                )  # fmt: skip
                self._enqueue(lease.job_id, SilenceShared(tuple(sorted(job_quiet)), verdict.reason))
                continue
            self.store.drop_leases(lease.job_id, [lease.node])
            log.warning(
                "job %s: agent on %s silent for %.0f s (lease %.0f s): %s",
                lease.job_id, lease.node, now - lease.last_seen_s, lease_s, verdict.reason,
            )  # fmt: skip
            self._enqueue(lease.job_id, LeaseExpired(lease.node))

    def _excuse_silence(
        self,
        job_id: str,
        job: TrackedJob,
        leases: Sequence[LeaseRow],
        quiet: frozenset[str],
        now: float,
    ) -> None:
        """The quiet agents' leases count again from ``now``; Slurm is read afresh.

        Renewed, not dropped: an agent that stays silent while its peers come
        back expires again one lease later, then alone, as a node fault.
        Forgetting the last sighting makes the next poll report the job's
        Slurm state (ended, requeued, running) to the core again.
        """
        for lease in leases:
            if lease.node in quiet:
                self.store.touch_lease(job_id, lease.node, lease.incarnation, now)
        job.last_seen = None

    async def checkpoint_wal(self) -> None:
        """Fold the store's write-ahead log into the database, in a worker thread."""
        await asyncio.to_thread(self.store.checkpoint_wal)

    async def _recommend(self) -> None:
        self.recommend_intervals()

    async def probation(self) -> None:
        """Return nodes drained once for a transient fault after probation, once healthy.

        Only Resurgo's own drains whose Slurm reason is still Resurgo's (an
        operator's later drain is theirs to undo); never a lemon. Health is the
        configured ``probation_check`` command (``{node}`` replaced) exiting 0,
        else the node answering Slurm and not DOWN.
        """
        now = self.clock()
        due = [
            drain
            for drain in self.store.open_drains()
            if drain.drained_by is Actor.SUPERVISOR
            and now - drain.drained_s >= self.policy.probation_s
        ]
        if not due:
            return
        try:
            nodes = await self.slurm.nodes()
        except SlurmError as error:
            log.warning("probation: sinfo failed, nothing concluded: %s", error)
            return
        for drain in due:
            node = nodes.get(drain.node)
            if node is None or not node.drained or not node.reason.startswith(DRAIN_REASON_PREFIX):
                continue
            attempt = int(drain.action_id.split("/")[1]) if drain.action_id else 0
            blames = [row for row in self.store.blame_history(drain.node) if row.counts_as_blame]
            users = self.store.job_users()
            history = NodeHistory(
                drain.node,
                tuple(row.drained_s for row in blames),
                blame_users=tuple(
                    users.get(row.job_id or "") or f"job {row.job_id}" for row in blames
                ),
                drained_at_s=drain.drained_s,
                drain_job_id=drain.job_id or "",
                drain_attempt=attempt,
                failed_check_s=max(
                    (c.ended_s or 0.0 for c in self.store.node_checks_for(drain.node)
                     if c.result is CheckResult.FAILED),
                    default=None,
                ),
            )  # fmt: skip
            healthy = await self._node_healthy(node)
            resume = release(history, healthy, now, self.policy)
            if resume is not None:
                log.info("node %s: probation over and healthy; returning it to service", node.name)
                self._act(resume.job_id, (resume,))

    async def _node_healthy(self, node: SlurmNode) -> bool:
        if not self.config.probation_check:
            return not (node.down or node.not_responding)
        argv = [
            part.replace("{node}", node.name) for part in shlex.split(self.config.probation_check)
        ]
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
            )
            return await asyncio.wait_for(process.wait(), self.config.slurm_timeout_s) == 0
        except (OSError, TimeoutError) as error:
            log.warning("probation check of %s failed to run: %s", node.name, error)
            return False

    def _checkpoint_root(self, job_id: str) -> Path | None:
        job = self.jobs.get(job_id)
        return None if job is None else Path(job.spec.ckpt_root)

    def recommend_intervals(self) -> None:
        """Push the Daly interval from the cluster's MTBF and each job's save cost."""
        now = self.clock()
        rows = self.store.list_jobs()
        if not rows or self.cluster.size == 0:
            return
        span = now - min(row.created_s for row in rows)
        if span <= 0:
            return
        node_mtbf = mtbf_estimate(node_faults(self.store), span, self.cluster.size)
        for job_id, job in self.jobs.items():
            if job.record.state is not JobState.RUNNING or job.save_cost is None:
                continue
            _, stall_s, write_s = job.save_cost
            push = interval_push(
                job_id, job.record.attempt, job.interval_s, node_mtbf,
                len(job.record.nodes), stall_s, write_s,
            )  # fmt: skip
            if push is not None:
                job.interval_s = push.interval_s
                log.info(
                    "job %s: checkpoint interval %.0f s (node MTBF %.0f s, save stall %.2f s)",
                    job_id, push.interval_s, node_mtbf or 0.0, stall_s,
                )  # fmt: skip
                self._act(job_id, (push,))

    async def check_stragglers(self) -> None:
        """Compare each running job's ranks' compute times; report a straggler while it lasts."""
        now = self.clock()
        for job_id, job in self.jobs.items():
            if job.record.state is not JobState.RUNNING:
                continue
            found = find_stragglers(
                job.compute.values(),
                factor=self.policy.straggler_factor,
                min_steps=self.policy.straggler_min_steps,
            )
            for straggler in found:
                payload = {
                    "global_rank": straggler.global_rank,
                    "compute_p50_s": straggler.p50_s,
                    "reference_s": straggler.reference_s,
                    "ratio": round(straggler.ratio, 3),
                    "steps_observed": straggler.observed,
                    "attempt": job.record.attempt,
                }
                row = self.store.record_observation(
                    job_id, EventKind.STRAGGLER.value, payload, now, node=straggler.node
                )
                log.warning("job %s: straggler on %s: %s", job_id, straggler.node, straggler.detail)
                seen = AgentEvent(
                    EventKind.STRAGGLER,
                    straggler.node,
                    row.event_id,
                    now,
                    global_rank=straggler.global_rank,
                    detail=straggler.detail,
                )
                self._enqueue(job_id, seen, row.event_id)


# How often the store's write-ahead log is checkpointed off the event loop
# (Store.checkpoint_in_background): at 4,096 agents it grows ~1,000 pages in 10 s.
WAL_CHECKPOINT_S = 2.0


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
        config, policy = load_config(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as error:
        print(f"resurgo-supervisor: {error}", file=sys.stderr)
        return 2
    setup_logging(config.log_json)
    # The daemon holds ~10^5 long-lived objects per thousand agents; CPython's
    # default thresholds ran a full collection every few seconds, each a
    # 25-120 ms stop of the event loop (bench/RESULTS.md: p99 at 1,024 agents
    # 39 -> 11 ms). Young collections every 50,000 allocations, full ones rare.
    gc.set_threshold(50_000, 50, 1000)
    _return_freed_buffers()
    try:
        supervisor = Supervisor(config, policy)
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
