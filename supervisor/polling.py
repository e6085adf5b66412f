"""What the daemon reads from Slurm: new jobs to register, the cluster, each job's state.

:class:`SlurmWatch` is the daemon's layer above :class:`~supervisor.deciding.Deciding`:

- :meth:`~SlurmWatch.register_new_jobs` registers every job directory that
  ``resurgo submit`` wrote (:mod:`supervisor.jobs`) once Slurm lists the job
  and its owner matches the directory's;
- :meth:`~SlurmWatch.poll` reads ``squeue``/``sinfo`` every ``poll_s`` (a
  failed read is "unknown" and changes nothing), asks Slurm once whether this
  supervisor may drain (drain or exclude mode), records Resurgo's drains that
  someone lifted outside Resurgo, refreshes the cluster view (usable, idle,
  drained, down, lemons, the nodes to avoid) and hands the decision task each
  job's new Slurm state and its nodes that went down.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agent.wire.errors import ConfigError
from supervisor import jobs as jobfiles
from supervisor.act.node_checks import Ended, NodeCheckRunner
from supervisor.act.reconcile import KIND_OF
from supervisor.cluster import Cluster
from supervisor.config import SupervisorConfig
from supervisor.core.decision import Policy
from supervisor.core.drains import after_check, drain_limit
from supervisor.core.intents import ResumeNode
from supervisor.core.leases import judge_nodes
from supervisor.core.model import ClusterView, new_record, record_to_doc
from supervisor.core.observations import SlurmJobSeen, SlurmNodeSeen
from supervisor.core.policy import permits
from supervisor.core.probation import avoid_list, held_by_checks, lifted_outside, ticketed
from supervisor.errors import SlurmError
from supervisor.jobtable import DecisionQueue, JobTable, SlurmSighting, TrackedJob
from supervisor.slurm import Slurm, rights
from supervisor.slurm.parse import NodeState, SlurmJob, SlurmNode
from supervisor.slurm.rights import Rights
from supervisor.store import Actor, CheckResult, Store, TicketRow

log = logging.getLogger("resurgo.supervisor")


class SlurmWatch:
    """Job registration and Slurm polling; what they see goes to the decision task."""

    def __init__(
        self,
        jobs: JobTable,
        store: Store,
        slurm: Slurm,
        node_checks: NodeCheckRunner,
        cluster: Cluster,
        decisions: DecisionQueue,
        config: SupervisorConfig,
        policy: Policy,
        clock: Callable[[], float],
    ) -> None:
        self.jobs = jobs
        self.store = store
        self.slurm = slurm
        self.node_checks = node_checks
        self.cluster = cluster
        self.decisions = decisions
        self.config = config
        self.policy = policy
        self.clock = clock
        # May this supervisor drain? Asked of Slurm at the first poll that reads the nodes.
        self.rights: Rights | None = None
        # The nodes the user's next jobs should leave out, and why (see avoid_list).
        self.avoid: list[dict[str, Any]] = []
        self._bad_job_dirs: set[str] = set()
        # The cluster size the policy was last described for (see _say_policy).
        self._policy_said_for: int | None = None

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
                spares=spec.spares,
                slurm_user=slurm_job.user_name,
            )
            self.store.upsert_job(
                job_id,
                state=record.state.value,
                record=record_to_doc(record),
                now_s=now,
                name=spec.name,
                original_nodes=spec.nodes,
                min_nodes=spec.floor,
                secret_path=str(directory / jobfiles.SECRET_NAME),
                slurm_user=slurm_job.user_name,
            )
            self.jobs.add(job_id, TrackedJob(record=record, secret=secret, spec=spec))
            log.info(
                "job %s registered: %s of %s, %d node(s) (min %d, unit %d), checkpoints in %s",
                job_id, spec.name, slurm_job.user_name, spec.nodes, spec.floor, spec.unit,
                spec.ckpt_root,
            )  # fmt: skip

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
        # Nodes Slurm reports lost: a handful among thousands, looked at once per poll.
        lost = (
            {} if nodes is None else {n: x for n, x in nodes.items() if x.down or x.not_responding}
        )
        if nodes is not None and self.rights is not None:
            self._note_lifted_drains(nodes, nodes_read_s, now)
            self.cluster.view = self._cluster_view(nodes, frozenset(lost), now)
            self.cluster.known.set()
            self._say_policy()
        if slurm_jobs is not None and self.rights is not None:
            for ended in await self.node_checks.sweep(slurm_jobs):
                self._check_ended(ended)
        for job_id, job in self.jobs.unfinished():
            if slurm_jobs is not None:
                seen = slurm_jobs.get(int(job_id))
                if seen is not None:
                    self._observe_slurm_job(job_id, job, seen, read_s)
            if nodes is not None:
                self._observe_nodes(job_id, job, lost)

    def _check_ended(self, ended: Ended) -> None:
        """Record a node check's end in its job's events and act on its verdict: a pass
        closes the node's drain tickets (its blame stands, its node stays in service),
        a failure drains it (:func:`supervisor.core.drains.after_check`)."""
        check, now = ended.check, self.clock()
        log.log(
            logging.WARNING if ended.result is CheckResult.FAILED else logging.INFO,
            "node %s: the supervisor's check %s (blamed by job %s): %s",
            check.node, ended.result.value, check.job_id, ended.detail,
        )  # fmt: skip
        self.store.record_observation(
            check.job_id,
            f"node_check_{ended.result.value}",
            {"slurm_job_id": check.slurm_job_id, "detail": ended.detail,
             "evidence": check.evidence, "check_id": check.check_id},
            now,
            node=check.node,
            observation_id=f"{check.job_id}/supervisor/node-check-{check.check_id}",
        )  # fmt: skip
        if ended.result is CheckResult.PASSED:
            self.store.close_tickets(check.node, now_s=now, by=Actor.SUPERVISOR)
        intents = after_check(
            check, ended.result, ended.detail, self.policy, self.cluster.fresh(now)
        )
        if intents:
            self.decisions.act(check.job_id, intents)

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
            {
                "mode": found.mode,
                "operator": found.operator,
                "why": found.describe(),
                "observe_only": self.config.observe_only,
            },
            self.clock(),
        )
        return found

    def drains_allowed_per_hour(self) -> int:
        """Resurgo's drains the policy allows an hour on the cluster as it is now."""
        view = self.cluster.view
        return drain_limit(self.policy, view.size) if view.may_drain else 0

    def open_tickets(self) -> list[TicketRow]:
        """The drain tickets that keep their node out of the user's jobs now."""
        return self.store.open_tickets(self.clock() - self.policy.probation_s)

    def public_facts(self) -> dict[str, Any]:
        """What ``/healthz`` adds for ``resurgo submit``: the mode, whether the supervisor
        only observes, and the nodes to avoid."""
        mode = None if self.rights is None else self.rights.mode
        return {
            "mode": mode,
            "observe_only": self.config.observe_only,
            "avoid_nodes": self.avoid,
        }

    def _say_policy(self) -> None:
        """Log what the policy permits on the cluster as it is now: at the first
        read of the nodes, and again whenever their number changes."""
        size = self.cluster.view.size
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

    def _cluster_view(
        self, nodes: dict[str, SlurmNode], down: frozenset[str], now: float
    ) -> ClusterView:
        drained = frozenset(n for n, node in nodes.items() if node.drained)
        policy = self.policy
        lemons = self.store.lemons(
            policy.lemon_blames, policy.lemon_window_s, now, policy.lemon_users
        )
        idle = frozenset(n for n, node in nodes.items() if node.state is NodeState.IDLE)
        may_drain = self.rights is None or self.rights.operator
        tickets = [] if may_drain else self.open_tickets()
        checks = held_by_checks(
            self.store.node_checks_since(now - 2 * self.policy.probation_s), now, self.policy
        )
        self.avoid = avoid_list(lemons, tickets, self.policy, checks)
        view = ClusterView(
            usable=frozenset(nodes) - drained - down,
            idle=idle - drained - down,
            drained=drained,
            down=down,
            drains_last_hour=self.cluster.drains_counted(now),
            lemons=frozenset(lemon.node for lemon in lemons),
            ticketed=ticketed([*tickets, *checks]),
            lemon_blames=tuple((lemon.node, lemon.drains) for lemon in lemons),
            lemon_window_s=self.policy.lemon_window_s,
            may_drain=may_drain,
        )
        return self.cluster.blamed(view, now)

    def _observe_slurm_job(
        self, job_id: str, job: TrackedJob, seen: SlurmJob, read_s: float
    ) -> None:
        job.slurm_nodes = seen.nodes
        # The same sighting is news again once the record moved (Slurm's own
        # requeue adopted while Slurm already runs the job again: now it starts).
        key = SlurmSighting(seen.state, seen.nodes, seen.restart_count, job.record.state)
        if key == job.last_seen:
            return
        job.last_seen = key
        observation = SlurmJobSeen(
            seen.state.value, seen.nodes, seen.restart_count, seen.state_reason
        )
        self.decisions.sighted(job_id, observation, read_s)

    def _observe_nodes(self, job_id: str, job: TrackedJob, lost: dict[str, SlurmNode]) -> None:
        """Hand the core the job's nodes Slurm reports lost (``lost``: down or not
        responding; see :func:`supervisor.core.leases.judge_nodes`, to which a node
        not listed is a node Slurm has nothing against)."""
        names = (*job.record.nodes, *job.record.spare_nodes)
        seen = {
            name: SlurmNodeSeen(
                name, down=node.down, not_responding=node.not_responding, drained=node.drained
            )
            for name in names
            if (node := lost.get(name)) is not None
        }
        if not seen and not job.nodes_flagged and not job.nodes_excused:
            return  # nothing to flag, nothing flagged to clear: the verdicts stay empty
        calling_in = {lease.node for lease in self.store.leases_for(job_id)}
        verdicts = judge_nodes(names, seen, calling_in, job.nodes_flagged, job.nodes_excused)
        job.nodes_flagged, job.nodes_excused = set(verdicts.flagged), set(verdicts.excused)
        for name in verdicts.newly_excused:
            log.info(
                "job %s: Slurm flags %s NOT_RESPONDING, but its agent still calls "
                "in: not a lost node until Slurm marks it DOWN or the lease lapses",
                job_id, name,
            )  # fmt: skip
        for report in verdicts.report:
            self.decisions.enqueue(job_id, report)
