"""``resurgo-supervisor``: the head-node daemon that turns what it hears into recoveries.

One asyncio loop holds it together (DESIGN §2-§3):

- the API (:mod:`supervisor.api`) takes agents' events and heartbeats and the
  in-job drivers' questions; :class:`Supervisor`'s :class:`~supervisor.intake.Intake`
  half is its :class:`~supervisor.api.JobDirectory` over the SQLite store;
- a poll task registers newly submitted jobs (:mod:`supervisor.jobs`) and
  reads Slurm (``squeue``/``sinfo``) every ``poll_s``; a failed read is
  "unknown" and changes nothing;
- a tick task releases waits (evidence windows, backoff), turns expired
  agent leases into :class:`~supervisor.observations.LeaseExpired` and
  retries unfinished actions every ``reconcile_s``;
- every ``straggler_check_s`` each running job's ranks are compared by the
  compute time they measure (:mod:`supervisor.stragglers`): a straggler is
  reported to the core as long as it lasts;
- a WAL task folds the store's write-ahead log into the database
  from a worker thread every ``WAL_CHECKPOINT_S``, off the event loop;
- one decision task takes observations in arrival order, runs the pure
  :func:`~supervisor.policy.decide`, stores the new record, the decision and
  the planned actions in ONE transaction, then has the
  :class:`~supervisor.executor.Executor` carry them out, feeding what they
  report back in.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvloop

from agent.errors import ConfigError, ResurgoError
from agent.periodic import every
from agent.protocol import RETRY_MAX_S, Event, EventKind
from supervisor import jobs as jobfiles
from supervisor import silence
from supervisor.api import bound_port, build_app, build_metrics_app, serve, shutdown
from supervisor.config import SupervisorConfig, describe, load_config
from supervisor.errors import SlurmError
from supervisor.executor import Executor, Validator
from supervisor.goodput import interval_push, mtbf_estimate
from supervisor.intake import Intake, TrackedJob
from supervisor.intents import DRAIN_REASON_PREFIX, Intent, RequeueSmaller, ResumeNode
from supervisor.logs import setup_logging
from supervisor.looplag import LoopLag
from supervisor.manifests import ManifestReader
from supervisor.metrics import StoreCollector, build_registry, exposition
from supervisor.model import (
    ClusterView,
    JobRecord,
    JobState,
    new_record,
    record_from_json,
    record_to_json,
)
from supervisor.observations import (
    AgentEvent,
    LeaseExpired,
    Observation,
    RelaunchFinished,
    SilenceShared,
    SlurmJobSeen,
    SlurmNodeSeen,
    Tick,
    from_event,
)
from supervisor.policy import Decision, Policy, decide, permits
from supervisor.probation import NodeHistory, avoid_list, lifted_outside, release
from supervisor.reconcile import KIND_OF, intent_of
from supervisor.recovery import drain_limit, fast_path_started
from supervisor.slurm import SlurmClient, rights
from supervisor.slurm.parse import NodeState, SlurmJob, SlurmNode
from supervisor.slurm.rights import Rights
from supervisor.store import ActionState, Actor, EventSource, LeaseRow, Store, TicketRow
from supervisor.store.modes import make_private
from supervisor.stragglers import find_stragglers
from supervisor.ticket_hook import ticket_hook
from supervisor.timeline import node_faults

log = logging.getLogger("resurgo.supervisor")


class Supervisor(Intake):
    """The daemon's state and tasks; the API's :class:`~supervisor.api.JobDirectory` is
    its :class:`~supervisor.intake.Intake` half."""

    def __init__(
        self,
        config: SupervisorConfig,
        policy: Policy,
        *,
        slurm: SlurmClient | None = None,
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
            clock=clock,
            ticket_hook=ticket_hook(config.ticket_hook),
        )
        # May this supervisor drain? Asked of Slurm at the first poll that reads the nodes.
        self.rights: Rights | None = None
        # The nodes the user's next jobs should leave out, and why (see avoid_list).
        self.avoid: list[dict[str, Any]] = []
        self.jobs: dict[str, TrackedJob] = {}
        self.manifest_reader = ManifestReader(self._take_save_stats)
        self.cluster = ClusterView()
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._bad_job_dirs: set[str] = set()
        self._stop = asyncio.Event()
        # Set by the first poll that read the nodes: no decision is taken before.
        self._cluster_known = asyncio.Event()
        # The cluster size the policy was last described for (see _say_policy).
        self._policy_said_for: int | None = None
        # Leases in the store were renewed before this start; their agents
        # could not call in while no supervisor was up (see tick()).
        self._started_s = clock()
        # When this process itself was held up (an overloaded or stalled event
        # loop), agents' heartbeats waited in its sockets: (monotonic time,
        # seconds late) of each late tick, so leases get that time back.
        self._stalls: deque[tuple[float, float]] = deque()
        self._last_tick_mono: float | None = None
        self.port: int | None = None

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
        )
        runner = await serve(app, self.config.listen_host, self.config.listen_port)
        self.port = bound_port(runner)
        runners = [runner]
        if metrics_at is not None:
            runners.append(await serve(build_metrics_app(scrape), *metrics_at))
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
        try:
            await self._stop.wait()
        finally:
            log.info("supervisor stopping")
            for each in runners:
                await shutdown(each)
            for task in tasks:
                task.cancel()
            await self.manifest_reader.aclose()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.store.close()  # writes every lease's last renewal

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
    # Registration: jobs submitted into the state directory.

    async def register_new_jobs(self, slurm_jobs: dict[int, SlurmJob] | None) -> None:
        """Register every job directory not yet in the store (see :mod:`supervisor.jobs`)."""
        jobs_dir = self.config.jobs_path
        if not jobs_dir.is_dir():
            return
        for directory in sorted(jobs_dir.iterdir()):
            job_id = directory.name
            if job_id.startswith(".") or job_id in self.jobs or job_id in self._bad_job_dirs:
                continue
            if not job_id.isdigit() or not directory.is_dir():
                continue
            try:
                spec = jobfiles.read_spec(directory)
                secret = jobfiles.read_secret(directory)
            except ConfigError as error:
                if (directory / jobfiles.SPEC_NAME).exists():
                    log.error("job %s not registered: %s", job_id, error)
                    self._bad_job_dirs.add(job_id)
                continue  # still being written
            # Registered only once Slurm lists the job and says whose it is: a
            # failed squeue or an unnamed user decides nothing (next poll).
            slurm_job = None if slurm_jobs is None else slurm_jobs.get(int(job_id))
            if slurm_job is None or not slurm_job.user_name:
                continue
            owner = jobfiles.owner_name(directory)
            if owner != slurm_job.user_name:
                log.error(
                    "job %s not registered: %s is owned by %s but Slurm runs the job "
                    "for %s", job_id, directory, owner, slurm_job.user_name,
                )  # fmt: skip
                self._bad_job_dirs.add(job_id)
                continue
            now = self.clock()
            record = new_record(
                job_id,
                spec.nodes,
                spec.submitted_s or now,
                min_nodes=spec.floor,
                unit=spec.unit,
                procs_per_node=spec.procs_per_node,
            )
            self.store.upsert_job(
                job_id,
                state=record.state.value,
                record=_doc(record),
                now_s=now,
                name=spec.name,
                original_nodes=spec.nodes,
                min_nodes=spec.floor,
                secret_path=str(directory / jobfiles.SECRET_NAME),
            )
            self.jobs[job_id] = TrackedJob(record=record, secret=secret, spec=spec)
            log.info(
                "job %s registered: %s, %d node(s) (min %d, unit %d), checkpoints in %s",
                job_id, spec.name, spec.nodes, spec.floor, spec.unit, spec.ckpt_root,
            )  # fmt: skip

    # ------------------------------------------------------------------
    # Slurm polling and timers.

    async def poll(self) -> None:
        """Read Slurm once: register new jobs, refresh the cluster view, observe each job."""
        read_s = self.clock()
        try:
            slurm_jobs = await self.slurm.jobs()
        except SlurmError as error:
            log.warning("squeue failed, nothing concluded: %s", error)
            slurm_jobs = None
        await self.register_new_jobs(slurm_jobs)
        nodes_read_s = self.clock()
        try:
            nodes = await self.slurm.nodes()
        except SlurmError as error:
            log.warning("sinfo failed, nothing concluded: %s", error)
            nodes = None
        if nodes is not None and self.rights is None:
            self.rights = await self._detect_rights()
        now = self.clock()
        if nodes is not None and self.rights is not None:
            self._note_lifted_drains(nodes, nodes_read_s, now)
            self.cluster = self._cluster_view(nodes, now)
            self._cluster_known.set()
            self._say_policy()
        for job_id, job in self.jobs.items():
            if job.record.state.terminal:
                continue
            if slurm_jobs is not None:
                seen = slurm_jobs.get(int(job_id))
                if seen is not None:
                    self._observe_slurm_job(job_id, job, seen, read_s)
            if nodes is not None:
                self._observe_nodes(job_id, job, nodes)

    async def _detect_rights(self) -> Rights | None:
        """Whether this supervisor may drain (None: Slurm could not be asked; next poll)."""
        try:
            found = await rights.detect(self.slurm, self.config.slurm_rights)
        except SlurmError as error:
            log.warning("could not ask Slurm whether this user may drain nodes: %s", error)
            return None
        log.info("slurm rights: %s", found.describe())
        self.store.set_fact(
            "rights",
            {"mode": found.mode, "operator": found.operator, "why": found.describe()},
            self.clock(),
        )
        return found

    def _drains_allowed_per_hour(self) -> int:
        return drain_limit(self.policy, self.cluster.size) if self.cluster.may_drain else 0

    def _open_tickets(self) -> list[TicketRow]:
        """The drain tickets that keep their node out of the user's jobs now."""
        return self.store.open_tickets(self.clock() - self.policy.probation_s)

    def public_facts(self) -> dict[str, Any]:
        """What ``/healthz`` adds for ``resurgo submit``: the mode and the nodes to avoid."""
        mode = None if self.rights is None else self.rights.mode
        return {"mode": mode, "avoid_nodes": self.avoid}

    def _say_policy(self) -> None:
        """Log what the policy permits on the cluster as it is now: at the first
        read of the nodes, and again whenever their number changes."""
        size = self.cluster.size
        if size == self._policy_said_for:
            return
        self._policy_said_for = size
        if self.rights is not None and not self.rights.operator:
            log.info(
                "policy on %d nodes: no drain (%s); a node blamed %d times within %g d is a lemon",
                size, self.rights.describe(), self.policy.lemon_blames,
                self.policy.lemon_window_s / 86400,
            )  # fmt: skip
            return
        log.info("policy %s", permits(self.policy, size))

    def _note_lifted_drains(self, nodes: dict[str, SlurmNode], read_s: float, now: float) -> None:
        """Record Resurgo's drains that someone lifted with Slurm's own tools as undone.

        Skips a node whose ResumeNode is in flight: that resume is Resurgo's
        own, recorded when the executor finishes it.
        """
        ours = [
            (drain.node, drain.drained_s)
            for drain in self.store.open_drains()
            if drain.drained_by is Actor.SUPERVISOR
        ]
        lifted = lifted_outside(ours, nodes, read_s)
        if not lifted:
            return
        resuming = {
            row.args.get("node")
            for row in self.store.unfinished_actions()
            if row.kind == KIND_OF[ResumeNode]
        }
        for node in (name for name in lifted if name not in resuming):
            if self.store.record_lifted_outside(node, now_s=now):
                log.info(
                    "node %s: Resurgo's drain was lifted outside Resurgo; its blame no "
                    "longer counts towards the lemon list",
                    node,
                )

    def _cluster_view(self, nodes: dict[str, SlurmNode], now: float) -> ClusterView:
        drained = frozenset(n for n, node in nodes.items() if node.drained)
        down = frozenset(n for n, node in nodes.items() if node.down or node.not_responding)
        lemons = self.store.lemons(self.policy.lemon_blames, self.policy.lemon_window_s, now)
        idle = frozenset(n for n, node in nodes.items() if node.state is NodeState.IDLE)
        may_drain = self.rights is None or self.rights.operator
        tickets = [] if may_drain else self._open_tickets()
        self.avoid = avoid_list(lemons, tickets, self.policy)
        return ClusterView(
            usable=frozenset(nodes) - drained - down,
            idle=idle - drained - down,
            drained=drained,
            down=down,
            drains_last_hour=len(self.store.drains_since(now - 3600, by=Actor.SUPERVISOR)),
            lemons=frozenset(lemon.node for lemon in lemons) | {t.node for t in tickets},
            lemon_blames=tuple((lemon.node, lemon.drains) for lemon in lemons),
            lemon_window_s=self.policy.lemon_window_s,
            may_drain=may_drain,
        )

    def _observe_slurm_job(
        self, job_id: str, job: TrackedJob, seen: SlurmJob, read_s: float
    ) -> None:
        job.slurm_nodes = seen.nodes
        # The same sighting is news again once the record moved (Slurm's own
        # requeue adopted while Slurm already runs the job again: now it starts).
        key = (seen.state.value, seen.nodes, seen.restart_count, job.record.state.value)
        if key == job.last_seen:
            return
        job.last_seen = key
        observation = SlurmJobSeen(
            seen.state.value, seen.nodes, seen.restart_count, seen.state_reason
        )
        self._queue.put_nowait(_Sighting(job_id, observation, read_s))

    def _stale(self, sighting: _Sighting) -> bool:
        """Whether Slurm was read before a requeue of the job finished (or while it runs).

        Such a sighting may show the job still RUNNING on its old nodes, and
        decided after the requeue it would pass for the requeued job's start:
        it is dropped, and the next poll reports the job afresh.
        """
        for row in self.store.list_actions(sighting.job_id, states=_REQUEUE_TOUCHED):
            if row.kind != KIND_OF[RequeueSmaller] or row.started_s is None:
                continue
            if row.finished_s is None or row.finished_s > sighting.read_s:
                return True
        return False

    def _observe_nodes(self, job_id: str, job: TrackedJob, nodes: dict[str, SlurmNode]) -> None:
        for name in job.record.nodes:
            node = nodes.get(name)
            bad = node is not None and (node.down or node.not_responding)
            if bad and name not in job.nodes_flagged:
                job.nodes_flagged.add(name)
                assert node is not None
                self._enqueue(
                    job_id,
                    SlurmNodeSeen(
                        name,
                        down=node.down,
                        not_responding=node.not_responding,
                        drained=node.drained,
                    ),
                )
            elif not bad:
                job.nodes_flagged.discard(name)

    async def tick(self) -> None:
        """Release waits, expire leases, write new leases out.

        A lease counts from this daemon's start at the earliest: while no
        supervisor was up the agents could not renew theirs, and the time
        the previous one was down is no evidence that a node is lost. Agents
        that kept retrying through the outage wait up to
        :data:`agent.protocol.RETRY_MAX_S` between tries, so the first
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
            history = NodeHistory(
                drain.node,
                tuple(
                    row.drained_s
                    for row in self.store.blame_history(drain.node)
                    if row.counts_as_blame
                ),
                drained_at_s=drain.drained_s,
                drain_job_id=drain.job_id or "",
                drain_attempt=attempt,
            )
            healthy = await self._node_healthy(node)
            resume = release(history, healthy, now, self.policy)
            if resume is not None:
                log.info("node %s: probation over and healthy; returning it to service", node.name)
                self._queue.put_nowait(_Act(resume.job_id, (resume,)))

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

    async def _ask_reconcile(self) -> None:
        # The executor is used by the decision task alone: it runs the reconcile.
        self._queue.put_nowait(_RECONCILE)

    async def reconcile(self) -> None:
        """Finish unfinished actions (after a restart, or after Slurm was unreachable)."""
        for job_id, observation in await self.executor.reconcile(self.clock()):
            await self.apply(job_id, observation)

    async def resume_recoveries(self) -> None:
        """After a restart: carry each unfinished job's newest decision on.

        Executing its intents again runs what is unfinished and replays what
        finished actions reported (a validated checkpoint), which the previous
        daemon may have died before deciding on.
        """
        for job_id, job in list(self.jobs.items()):
            if job.record.state.terminal:
                continue
            decisions = [d for d in self.store.decisions_for(job_id) if d.detail.get("actions")]
            if not decisions:
                continue
            intents = []
            for action_id in decisions[-1].detail["actions"]:
                row = self.store.get_action(action_id)
                if row is not None:
                    intents.append(intent_of(row))
            log.info("job %s: resuming its last decision (%d action(s))", job_id, len(intents))
            for seen in await self.executor.execute(job_id, intents, self.clock()):
                await self.apply(job_id, seen)

    async def replay_undecided(self) -> None:
        """After a restart: decide again on each unfinished job's agent events stored
        after the newest one a decision names.

        The API acknowledges an event once it is stored and the decision task
        takes it up a moment later (seconds, while it carries a recovery out);
        a supervisor killed in between would never decide on it, and the agent
        does not send it again. Replaying events already decided on is safe:
        agents' retries deliver events more than once, and the core keeps what
        it already knows (a known checkpoint, an exit already collected, a
        rank that finished). Reports of earlier launches stay undecided, and
        stragglers are measured again at the next check instead.
        """
        for job_id, job in list(self.jobs.items()):
            if job.record.state.terminal:
                continue
            named = {row.event_id for row in self.store.decisions_for(job_id) if row.event_id}
            events = self.store.events_for(job_id, kinds=_REPLAYED_KINDS)
            cursor = max((row.seq for row in events if row.event_id in named), default=0)
            for row in events:
                if row.seq <= cursor or row.source is not EventSource.AGENT:
                    continue
                event = Event(
                    EventKind(row.kind), job_id, row.node or "", row.event_id,
                    row.agent_seq or 0, row.time_s, row.payload,
                )  # fmt: skip
                if self._current(job, event.incarnation):
                    await self.apply(job_id, from_event(event), row.event_id)

    # ------------------------------------------------------------------
    # Deciding.

    def _enqueue(self, job_id: str, observation: Observation, ref: str | None = None) -> None:
        self._queue.put_nowait((job_id, observation, ref))

    async def _decide_loop(self) -> None:
        # Deciding needs the cluster view (usable, idle and drained nodes): a
        # relaunch decided on an empty view would requeue the job with the few
        # nodes it still holds. Until Slurm answers once, observations wait.
        await self._cluster_known.wait()
        await self.reconcile()
        await self.resume_recoveries()
        await self.replay_undecided()
        while True:
            await self._handle(await self._queue.get())

    async def settle(self) -> None:
        """Handle everything queued so far (the decision task's work, run to empty)."""
        while not self._queue.empty():
            await self._handle(self._queue.get_nowait())

    async def _handle(self, item: _Item) -> None:
        try:
            if isinstance(item, _Reconcile):
                await self.reconcile()
            elif isinstance(item, _Sighting):
                job = self.jobs.get(item.job_id)
                if job is not None and self._stale(item):
                    log.info(
                        "job %s: Slurm's %s from before a requeue finished ignored; "
                        "polling again", item.job_id, item.observation.state,
                    )  # fmt: skip
                    job.last_seen = None
                else:
                    await self.apply(item.job_id, item.observation)
            elif isinstance(item, _Act):
                for seen in await self.executor.execute(item.job_id, item.intents, self.clock()):
                    await self.apply(item.job_id, seen)
            else:
                job_id, observation, ref = item
                await self.apply(job_id, observation, ref)
        except Exception:
            log.exception("deciding on %r failed; continuing", item)

    async def apply(self, job_id: str, observation: Observation, ref: str | None = None) -> None:
        """Decide on one observation, persist, act, and decide on what acting reported."""
        job = self.jobs.get(job_id)
        if job is None:
            return
        before = job.record
        now = self.clock()
        decision = decide(before, observation, now, self.policy, self.cluster)
        after = decision.record
        if after == before and not decision.intents:
            return
        self._persist(job_id, before, decision, ref, now)
        job.record = after
        if after.attempt != before.attempt:
            self.store.drop_leases(job_id)
            job.compute.clear()  # the new launch's ranks measure afresh
        if after.state is not before.state or decision.intents:
            _log_decision(job_id, before, decision)
        for seen in await self.executor.execute(job_id, decision.intents, now):
            await self.apply(job_id, seen)

    def _persist(
        self, job_id: str, before: JobRecord, decision: Decision, ref: str | None, now: float
    ) -> None:
        after = decision.record
        # A record that only took news in (a newer checkpoint, a straggler
        # measured) decides nothing and starts nothing: committed without the
        # fsync, which on a busy head node held the event loop up to 0.1 s.
        # Whatever moves the job, plans an action or records a decision is fsynced.
        routine = (
            after.state is before.state
            and after.attempt == before.attempt
            and not decision.intents
            and decision.cause is None
        )
        with self.store.transaction(durable=not routine):
            self.store.upsert_job(
                job_id,
                state=after.state.value,
                record=_doc(after),
                now_s=now,
                world_size=len(after.nodes) or None,
            )
            if after.state is not before.state or decision.intents or decision.cause:
                self.store.record_decision(
                    job_id,
                    ref,
                    before.state.value,
                    after.state.value,
                    decision.cause.value if decision.cause else "none",
                    {
                        "explanation": decision.explanation,
                        "attempt": after.attempt,
                        "actions": [intent.action_id for intent in decision.intents],
                    },
                    now,
                )
            if after.attempt != before.attempt:
                self._end_attempt(job_id, before, decision, now)
            if after.nodes and after.state in (JobState.STARTING, JobState.RELAUNCHING):
                resumed = after.recovery.resume_from if after.recovery else None
                self.store.start_attempt(
                    job_id, after.attempt, nodes=after.nodes, resumed_from=resumed, now_s=now
                )
            if after.state.terminal:
                self._end_attempt(job_id, before, decision, now)
            self.executor.plan(job_id, decision.intents, now)

    def _end_attempt(self, job_id: str, before: JobRecord, decision: Decision, now: float) -> None:
        attempts = {row.attempt for row in self.store.attempts_for(job_id)}
        if before.attempt in attempts:
            cause = decision.cause.value if decision.cause else decision.record.state.value
            self.store.end_attempt(job_id, before.attempt, cause=cause, now_s=now)

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
                self._queue.put_nowait(_Act(job_id, (push,)))

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


class _Reconcile:
    """A queue item: run the executor's reconcile in the decision task."""


@dataclass(frozen=True)
class _Act:
    """A queue item: intents decided outside the core (an interval push) to plan and run."""

    job_id: str
    intents: tuple[Intent, ...]


@dataclass(frozen=True)
class _Sighting:
    """A queue item: the job as a poll that began at ``read_s`` saw it in Slurm."""

    job_id: str
    observation: SlurmJobSeen
    read_s: float


_RECONCILE = _Reconcile()
# How often the store's write-ahead log is checkpointed off the event loop
# (Store.checkpoint_in_background): at 4,096 agents it grows ~1,000 pages in 10 s.
WAL_CHECKPOINT_S = 2.0
# A requeue touched the job once it started: started, done or failed.
_REQUEUE_TOUCHED = (ActionState.STARTED, ActionState.DONE, ActionState.FAILED)
_Item = tuple[str, Observation, str | None] | _Reconcile | _Act | _Sighting
# Agents' events the core decides on, replayed after a restart (replay_undecided).
_REPLAYED_KINDS = (
    EventKind.RANK_EXITED,
    EventKind.HANG,
    EventKind.HEALTH_CHECK_FAILED,
    EventKind.CHECKPOINT_COMMITTED,
    EventKind.LAUNCHER_EXITED,
    EventKind.AGENT_STOPPED,
    EventKind.WORLD_MISMATCH,
)


def _doc(record: JobRecord) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(record_to_json(record))
    return document


def _log_decision(job_id: str, before: JobRecord, decision: Decision) -> None:
    after = decision.record
    log.info(
        "job %s: %s -> %s (attempt %d): %s%s",
        job_id,
        before.state.value,
        after.state.value,
        after.attempt,
        decision.explanation,
        "".join(f"\n  action {intent.action_id}" for intent in decision.intents),
        extra={
            "job_id": job_id,
            "from_state": before.state.value,
            "to_state": after.state.value,
            "cause": decision.cause.value if decision.cause else None,
            "actions": [intent.action_id for intent in decision.intents],
        },
    )


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
    return 0


__all__ = ["Supervisor", "main"]


if __name__ == "__main__":
    sys.exit(main())
