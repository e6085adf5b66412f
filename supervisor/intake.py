"""What the supervisor hears from a job's agents and driver: the API's :class:`JobDirectory`.

:class:`Intake` is the half of :class:`supervisor.daemon.Supervisor` that the
HTTP API calls (synchronously, on the event loop, so each answer is a few
indexed store operations): it stores agents' events and heartbeats, turns
the current attempt's events into observations for the decision task,
records checkpoints and their save cost, checks resumes against the losses
reported before the fault, hands commands to the right agents, and answers
the in-job driver. The daemon half (polling, timers, deciding, acting) is in
:mod:`supervisor.daemon`; both share the :class:`TrackedJob` table.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from agent.checkpoint.format import SaveStats
from agent.checkpoint.layouts import step_in_path
from agent.wire import protocol
from agent.wire.protocol import (
    Command,
    CommandKind,
    DriverAction,
    DriverAnswer,
    DriverPhase,
    DriverRequest,
    Event,
    EventKind,
    HeartbeatReport,
)
from supervisor import manifests
from supervisor.act.executor import ALERT_KIND, Executor
from supervisor.act.reconcile import KIND_OF, command_attempt
from supervisor.config import SupervisorConfig
from supervisor.core.anomaly import AnomalyAction
from supervisor.core.goodput import Goodput
from supervisor.core.intents import RelaunchStep, ValidateCheckpoints
from supervisor.core.model import JobRecord, JobState
from supervisor.core.observations import (
    Observation,
    SpareCheckFailed,
    StepEnded,
    StepProgress,
    TimeLimitNear,
    TrainingAnomaly,
    from_event,
)
from supervisor.core.policy import Policy
from supervisor.core.stragglers import ComputeSample
from supervisor.core.verify import check_resume
from supervisor.errors import StoreError
from supervisor.jobs import JobSpec
from supervisor.store import Store
from supervisor.training_watch import JobWatch
from supervisor.views.timeline import CHECKPOINT_STATS_KIND, goodput_of

log = logging.getLogger("resurgo.supervisor")

# How long the driver is told to wait before asking again.
DRIVER_RETRY_S = 2.0
# While a recovery prepares the relaunch (evidence, checkpoint choice, backoff),
# the driver asks again this soon, or right after the backoff ends: the relaunch
# is planned within moments, and the driver is the one to start it.
DRIVER_RECOVERY_RETRY_S = 0.2
# Phases in which a rank may keep its peers waiting in a collective for long.
_BUSY_PHASES = frozenset({"checkpoint", "eval"})
# What the driver asks that observe-only mode answers as if no supervisor decided.
_OBSERVED_PHASES = frozenset({DriverPhase.START, DriverPhase.RUNNING, DriverPhase.ENDED})


@dataclass
class TrackedJob:
    """What the supervisor keeps in memory about one job (the store has the rest)."""

    record: JobRecord
    secret: bytes
    spec: JobSpec
    slurm_nodes: tuple[str, ...] = ()
    last_seen: tuple[str, tuple[str, ...], int, str] | None = None
    nodes_flagged: set[str] = field(default_factory=set)
    # NOT_RESPONDING nodes not taken as lost while their agent calls in (logged once).
    nodes_excused: set[str] = field(default_factory=set)
    # agent incarnation -> the attempt it was launched for (from agent_started)
    incarnations: dict[str, int] = field(default_factory=dict)
    stopped: set[str] = field(default_factory=set)
    progress_step: int | None = None
    # When a current agent last called in (a heartbeat or events; None: not
    # since this supervisor started), and (attempt, when first heard, exit
    # code) of the driver's "the step ended".
    last_report_s: float | None = None
    step_ended: tuple[int | None, float, int | None] | None = None
    # attempts whose resume verification has a result (checked once each)
    verified: set[int] = field(default_factory=set)
    # the most ranks one agent of the job listed in a heartbeat (bounds its ranks)
    local_ranks_seen: int = 0
    # (step, stall_s, write_s) of the newest checkpoint's save
    save_cost: tuple[int, float, float] | None = None
    interval_s: float | None = None  # the interval last pushed to the agents
    # global rank -> its newest compute median (this attempt's agents only)
    compute: dict[int, ComputeSample] = field(default_factory=dict)
    # node -> (attempt, when, global rank, phase) of a rank in a checkpoint or an
    # evaluation, from the node's newest heartbeat report; hang reports from other nodes
    # held meanwhile ((attempt, highest hung step, event)), and since when no
    # node has been busy while some are held.
    busy: dict[str, tuple[int, float, int, str]] = field(default_factory=dict)
    held_hangs: list[tuple[int, int, Event]] = field(default_factory=list)
    idle_since_s: float | None = None
    # node -> (attempt, when, gap since the one before) of its newest heartbeat
    # report; hang reports not held that wait for a heartbeat from each of ``nodes``
    # sent after them, until a deadline ((deadline, nodes, event)):
    # :meth:`Intake._await_heartbeats`.
    heard: dict[str, tuple[int, float, float | None]] = field(default_factory=dict)
    unconfirmed: list[tuple[float, set[str], Event]] = field(default_factory=list)
    # when the driver was last asked to health-check the idle spares (None: not yet)
    spares_checked_s: float | None = None
    # the training-health watch over the step reports (None: anomaly_action off)
    watch: JobWatch | None = None
    # checkpoint path -> (why the driver was last told to move it aside, whether it
    # is valid and only past a rollback's point)
    aside: dict[str, tuple[str, bool]] = field(default_factory=dict)
    # (record nodes, Slurm's nodes, their union) as of the last allocation() call
    _allocation: tuple[tuple[str, ...], tuple[str, ...], frozenset[str]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def allocation(self) -> frozenset[str]:
        """The record's nodes and Slurm's newest view (a relaunch moves both).

        Every request checks its node against it, so the set is built again only
        when either tuple is replaced.
        """
        nodes, seen = self.record.nodes, self.slurm_nodes
        cached = self._allocation
        if cached is None or cached[0] is not nodes or cached[1] is not seen:
            cached = (nodes, seen, frozenset(nodes) | frozenset(seen))
            self._allocation = cached
        return cached[2]


class Intake:
    """The API's :class:`~supervisor.api.JobDirectory` over the job table and the store."""

    jobs: dict[str, TrackedJob]
    store: Store
    executor: Executor
    config: SupervisorConfig
    policy: Policy
    clock: Callable[[], float]
    manifest_reader: manifests.ManifestReader

    def _enqueue(self, job_id: str, observation: Observation, ref: str | None = None) -> None:
        """Hand an observation to the decision task (the daemon provides it)."""
        raise NotImplementedError

    def secret(self, job_id: str) -> bytes | None:
        """The job's signing secret (None: not registered)."""
        job = self.jobs.get(job_id)
        return None if job is None else job.secret

    def allocation(self, job_id: str) -> frozenset[str] | None:
        """The job's nodes: the record's and Slurm's newest view (a relaunch moves both)."""
        job = self.jobs.get(job_id)
        return None if job is None else job.allocation()

    def ranks(self, job_id: str) -> tuple[int, int] | None:
        """(nodes x ranks per node, ranks per node) of the job; None when it is unknown.

        The nodes: the job's original size or its allocation, whichever is
        larger. Ranks per node: the spec's, or the most ranks one of the job's
        agents has listed in a heartbeat, whichever is larger (a wrapper script
        hides torchrun's ``--nproc-per-node`` from ``resurgo submit``).
        """
        job = self.jobs.get(job_id)
        if job is None:
            return None
        record = job.record
        per_node = max(record.procs_per_node, job.local_ranks_seen)
        return max(record.original_nodes, len(job.allocation())) * per_node, per_node

    def _current(self, job: TrackedJob, incarnation: str) -> bool:
        """Whether an agent incarnation belongs to the job's current attempt (or is unknown)."""
        return job.incarnations.get(incarnation, job.record.attempt) >= job.record.attempt

    def accept_events(self, job_id: str, events: Sequence[Event]) -> Sequence[str]:
        """Store the batch; decide on the events of current agents."""
        now = self.clock()
        accepted = self.store.record_events(job_id, events, now_s=now)
        self._keep_within_quota(job_id, len(events), now)
        job = self.jobs[job_id]
        for event in events:
            incarnation = event.incarnation
            if self._current(job, incarnation):
                job.last_report_s = now
            if event.kind is EventKind.AGENT_STARTED:
                attempt = event.payload.get("attempt")
                if isinstance(attempt, int):
                    job.incarnations[incarnation] = attempt
            if event.kind is EventKind.AGENT_STOPPED:
                # A clean exit is not a lost node: its lease must not expire into blame.
                job.stopped.add(incarnation)
                if any(lease.incarnation == incarnation for lease in self.store.leases_for(job_id)):
                    self.store.drop_leases(job_id, [event.node])
            if event.kind is EventKind.CHECKPOINT_COMMITTED:
                self._note_checkpoint(job_id, job, event, now)
            if event.kind is EventKind.STEP_LOSSES:
                attempt = job.incarnations.get(incarnation, job.record.attempt)
                self.store.record_steps(
                    job_id, attempt, event.payload["global_rank"], event.payload["steps"], now
                )
                if attempt == job.record.attempt:
                    self._verify_resume(job_id, job, now)
                    self._watch_steps(job_id, job, event, now)
            if not self._current(job, incarnation):
                log.info(
                    "job %s: %s from %s of attempt %d kept, not decided on (attempt %d now)",
                    job_id, event.kind.value, event.node, job.incarnations[incarnation],
                    job.record.attempt,
                )  # fmt: skip
                continue
            if event.kind is EventKind.HANG and (
                self._hold_hang(job_id, job, event) or self._await_heartbeats(job, event, now)
            ):
                continue
            if event.kind is EventKind.HANG:
                self._release_held(job_id, job)
            if event.kind is EventKind.RANK_EXITED and job.watch is not None:
                # A script that raises on a NaN: its anomaly is the cause, decided first.
                self._hand_anomaly(job_id, job.watch.due(now, force=True), now)
            if event.kind in _DECIDED_KINDS:
                self._enqueue(job_id, from_event(event), event.event_id)
        return accepted

    def _keep_within_quota(self, job_id: str, batch: int, now: float) -> None:
        """Delete the job's oldest reports once it has more stored than its quota: twice
        the batch at most, so a flood's excess goes within a few batches and no one
        batch waits long for its deletion."""
        config = self.config
        pruned, freed = self.store.prune_events(
            job_id, config.event_quota, config.event_quota_mib << 20, 2 * batch + 100
        )
        if not pruned:
            return
        kept, size = self.store.event_usage(job_id)
        log.warning(
            "job %s: over its store quota (event_quota %d, event_quota_mib %d): deleted its "
            "%d oldest reports (%.1f MiB); %d kept (%.1f MiB)",
            job_id, config.event_quota, config.event_quota_mib, pruned, freed / (1 << 20),
            kept, size / (1 << 20),
        )  # fmt: skip
        self.store.record_observation(
            job_id, "events_pruned", {"pruned": pruned, "bytes": freed, "kept": kept}, now
        )

    def _watch_steps(self, job_id: str, job: TrackedJob, event: Event, now: float) -> None:
        """Run the current attempt's step reports through the job's training-health watch."""
        if self.policy.anomaly_action is AnomalyAction.OFF:
            return
        if job.watch is None:
            job.watch = JobWatch(self.policy.watch_policy())
        payload = event.payload
        record = job.record
        found = job.watch.feed(
            record.attempt, event.node, payload["global_rank"], payload["steps"], now,
            world_ranks=len(record.nodes) * record.procs_per_node or None,
        )  # fmt: skip
        self._hand_anomaly(job_id, found, now)

    def settle_anomalies(self) -> None:
        """Hand on the anomalies whose wait for the other ranks' reports is over (a tick)."""
        now = self.clock()
        for job_id, job in self.jobs.items():
            if job.watch is not None:
                self._hand_anomaly(job_id, job.watch.due(now), now)

    def _hand_anomaly(self, job_id: str, found: TrainingAnomaly | None, now: float) -> None:
        """Record a settled anomaly as the job's observation and have it decided on."""
        if found is None:
            return
        log.warning("job %s: training anomaly: %s", job_id, found.detail)
        self.store.record_observation(job_id, "training_anomaly", asdict(found), now)
        self._enqueue(job_id, found)

    def _hold_hang(self, job_id: str, job: TrackedJob, event: Event) -> bool:
        """Hold a hang report while a rank on another node saves or evaluates.

        Ranks that wait in a collective for a rank-0-only ``torch.save`` or
        evaluation look hung to their agents; the busy rank's own agent knows
        better (phase grace) and reports it if it overruns. The held reports are
        dropped once training goes on, and decided on when the busy phase ended
        without progress (:meth:`_settle_held`).
        """
        others = self._busy_now(job, exclude=event.node)
        if not others:
            return False
        steps = [h.get("last_step") for h in event.payload.get("hung", ())]
        top = max((step for step in steps if isinstance(step, int)), default=-1)
        job.held_hangs.append((job.record.attempt, top, event))
        job.idle_since_s = None
        node, (_, _, rank, phase) = sorted(others.items())[0]
        log.info(
            "job %s: hang report from %s held: rank %d on %s is in %s, its peers may wait for it",
            job_id, event.node, rank, node, phase,
        )  # fmt: skip
        return True

    def _await_heartbeats(self, job: TrackedJob, event: Event, now: float) -> bool:
        """Wait with a hang report nobody is known busy for until each other node that
        calls in has sent a heartbeat after it.

        A rank-0-only save makes its peers' agents report a hang, and the saving
        rank's own heartbeat says why; on a loaded machine that heartbeat may come
        after the reports it explains. Deciding on the reports at once would start a
        recovery (and blame a waiting node) that the next heartbeat would have
        prevented. A node is waited for until twice its last gap between
        heartbeats after its newest one (a silent node is not waited for long: its
        silence may be the hang), a lease at most.
        """
        lease = self.config.lease_s
        nodes, deadline = set(), now
        for node, (attempt, when, gap) in job.heard.items():
            if (
                node != event.node
                and node in job.record.nodes
                and attempt == job.record.attempt
                and now - when <= lease
            ):
                nodes.add(node)
                deadline = max(deadline, when + (lease if gap is None else 2 * gap + 1.0))
        if not nodes or deadline <= now:
            return False
        job.unconfirmed.append((min(deadline, now + lease), nodes, event))
        return True

    def _confirm_hangs(self, job_id: str, job: TrackedJob, node: str | None, now: float) -> None:
        """Note ``node``'s heartbeat against the waiting hang reports; decide on those
        heard from every node (or past their deadline): held when a node is busy now."""
        waiting: list[tuple[float, set[str], Event]] = []
        for deadline, nodes, event in job.unconfirmed:
            nodes.discard(node or "")
            if nodes and now < deadline:
                waiting.append((deadline, nodes, event))
            elif not self._current(job, event.incarnation):
                continue  # a report of an attempt that has ended meanwhile
            elif not self._hold_hang(job_id, job, event):
                self._release_held(job_id, job)
                self._enqueue(job_id, from_event(event), event.event_id)
        job.unconfirmed = waiting

    def settle_hangs(self) -> None:
        """Decide on the hang reports that waited a lease for heartbeats (a tick)."""
        now = self.clock()
        for job_id, job in self.jobs.items():
            if job.unconfirmed:
                self._confirm_hangs(job_id, job, None, now)

    def _busy_now(
        self, job: TrackedJob, exclude: str | None = None
    ) -> dict[str, tuple[int, float, int, str]]:
        """Busy nodes of the current attempt still in the job, heard from within a lease."""
        now = self.clock()
        return {
            node: busy
            for node, busy in job.busy.items()
            if node != exclude
            and node in job.record.nodes
            and busy[0] == job.record.attempt
            and now - busy[1] <= self.config.lease_s
        }

    def _release_held(self, job_id: str, job: TrackedJob) -> None:
        """Decide on the held hang reports of the current attempt now."""
        held, job.held_hangs, job.idle_since_s = job.held_hangs, [], None
        for attempt, _, event in held:
            if attempt == job.record.attempt:
                self._enqueue(job_id, from_event(event), event.event_id)

    def _settle_held(self, job_id: str, job: TrackedJob, now: float, step: int) -> None:
        """After a heartbeat report: drop held hang reports once a rank stepped past them;
        decide on them once no node has been busy for a lease without progress."""
        if not job.held_hangs:
            return
        if step > max(top for _, top, _ in job.held_hangs):
            nodes = ", ".join(sorted({event.node for _, _, event in job.held_hangs}))
            why = f"hang reports from {nodes} were waits: training went on at step {step}"
            log.info("job %s: %s", job_id, why)
            # Named in a decision, they are not decided on again after a restart.
            state = job.record.state.value
            self.store.record_decision(
                job_id, job.held_hangs[-1][2].event_id, state, state, "none",
                {"explanation": why, "attempt": job.record.attempt, "actions": []}, now,
            )  # fmt: skip
            job.held_hangs, job.idle_since_s = [], None
            return
        if self._busy_now(job):
            job.idle_since_s = None
            return
        if job.idle_since_s is None:
            job.idle_since_s = now
        elif now - job.idle_since_s >= self._held_patience_s(job):
            self._release_held(job_id, job)

    def _held_patience_s(self, job: TrackedJob) -> float:
        """How long held hang reports wait for progress once nobody is busy any more.

        As long as the agents' own hang timeout that made them report (the
        ``timeout_s`` of each hung rank), and at least a lease: the ranks that
        waited for the busy one must get as long to show progress as they got to
        show it before, or a loaded machine's slow first step after a 60 s
        evaluation turns into a restart.
        """
        timeouts = [
            float(hung["timeout_s"])
            for _, _, event in job.held_hangs
            for hung in event.payload.get("hung", ())
            if isinstance(hung.get("timeout_s"), int | float)
        ]
        return max([self.config.lease_s, *timeouts])

    async def refuse_events(self, job_id: str, events: Sequence[Event]) -> str | None:
        """Why the batch cannot be taken: a committed checkpoint outside the job's root.

        Checked in a worker thread (it opens directories below the root, on
        what may be a network filesystem), before anything is stored: the
        supervisor would otherwise read, validate and resume from another
        user's checkpoint with its own privileges.
        """
        job = self.jobs.get(job_id)
        if job is None:
            return None
        for event in events:
            if event.kind is EventKind.CHECKPOINT_COMMITTED:
                why = await asyncio.to_thread(
                    manifests.refusal, job.spec.ckpt_root, str(event.payload["path"])
                )
                if why is not None:
                    return why
        return None

    def _note_checkpoint(self, job_id: str, job: TrackedJob, event: Event, now: float) -> None:
        """Record the commit, and have its save cost read from the manifest (off the loop)."""
        step, path = int(event.payload["step"]), str(event.payload["path"])
        self.store.record_checkpoint(job_id, step, path, now)
        if job.save_cost is not None and job.save_cost[0] >= step:
            return
        self.manifest_reader.request(job_id, job.spec.ckpt_root, step, path)

    def _take_save_stats(self, job_id: str, step: int, stats: SaveStats) -> None:
        """A manifest's save statistics, read by :attr:`manifest_reader`: the job's save cost."""
        job = self.jobs.get(job_id)
        if job is None or (job.save_cost is not None and job.save_cost[0] >= step):
            return
        job.save_cost = (step, stats.stall_s, stats.write_s)
        self.store.record_observation(
            job_id,
            CHECKPOINT_STATS_KIND,
            {
                "step": step,
                "stall_s": stats.stall_s,
                "write_s": stats.write_s,
                "bytes": stats.total_bytes,
                "mode": stats.mode,
            },
            self.clock(),
            observation_id=f"{job_id}/checkpoint_stats/{step}",
        )

    def _verify_resume(self, job_id: str, job: TrackedJob, now: float) -> None:
        """Compare the current attempt's replayed steps with the reports before the fault."""
        attempt = job.record.attempt
        if attempt in job.verified:
            return
        attempts = {row.attempt: row for row in self.store.attempts_for(job_id)}
        current = attempts.get(attempt)
        if current is None or current.resumed_from is None:
            return
        resume_step = step_in_path(current.resumed_from)
        earlier = [row for number, row in attempts.items() if number < attempt]
        if resume_step is None or not earlier:
            return
        same_size = len(earlier[-1].nodes) == len(current.nodes)
        # A rollback's launch is meant to differ from its onset on (the data is skipped).
        onsets = [a.onset_step for a in job.record.anomalies if a.attempt + 1 == attempt]
        result = check_resume(
            self.store, job_id, attempt, resume_step, same_size,
            self.policy.resume_loss_tolerance, until_step=min(onsets, default=None),
        )  # fmt: skip
        if result is None:
            return
        job.verified.add(attempt)
        payload = {
            "attempt": attempt,
            "resume_step": resume_step,
            "same_size": same_size,
            "verified": result.verified,
            "first_diverging_step": result.first_diverging_step,
            "compared": result.compared,
            "reason": result.reason,
        }
        if result.verified or result.first_diverging_step is None:
            self.store.record_observation(job_id, "resume_verification", payload, now)
            log.info("job %s: resume of attempt %d: %s", job_id, attempt, result.reason)
            return
        self.store.record_observation(job_id, "nondeterministic_resume", payload, now)
        message = (
            f"job {job_id}: nondeterministic resume in attempt {attempt} from step "
            f"{resume_step}, first diverging step {result.first_diverging_step}: {result.reason}"
        )
        self.store.record_observation(
            job_id, ALERT_KIND, {"severity": "critical", "message": message}, now
        )
        log.error("ALERT %s", message, extra={"job_id": job_id, "alert": "nondeterministic_resume"})

    def accept_heartbeat(self, job_id: str, report: HeartbeatReport) -> None:
        """Renew the agent's lease; note the job's progress (its slowest rank's step)."""
        job = self.jobs[job_id]
        incarnation = report.agent_incarnation
        if report.attempt is not None:
            job.incarnations.setdefault(incarnation, report.attempt)
        if incarnation in job.stopped or not self._current(job, incarnation):
            return
        now = self.clock()
        job.last_report_s = now
        self.store.touch_lease(job_id, report.node, incarnation, now)
        local = max((len(report.ranks), *(rank.local_rank + 1 for rank in report.ranks)))
        job.local_ranks_seen = max(job.local_ranks_seen, local)
        for rank in report.ranks:
            if rank.compute_p50_s is None or rank.compute_observed <= 0:
                continue
            known = job.compute.get(rank.global_rank)
            if (
                known is None
                or known.p50_s != rank.compute_p50_s
                or known.observed != rank.compute_observed
                or known.node != report.node
            ):
                job.compute[rank.global_rank] = ComputeSample(
                    report.node, rank.global_rank, rank.compute_p50_s, rank.compute_observed
                )
        attempt = job.incarnations.get(incarnation, job.record.attempt)
        busy = [(r.global_rank, r.phase) for r in report.ranks if r.phase in _BUSY_PHASES]
        if busy:
            busy_rank, phase = min(busy)
            job.busy[report.node] = (attempt, now, busy_rank, str(phase))
        else:
            job.busy.pop(report.node, None)
        before = job.heard.get(report.node)
        gap = now - before[1] if before is not None and before[0] == attempt else None
        job.heard[report.node] = (attempt, now, gap)
        if job.unconfirmed:
            self._confirm_hangs(job_id, job, report.node, now)
        # A rank still loading (phase init) reports step 0: not the job's progress.
        steps = [r.step for r in report.ranks if r.step is not None and r.phase != "init"]
        if not steps:
            return
        step = min(steps)
        self._settle_held(job_id, job, now, step)
        self.store.record_progress(job_id, step, now)
        waiting = job.record.state in (JobState.STARTING, JobState.RELAUNCHING)
        if waiting and step != job.progress_step:
            self._enqueue(job_id, StepProgress(step))
        job.progress_step = step

    def commands_for(self, job_id: str, node: str, incarnation: str) -> Sequence[Command]:
        """Pending commands for this agent, marked delivered as they go out.

        A stop is for the launch it ends: a StopRanks of attempt N (planned as
        the job moved to attempt N) stops agents of earlier attempts only, so
        the relaunched agents never receive the stop meant for their
        predecessors (it stays pending for a predecessor still calling in).
        """
        now = self.clock()
        job = self.jobs[job_id]
        # Every agent names its attempt (agent_started, heartbeats); one that never
        # did was started without the driver, and gets every command.
        launched = job.incarnations.get(incarnation)
        delivered = []
        for command in self.store.pending_commands(job_id, node):
            attempt = command_attempt(command.command_id)
            stale = (
                command.kind is CommandKind.STOP_RANKS
                and attempt is not None
                and launched is not None
                and launched >= attempt
            )
            if stale:
                continue  # left pending for the old launch's agent, if it still calls in
            self.store.ack_command(command.command_id, node, now)
            delivered.append(command)
            if len(delivered) == protocol.MAX_COMMANDS:
                break
        return delivered

    def status(self, job_id: str) -> dict[str, Any] | None:
        """A small summary for the CLI."""
        job = self.jobs.get(job_id)
        if job is None:
            return None
        record = job.record
        return {
            "name": job.spec.name,
            "state": record.state.value,
            "attempt": record.attempt,
            "nodes": list(record.nodes),
            "original_nodes": record.original_nodes,
            "spare_nodes": list(record.spare_nodes),
            "spares_wanted": record.spares_wanted,
            "swaps": {cause.value: count for cause, count in record.swaps},
            "last_checkpoint_step": record.last_step,
            "restarts": {cause.value: count for cause, count in record.restarts},
            "final_reason": record.final_reason,
            "goodput": _goodput_doc(goodput_of(self.store, job_id, self.clock())),
            "checkpoint_interval_s": job.interval_s,
        }

    async def driver(self, job_id: str, request: DriverRequest) -> DriverAnswer:
        """Tell the in-job driver what to do (see :class:`agent.wire.protocol.DriverPhase`)."""
        job = self.jobs[job_id]
        if request.quarantined:
            self._note_quarantined(job_id, job, request)
        if request.phase is DriverPhase.RELAUNCHED:
            assert request.action_id is not None and request.ok is not None
            now = self.clock()
            try:
                seen = self.executor.confirm_relaunch(
                    job_id, request.action_id, request.ok, request.reason, now
                )
            except StoreError as error:
                return DriverAnswer(DriverAction.WAIT, job.record.attempt, reason=str(error))
            self._enqueue(job_id, seen)
            return DriverAnswer(DriverAction.WAIT, job.record.attempt, reason="confirmed",
                                retry_after_s=0.0)  # fmt: skip
        record = job.record
        if self.config.observe_only and request.phase in _OBSERVED_PHASES:
            return self._observing(job_id, job, request)
        if record.state.terminal:
            action = DriverAction.DONE if record.state is JobState.COMPLETED else DriverAction.STOP
            return DriverAnswer(
                action, record.attempt, reason=record.final_reason or record.state.value
            )
        if request.phase is DriverPhase.TIME_LIMIT:
            stopped = request.exit_code is not None
            self._enqueue(job_id, TimeLimitNear(request.time_left_s, stopped, request.attempt))
            return DriverAnswer(
                DriverAction.WAIT,
                record.attempt,
                reason="requeueing for the time limit" if stopped else "planned stop noted",
                retry_after_s=DRIVER_RETRY_S,
            )
        if request.phase is DriverPhase.SPARE_CHECK:
            return self._spares_checked(job_id, request)
        if request.phase is DriverPhase.RUNNING:
            pending = self.executor.pending_relaunch(job_id)
            if pending is not None and pending.attempt > (request.attempt or 0):
                return self._steered(job, record, _relaunch_answer(pending, record))
            return DriverAnswer(
                DriverAction.WAIT, record.attempt, reason="carry on",
                check_spares=self._spares_due(job, request.attempt),
            )  # fmt: skip
        if request.phase is DriverPhase.ENDED:
            self._note_step_ended(job_id, job, request)
        pending = self.executor.pending_relaunch(job_id)
        if pending is not None:
            return self._steered(job, record, _relaunch_answer(pending, record))
        if request.phase is DriverPhase.START:
            recovery = record.recovery
            if recovery is not None and not recovery.validated:
                return DriverAnswer(
                    DriverAction.WAIT, record.attempt, reason="choosing a checkpoint",
                    retry_after_s=self._retry_s(record),
                )  # fmt: skip
            if record.spares_wanted and not record.nodes:
                # Which nodes are the world and which the spares is decided on
                # Slurm's view of the allocation: the next poll brings it.
                return DriverAnswer(
                    DriverAction.WAIT, record.attempt, reason="waiting for Slurm's allocation",
                    retry_after_s=DRIVER_RETRY_S,
                )  # fmt: skip
            spare = record.spare_nodes
            spares = f", {len(spare)} spare(s) kept ready" if spare else ""
            launch = DriverAnswer(
                DriverAction.LAUNCH,
                record.attempt,
                nodes=record.nodes if record.spare_nodes else None,
                resume_from=recovery.resume_from if recovery is not None else None,
                skip_samples=record.skipped_samples,
                reason=f"launch on the current allocation{spares}",
            )
            return self._steered(job, record, launch)
        return DriverAnswer(
            DriverAction.WAIT,
            record.attempt,
            reason=f"job is {record.state.value}",
            retry_after_s=self._retry_s(record),
        )

    def _retry_s(self, record: JobRecord) -> float:
        """When the driver should ask again: soon while a recovery prepares the relaunch
        (right after its backoff, when one runs), else :data:`DRIVER_RETRY_S`."""
        if record.state is not JobState.RECOVERING:
            return DRIVER_RETRY_S
        wait_s = DRIVER_RECOVERY_RETRY_S
        if record.not_before_s is not None:
            wait_s = max(wait_s, record.not_before_s - self.clock() + DRIVER_RECOVERY_RETRY_S / 4)
        return min(wait_s, DRIVER_RETRY_S)

    def _spares_due(self, job: TrackedJob, attempt: int | None) -> tuple[str, ...]:
        """The idle spares the driver should health-check now: all of them, once the
        policy's interval passed since the last check (at once, the first time), while
        the current attempt runs."""
        record, interval_s = job.record, self.policy.spare_check_interval_s
        if not record.spare_nodes or not interval_s or attempt != record.attempt:
            return ()
        if record.state is not JobState.RUNNING:
            return ()
        now = self.clock()
        if job.spares_checked_s is not None and now - job.spares_checked_s < interval_s:
            return ()
        job.spares_checked_s = now
        return record.spare_nodes

    def _steered(self, job: TrackedJob, record: JobRecord, launch: DriverAnswer) -> DriverAnswer:
        """``launch`` with what the driver moves aside first (see :meth:`_to_quarantine`);
        after a rollback, also every checkpoint newer than the one it resumes from that the
        driver finds then (a save the stopped run made after the validation)."""
        recovery = record.recovery
        after = None
        if recovery is not None and recovery.validated and recovery.resume_before is not None:
            after = recovery.resume_step
        return replace(launch, quarantine=self._to_quarantine(job, record), aside_after_step=after)

    def _to_quarantine(self, job: TrackedJob, record: JobRecord) -> tuple[tuple[str, str], ...]:
        """The checkpoints newer than the one this recovery resumes from, and why: those it
        rejected, and, for a rollback past a training anomaly, those past its point.

        The driver moves them aside (:mod:`agent.checkpoint.quarantine`), so a
        script that resumes by its framework's own "latest" finds the chosen one.
        """
        recovery = record.recovery
        if recovery is None or not recovery.validated:
            return ()
        rollback = recovery.resume_before is not None
        if not recovery.rejected and not rollback:
            return ()
        reasons: dict[str, str] = {}
        for row in self.store.list_actions(record.job_id):
            if (
                row.kind != KIND_OF[ValidateCheckpoints]
                or row.args.get("attempt") != record.attempt
            ):
                continue
            for checked in (row.result or {}).get("checked", []):
                if checked.get("path") and not checked.get("valid"):
                    reasons[checked["path"]] = checked.get("reason") or "failed validation"
            for past in (row.result or {}).get("past_rollback", []) if rollback else ():
                reasons[past["path"]] = _past_the_rollback(past["step"], record)
        moved = dict.fromkeys(recovery.rejected)
        moved.update(dict.fromkeys(path for path in reasons if path not in recovery.rejected))
        aside = tuple((path, reasons.get(path, "failed validation")) for path in moved)
        job.aside = {path: (why, path not in recovery.rejected) for path, why in aside}
        return aside

    def _note_quarantined(self, job_id: str, job: TrackedJob, request: DriverRequest) -> None:
        """Record each checkpoint the driver moved into quarantine as an event of the job."""
        now = self.clock()
        root = job.spec.ckpt_root
        for source, target in request.quarantined:
            why, past = job.aside.get(os.path.join(root, source), ("failed validation", False))
            payload = {"checkpoint": source, "moved_to": target, "attempt": request.attempt,
                       "reason": why, "past_rollback": past}  # fmt: skip
            self.store.record_observation(
                job_id, "checkpoint_quarantined", payload,
                now, observation_id=f"{job_id}/quarantine/{target}",
            )  # fmt: skip
            log.warning(
                "job %s: checkpoint %s was moved to %s under %s (%s; `resurgo ckpt release "
                "%s %s` moves it back)",
                job_id, source, target, root, why, root, source,
            )  # fmt: skip

    def _observing(self, job_id: str, job: TrackedJob, request: DriverRequest) -> DriverAnswer:
        """Observe-only: the driver runs the job as it would run without Resurgo. It
        launches at once, as the job was submitted (no checkpoint chosen for it, none
        moved aside), its step runs on whatever was decided (no stop, no relaunch, no
        spare check), and the step's end is the job's."""
        record = job.record
        if request.phase is DriverPhase.START and record.spares_wanted and not record.nodes:
            return DriverAnswer(
                DriverAction.WAIT, record.attempt, reason="waiting for Slurm's allocation",
                retry_after_s=DRIVER_RETRY_S,
            )  # fmt: skip
        if request.phase is DriverPhase.START:
            return DriverAnswer(
                DriverAction.LAUNCH, record.attempt,
                nodes=record.nodes if record.spare_nodes else None,
                reason="launch on the current allocation (observe-only)",
            )  # fmt: skip
        if request.phase is DriverPhase.RUNNING:
            return DriverAnswer(DriverAction.WAIT, record.attempt, reason="carry on (observe-only)")
        self._note_step_ended(job_id, job, request)
        if request.exit_code == 0:
            return DriverAnswer(DriverAction.DONE, record.attempt, reason="the step completed")
        why = (
            f"observe-only: the step ended with exit code {request.exit_code}, and the job "
            f"ends as it would without Resurgo (`resurgo events {job_id}` shows what it "
            "would have done)"
        )
        return DriverAnswer(DriverAction.STOP, record.attempt, reason=why)

    def _spares_checked(self, job_id: str, request: DriverRequest) -> DriverAnswer:
        """The driver's spare check: a spare that failed is decided on (released)."""
        record = self.jobs[job_id].record
        failed = dict(request.unhealthy)
        healthy = [node for node in request.checked if node not in failed]
        log.info(
            "job %s: idle spares checked: %s healthy%s", job_id, ",".join(healthy) or "none",
            "".join(f"; {node} failed: {detail}" for node, detail in failed.items()),
        )  # fmt: skip
        for node, detail in failed.items():
            self._enqueue(job_id, SpareCheckFailed(node, detail))
        return DriverAnswer(DriverAction.WAIT, record.attempt, reason="spare check noted")

    def _note_step_ended(self, job_id: str, job: TrackedJob, request: DriverRequest) -> None:
        """The driver's "the attempt's step ended": decided on when its agents say nothing.

        The agents' reports name the culprit and come first when they can. The
        driver outlives them: when a step failed and, a lease after the driver
        first said so, no agent of the attempt has called in (their reports
        were lost with them), its word opens the recovery (:class:`StepEnded`).
        Not for a clean end, an earlier attempt, a stop the supervisor ordered
        (the job is recovering then, or stopping for its time limit), or an
        attempt whose agents stopped cleanly: they reported the end themselves.
        """
        record, now = job.record, self.clock()
        attempt = request.attempt
        if job.step_ended is None or job.step_ended[0] != attempt:
            job.step_ended = (attempt, now, request.exit_code)
            self.store.record_observation(
                job_id,
                "driver_step_ended",
                {"exit_code": request.exit_code, "attempt": attempt},
                now,
            )
        elif job.step_ended[2] is None and request.exit_code is not None:
            job.step_ended = (*job.step_ended[:2], request.exit_code)
        first_s, code = job.step_ended[1], job.step_ended[2]
        if (
            code in (None, 0)
            or attempt != record.attempt
            or record.state not in (JobState.RUNNING, JobState.STARTING)
            or record.time_limit_end_s is not None
            or any(job.incarnations.get(agent) == attempt for agent in job.stopped)
        ):
            return
        if now - first_s < self.config.lease_s:
            return
        if job.last_report_s is not None and job.last_report_s >= first_s:
            return  # its agents still talk: theirs is the word
        log.warning(
            "job %s: the driver saw attempt %s's step end (exit %s) %.0f s ago and no agent "
            "has reported since: recovering on the driver's word",
            job_id, attempt, code, now - first_s,
        )  # fmt: skip
        self._enqueue(job_id, StepEnded(attempt, code))


