"""The daemon's timers: leases, waits, probation, checkpoint intervals, stragglers.

:class:`Timers` runs what the daemon does on a clock rather than on news:

- :meth:`Timers.tick` (every ``tick_s``): a recovering job's waits released,
  a relaunch whose agents never called in given up
  (:func:`supervisor.core.periodic.tick_observation`), the intake's held
  anomalies and hang reports settled, expired leases decided on
  (:func:`supervisor.core.leases.expire`) with the time this process was held
  up given back, new leases written out;
- :meth:`Timers.probation`: Resurgo's drains returned to service once
  healthy (:func:`supervisor.core.probation.release`);
- :meth:`Timers.recommend_intervals`: the Daly interval pushed to running jobs;
- :meth:`Timers.check_stragglers`: each running job's ranks compared;
- :meth:`Timers.checkpoint_wal`: the store's write-ahead log folded in.

It observes (the store's leases and drains, ``sinfo``, the probation check
command, the event loop's lateness), asks the core, and hands the result to
the decision task.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
from collections import deque
from collections.abc import Callable

from agent.wire.protocol import EventKind
from supervisor.cluster import Cluster
from supervisor.config import SupervisorConfig
from supervisor.core.decision import Policy
from supervisor.core.goodput import mtbf_estimate
from supervisor.core.intents import DRAIN_REASON_PREFIX
from supervisor.core.leases import expire, leases_count
from supervisor.core.observations import RelaunchFinished, SilenceShared, StragglerReported
from supervisor.core.periodic import (
    compares_ranks,
    interval_due,
    probation_due,
    tick_observation,
)
from supervisor.core.probation import NodeHistory, release
from supervisor.core.stragglers import find_stragglers
from supervisor.errors import SlurmError
from supervisor.jobtable import DecisionQueue, JobTable
from supervisor.slurm import Slurm
from supervisor.slurm.parse import SlurmNode
from supervisor.store import CheckResult, Store
from supervisor.views.timeline import node_faults

log = logging.getLogger("resurgo.supervisor")


class Timers:
    """The periodic work over the job table and the store (the daemon schedules it)."""

    def __init__(
        self,
        jobs: JobTable,
        store: Store,
        slurm: Slurm,
        cluster: Cluster,
        decisions: DecisionQueue,
        settle_waits: Callable[[], None],
        config: SupervisorConfig,
        policy: Policy,
        clock: Callable[[], float],
    ) -> None:
        self.jobs = jobs
        self.store = store
        self.slurm = slurm
        self.cluster = cluster
        self.decisions = decisions
        self.settle_waits = settle_waits
        self.config = config
        self.policy = policy
        self.clock = clock
        # Leases in the store were renewed before this start; their agents
        # could not call in while no supervisor was up (see tick()).
        self.started_s = clock()
        # When this process itself was held up (an overloaded or stalled event
        # loop), agents' heartbeats waited in its sockets: (monotonic time,
        # seconds late) of each late tick, so leases get that time back.
        self._stalls: deque[tuple[float, float]] = deque()
        self.last_tick_mono: float | None = None

    async def tick(self) -> None:
        """Release waits, expire leases, write new leases out.

        A lease counts from this daemon's start at the earliest
        (:func:`supervisor.core.leases.leases_count`).
        """
        now = self.clock()
        for job_id, job in self.jobs.items():
            seen = tick_observation(job.record, job.incarnations.values(), now, self.policy)
            if isinstance(seen, RelaunchFinished):
                log.warning("job %s: %s", job_id, seen.reason)
            if seen is not None:
                self.decisions.enqueue(job_id, seen)
        self.settle_waits()
        held_up_s = self._stalled_s(time.monotonic())
        if leases_count(now, self.started_s, self.config.lease_s):
            self._expire_leases(now, self.config.lease_s + held_up_s)
        self.store.flush_leases()

    def _stalled_s(self, mono_s: float) -> float:
        """Seconds this process was held up within the last lease period (late ticks).

        An overloaded supervisor answers heartbeats late; without this it
        would take its own slowness for lost nodes and recover (even drain)
        healthy ones.
        """
        tick_s = self.config.tick_s
        if self.last_tick_mono is not None:
            late = mono_s - self.last_tick_mono - tick_s
            if late > max(tick_s, 1.0):
                self._stalls.append((mono_s, late))
                log.warning("supervisor held up %.1f s: leases get the time back", late)
        self.last_tick_mono = mono_s
        while self._stalls and mono_s - self._stalls[0][0] > self.config.lease_s:
            self._stalls.popleft()
        return sum(late for _, late in self._stalls)

    def _expire_leases(self, now: float, lease_s: float) -> None:
        """Decide on the leases that expired (:func:`supervisor.core.leases.expire`)."""
        expired = self.store.expired_leases(now, lease_s)
        if not expired:
            return
        live = {
            job_id: [
                lease
                for lease in self.store.leases_for(job_id)
                if lease.incarnation not in job.stopped and job.current(lease.incarnation)
            ]
            for job_id, job in self.jobs.unfinished()
        }
        for verdict in expire(expired, live, now, lease_s, self.policy):
            lease = verdict.lease
            if verdict.drop:
                self.store.drop_leases(lease.job_id, [lease.node])
            for renewed in verdict.renew:
                self.store.touch_lease(lease.job_id, renewed.node, renewed.incarnation, now)
            if isinstance(verdict.observation, SilenceShared):
                # Forgotten, the last sighting makes the next poll report the job's
                # Slurm state (ended, requeued, running) to the core again.
                self.jobs[lease.job_id].last_seen = None
            if verdict.observation is None:
                continue
            silent_s = now - lease.last_seen_s
            if isinstance(verdict.observation, SilenceShared):
                log.warning(
                    "job %s: agents on %s silent for up to %.0f s (lease %.0f s): %s; "
                    "no node blamed, Slurm decides",
                    lease.job_id, ",".join(verdict.observation.nodes), silent_s,
                    lease_s, verdict.reason,
                )  # fmt: skip
            else:
                log.warning(
                    "job %s: agent on %s silent for %.0f s (lease %.0f s): %s",
                    lease.job_id, lease.node, silent_s, lease_s, verdict.reason,
                )  # fmt: skip
            self.decisions.enqueue(lease.job_id, verdict.observation)

    async def checkpoint_wal(self) -> None:
        """Fold the store's write-ahead log into the database, in a worker thread."""
        await asyncio.to_thread(self.store.checkpoint_wal)

    async def recommend(self) -> None:
        """:meth:`recommend_intervals`, as a periodic task."""
        self.recommend_intervals()

    async def probation(self) -> None:
        """Return nodes drained once for a transient fault after probation, once healthy.

        Only Resurgo's own drains whose Slurm reason is still Resurgo's (an
        operator's later drain is theirs to undo); never a lemon. Health is the
        configured ``probation_check`` command (``{node}`` replaced) exiting 0,
        else the node answering Slurm and not DOWN.
        """
        now = self.clock()
        due = probation_due(self.store.open_drains(), now, self.policy)
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
                self.decisions.act(resume.job_id, (resume,))

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

    def recommend_intervals(self) -> None:
        """Push the Daly interval from the cluster's MTBF and each job's save cost."""
        now = self.clock()
        rows = self.store.list_jobs()
        size = self.cluster.view.size
        if not rows or size == 0:
            return
        span = now - min(row.created_s for row in rows)
        if span <= 0:
            return
        node_mtbf = mtbf_estimate(node_faults(self.store), span, size)
        for job_id, job in self.jobs.items():
            cost = None if job.save_cost is None else job.save_cost[1:]
            push = interval_due(job.record, cost, job.interval_s, node_mtbf)
            if push is None:
                continue
            assert job.save_cost is not None
            job.interval_s = push.interval_s
            log.info(
                "job %s: checkpoint interval %.0f s (node MTBF %.0f s, save stall %.2f s)",
                job_id, push.interval_s, node_mtbf or 0.0, job.save_cost.stall_s,
            )  # fmt: skip
            self.decisions.act(job_id, (push,))

    async def check_stragglers(self) -> None:
        """Compare each running job's ranks' compute times; report a straggler while it lasts."""
        now = self.clock()
        for job_id, job in self.jobs.items():
            if not compares_ranks(job.record):
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
                seen = StragglerReported(
                    straggler.node,
                    row.event_id,
                    now,
                    global_rank=straggler.global_rank,
                    detail=straggler.detail,
                )
                self.decisions.enqueue(job_id, seen, row.event_id)