def _past_the_rollback(step: int, record: JobRecord) -> str:
    """Why a checkpoint of ``step`` is moved aside by a rollback."""
    acted = [a for a in record.anomalies if a.action in ("rollback", "drain")]
    anomaly = acted[-1] if acted else None
    onset = "" if anomaly is None else f" at step {anomaly.onset_step} ({anomaly.kind})"
    resumed = record.recovery.resume_step if record.recovery is not None else None
    return (
        f"step {step} lies past the rollback to step {resumed} after the training "
        f"anomaly{onset}: the run resumes before it"
    )


def _relaunch_answer(pending: RelaunchStep, record: JobRecord) -> DriverAnswer:
    return DriverAnswer(
        DriverAction.RELAUNCH,
        pending.attempt,
        nodes=pending.nodes,
        resume_from=pending.resume_from,
        # Every range skipped so far: a resume from before one skips it again.
        skip_samples=record.skipped_samples,
        action_id=pending.action_id,
        reason=f"relaunch on {len(pending.nodes)} node(s)",
    )


_DECIDED_KINDS = frozenset(
    {
        EventKind.RANK_EXITED,
        EventKind.HANG,
        EventKind.HEALTH_CHECK_FAILED,
        EventKind.STRAGGLER,
        EventKind.CHECKPOINT_COMMITTED,
        EventKind.LAUNCHER_EXITED,  # closes an exit window early
        EventKind.AGENT_STOPPED,
        EventKind.TIME_LIMIT_NEAR,  # the ranks stop for the time limit: no fault
        EventKind.WORLD_MISMATCH,  # the ranks train a world that is not the job's
    }
)


def _goodput_doc(goodput: Goodput) -> dict[str, Any]:
    return {
        "ratio": round(goodput.ratio, 4),
        "wall_s": round(goodput.wall_s, 3),
        "productive_s": round(goodput.productive_s, 3),
        "badput_s": {kind.value: round(value, 3) for kind, value in goodput.badput_s.items()},
    }
