"""What the supervisor hears from a job's agents and driver: the API's :class:`JobDirectory`.

:class:`Intake` is the daemon component the HTTP API calls (synchronously, on
the event loop, so each answer is a few indexed store operations): it stores
agents' events and heartbeats, turns the current attempt's events into
observations for the decision task (its :class:`~supervisor.jobtable.Inbox`),
records checkpoints and their save cost, checks resumes against the losses
reported before the fault, hands commands to the right agents, and answers
the in-job driver. What to hold, when to fall back on the driver's word and
what to tell the driver are the core's (:mod:`supervisor.core.hang_hold`,
:mod:`supervisor.core.steps`, :mod:`supervisor.core.driver_answer`); the
intake observes, asks, and acts on the answer. It shares the
:class:`~supervisor.jobtable.JobTable` with the other components
(:mod:`supervisor.daemon` wires them).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any

from agent.checkpoint.format import SaveStats
from agent.checkpoint.layouts import step_in_path
from agent.wire import protocol
from agent.wire.datagram import Phase
from agent.wire.protocol import (
    AgentCommands,
    Command,
    CommandKind,
    DriverAction,
    DriverAnswer,
    DriverPhase,
    DriverRequest,
    Event,
    EventKind,
    HeartbeatReport,
    JobHeartbeats,
    NodeBeat,
    RankStatus,
)
from supervisor import manifests
from supervisor.act.executor import ALERT_KIND, Executor
from supervisor.act.reconcile import KIND_OF, command_attempt
from supervisor.config import SupervisorConfig
from supervisor.core import driver_answer, faults, hang_hold
from supervisor.core.anomaly import AnomalyAction
from supervisor.core.decision import Policy
from supervisor.core.driver_answer import (
    Aside,
    Checked,
    DriverFacts,
    PastRollback,
    quarantine_wanted,
)
from supervisor.core.faults import DECIDED_KINDS
from supervisor.core.goodput import Goodput
from supervisor.core.hang_hold import BusyRank, Heard
from supervisor.core.intents import ValidateCheckpoints
from supervisor.core.model import JobRecord
from supervisor.core.observations import TrainingAnomaly
from supervisor.core.steps import note_step_end, progress_news, step_end_fallback
from supervisor.core.stragglers import ComputeSample
from supervisor.core.verify import check_resume
from supervisor.errors import StoreError
from supervisor.jobtable import Inbox, JobTable, SaveCost, TrackedJob
from supervisor.store import Store
from supervisor.training_watch import JobWatch
from supervisor.views.timeline import CHECKPOINT_STATS_KIND, goodput_of

log = logging.getLogger("resurgo.supervisor")

# What a rank in these phases reports (heartbeat phase names, :class:`Phase`).
# Reports that name a checkpoint the supervisor will count as progress and read.
_CHECKPOINT_KINDS = frozenset({EventKind.CHECKPOINT_COMMITTED, EventKind.CHECKPOINT_WRITTEN})
_BUSY_PHASE_NAMES = frozenset(phase.value for phase in hang_hold.BUSY_PHASES)


class Intake:
    """The API's :class:`~supervisor.api.JobDirectory` over the job table and the store."""

    def __init__(
        self,
        jobs: JobTable,
        store: Store,
        executor: Executor,
        decisions: Inbox,
        config: SupervisorConfig,
        policy: Policy,
        clock: Callable[[], float],
    ) -> None:
        self.jobs = jobs
        self.store = store
        self.executor = executor
        self.decisions = decisions
        self.config = config
        self.policy = policy
        self.clock = clock
        self.manifest_reader = manifests.ManifestReader(self._take_save_stats)

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

    def accept_events(self, job_id: str, events: Sequence[Event]) -> Sequence[str]:
        """Store the batch; decide on the events of current agents."""
        now = self.clock()
        accepted = self.store.record_events(job_id, events, now_s=now)
        self._keep_within_quota(job_id, len(events), now)
        job = self.jobs[job_id]
        for event in events:
            incarnation = event.incarnation
            if job.current(incarnation):
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
                attempt = job.attempt_of(incarnation)
                self.store.record_steps(
                    job_id, attempt, event.payload["global_rank"], event.payload["steps"], now
                )
                if attempt == job.record.attempt:
                    self._verify_resume(job_id, job, now)
                    self._watch_steps(job_id, job, event, now)
            if not job.current(incarnation):
                log.info(
                    "job %s: %s from %s of attempt %d kept, not decided on (attempt %d now)",
                    job_id, event.kind.value, event.node, job.incarnations[incarnation],
                    job.record.attempt,
                )  # fmt: skip
                continue
            # A stall report is evidence only: decided on at once, it starts nothing.
            hang = event.kind is EventKind.HANG and event.payload.get("stalled") is not True
            if hang and (
                self._hold_hang(job_id, job, event, now) or self._await_heartbeats(job, event, now)
            ):
                continue
            if hang:
                self._release_held(job_id, job)
            if event.kind is EventKind.RANK_EXITED and job.watch is not None:
                # A script that raises on a NaN: its anomaly is the cause, decided first.
                self._hand_anomaly(job_id, job.watch.due(now, force=True), now)
            if event.kind in DECIDED_KINDS:
                self.decisions.enqueue(job_id, faults.read(event), event.event_id)
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
        self.decisions.enqueue(job_id, found)

    def settle_waits(self) -> None:
        """Hand on what waited long enough: anomalies and hang reports (a tick)."""
        self.settle_anomalies()
        self.settle_hangs()

    def _hold_hang(self, job_id: str, job: TrackedJob, event: Event, now: float) -> bool:
        """Hold a hang report while a rank on another node saves, evaluates or waits for data
        (:func:`supervisor.core.hang_hold.hold`)."""
        hold = hang_hold.hold(event, job.busy, job.record, now, self.config.lease_s)
        if hold is None:
            return False
        job.held_hangs.append(hold.held)
        job.idle_since_s = None
        log.info(
            "job %s: hang report from %s held: rank %d on %s is in %s, its peers may wait for it",
            job_id, event.node, hold.busy.global_rank, hold.busy_node, hold.busy.phase.value,
        )  # fmt: skip
        return True

    def _await_heartbeats(self, job: TrackedJob, event: Event, now: float) -> bool:
        """Wait with a hang report until the other nodes' next heartbeats
        (:func:`supervisor.core.hang_hold.await_heartbeats`)."""
        awaited = hang_hold.await_heartbeats(event, job.heard, job.record, now, self.config.lease_s)
        if awaited is None:
            return False
        job.unconfirmed.append(awaited)
        return True

    def _confirm_hangs(self, job_id: str, job: TrackedJob, node: str | None, now: float) -> None:
        """Note ``node``'s heartbeat against the waiting hang reports; decide on those
        heard from every node (or past their deadline): held when a node is busy now."""
        job.unconfirmed, due = hang_hold.confirm(job.unconfirmed, node, now)
        for event in due:
            if not job.current(event.incarnation):
                continue  # a report of an attempt that has ended meanwhile
            if not self._hold_hang(job_id, job, event, now):
                self._release_held(job_id, job)
                self.decisions.enqueue(job_id, faults.read(event), event.event_id)

    def settle_hangs(self) -> None:
        """Decide on the hang reports that waited a lease for heartbeats (a tick)."""
        now = self.clock()
        for job_id, job in self.jobs.items():
            if job.unconfirmed:
                self._confirm_hangs(job_id, job, None, now)

    def _release_held(self, job_id: str, job: TrackedJob) -> None:
        """Decide on the held hang reports of the current attempt now."""
        held, job.held_hangs, job.idle_since_s = job.held_hangs, [], None
        for event in hang_hold.released(held, job.record):
            self.decisions.enqueue(job_id, faults.read(event), event.event_id)

    def _settle_held(self, job_id: str, job: TrackedJob, now: float, step: int) -> None:
        """After a heartbeat report: drop held hang reports once a rank stepped past them;
        decide on them once no node has been busy for a while without progress."""
        settled = hang_hold.settle(
            job.held_hangs, step, job.busy, job.record, job.idle_since_s, now,
            self.config.lease_s,
        )  # fmt: skip
        if settled.verdict is hang_hold.Settle.RELEASE:
            self._release_held(job_id, job)
            return
        if settled.verdict is hang_hold.Settle.DROP:
            log.info("job %s: %s", job_id, settled.why)
            # Named in a decision, they are not decided on again after a restart.
            state = job.record.state.value
            self.store.record_decision(
                job_id, job.held_hangs[-1].event.event_id, state, state, "none",
                {"explanation": settled.why, "attempt": job.record.attempt, "actions": []}, now,
            )  # fmt: skip
            job.held_hangs = []
        job.idle_since_s = settled.idle_since_s

    async def refuse_events(self, job_id: str, events: Sequence[Event]) -> str | None:
        """Why the batch cannot be taken: a committed or written checkpoint outside the job's root.

        Checked in a worker thread (it opens directories below the root, on
        what may be a network filesystem), before anything is stored: the
        supervisor would otherwise read, validate and resume from another
        user's checkpoint with its own privileges.
        """
        job = self.jobs.get(job_id)
        if job is None:
            return None
        for event in events:
            if event.kind in _CHECKPOINT_KINDS:
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
        if job.save_cost is not None and job.save_cost.step >= step:
            return
        self.manifest_reader.request(job_id, job.spec.ckpt_root, step, path)

    def _take_save_stats(self, job_id: str, step: int, stats: SaveStats) -> None:
        """A manifest's save statistics, read by :attr:`manifest_reader`: the job's save cost."""
        job = self.jobs.get(job_id)
        if job is None or (job.save_cost is not None and job.save_cost.step >= step):
            return
        job.save_cost = SaveCost(step, stats.stall_s, stats.write_s)
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
        if current is None:
            return  # its row comes with the launch's decision
        resume_step = step_in_path(current.resumed_from or "")
        earlier = [row for number, row in attempts.items() if number < attempt]
        if resume_step is None or not earlier:
            # A launch that resumed from nothing (or from no step) has nothing to compare,
            # and never will: its step reports need not read the attempts again.
            job.verified.add(attempt)
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

    def durably(self) -> AbstractContextManager[Any]:
        """One durable store transaction around several event batches (the API's group
        commit, :mod:`supervisor.api.groupcommit`)."""
        return self.store.transaction(durable=True)

    def accept_heartbeat(self, job_id: str, report: HeartbeatReport) -> None:
        """Renew the agent's lease; note the job's progress (its slowest rank's step)."""
        job = self.jobs[job_id]
        now = self.clock()
        incarnation = report.agent_incarnation
        if not self._is_current(job, incarnation, report.attempt):
            return
        if job.aggregated and report.node not in job.heard_directly:
            job.heard_directly.add(report.node)
            log.warning(
                "job %s: node %s's agent reports straight to the supervisor: the job's "
                "aggregator did not take its heartbeats",
                job_id,
                report.node,
                extra={"job_id": job_id},
            )
        self._note_ranks(job, report.node, report.ranks, job.attempt_of(incarnation), now)
        self._renew(job_id, job, [protocol.beat_of(report)], now)
        step = protocol.slowest_loaded_step(report.ranks)
        if step is not None:
            self._progress(job_id, job, step, now)

    def accept_job_heartbeats(self, job_id: str, batch: JobHeartbeats) -> None:
        """A job's heartbeats from its aggregator: each whole report's ranks, then
        every beat's lease, then the job's progress (its slowest node's step)."""
        job = self.jobs[job_id]
        now = self.clock()
        if not job.aggregated:
            job.aggregated = True
            log.info(
                "job %s: heartbeats arrive through the job's aggregator (%d node(s))",
                job_id,
                len(batch.beats),
                extra={"job_id": job_id},
            )
        if job.heard_directly:
            job.heard_directly.difference_update(beat.node for beat in batch.beats)
        for report in batch.reports:
            incarnation = report.agent_incarnation
            if self._is_current(job, incarnation, report.attempt):
                self._note_ranks(job, report.node, report.ranks, job.attempt_of(incarnation), now)
        current = self._renew(job_id, job, batch.beats, now)
        steps = [beat.step for beat in current if beat.step is not None]
        if steps:
            self._progress(job_id, job, min(steps), now)

    def commands_for_agents(
        self, job_id: str, agents: Sequence[tuple[str, str]]
    ) -> list[AgentCommands]:
        """:meth:`commands_for` each ``(node, incarnation)`` that may have some; those that have."""
        incarnations = dict(agents)
        found = []
        for node in self.store.maybe_pending(job_id, incarnations):
            commands = self.commands_for(job_id, node, incarnations[node])
            if commands:
                found.append(AgentCommands(node, incarnations[node], tuple(commands)))
        return found

    @staticmethod
    def _is_current(job: TrackedJob, incarnation: str, attempt: int | None) -> bool:
        """Whether an agent's report counts: of the current launch, and not stopped."""
        if attempt is not None:
            job.incarnations.setdefault(incarnation, attempt)
        return incarnation not in job.stopped and job.current(incarnation)

    def _renew(
        self, job_id: str, job: TrackedJob, beats: Sequence[NodeBeat], now: float
    ) -> list[NodeBeat]:
        """Renew the current agents' leases (one store call for all) and note when each
        node was heard; the beats of current agents."""
        current = [b for b in beats if self._is_current(job, b.agent_incarnation, b.attempt)]
        if not current:
            return current
        job.last_report_s = now
        self.store.touch_leases(job_id, [(b.node, b.agent_incarnation) for b in current], now)
        heard, busy, attempt_of = job.heard, job.busy, job.attempt_of
        for beat in current:
            attempt = attempt_of(beat.agent_incarnation)
            before = heard.get(beat.node)
            gap = now - before.seen_s if before is not None and before.attempt == attempt else None
            heard[beat.node] = Heard(attempt, now, gap)
            # A beat says its node's ranks are as its last whole report had them (an
            # aggregator sends the whole report when a phase changes): still busy.
            saving = busy.get(beat.node)
            if saving is not None and saving.attempt == attempt:
                busy[beat.node] = saving._replace(seen_s=now)
        if job.unconfirmed:
            for beat in current:
                self._confirm_hangs(job_id, job, beat.node, now)
        return current

    def _note_ranks(
        self, job: TrackedJob, node: str, ranks: Sequence[RankStatus], attempt: int, now: float
    ) -> None:
        """What a node's ranks say beyond their steps: how many per node, their
        compute times, and which one is busy (checkpoint, eval, data)."""
        local = max((len(ranks), *(rank.local_rank + 1 for rank in ranks)))
        job.local_ranks_seen = max(job.local_ranks_seen, local)
        for rank in ranks:
            if rank.compute_p50_s is None or rank.compute_observed <= 0:
                continue
            known = job.compute.get(rank.global_rank)
            if (
                known is None
                or known.p50_s != rank.compute_p50_s
                or known.observed != rank.compute_observed
                or known.node != node
            ):
                job.compute[rank.global_rank] = ComputeSample(
                    node, rank.global_rank, rank.compute_p50_s, rank.compute_observed
                )
        busy = [(r.global_rank, str(r.phase)) for r in ranks if r.phase in _BUSY_PHASE_NAMES]
        if busy:
            busy_rank, phase = min(busy)
            job.busy[node] = BusyRank(attempt, now, busy_rank, Phase(phase))
        else:
            job.busy.pop(node, None)

    def _progress(self, job_id: str, job: TrackedJob, step: int, now: float) -> None:
        """The job's slowest loaded rank is at ``step``: settle held hang reports, record it."""
        self._settle_held(job_id, job, now, step)
        self.store.record_progress(job_id, step, now)
        news = progress_news(job.record, step, job.progress_step)
        if news is not None:
            self.decisions.enqueue(job_id, news)
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
        """Tell the in-job driver what to do (:func:`supervisor.core.driver_answer.answer`)."""
        job = self.jobs[job_id]
        if request.quarantined:
            self._note_quarantined(job_id, job, request)
        # Acting on the driver's report: the relaunch action is the executor's to finish.
        if request.phase is DriverPhase.RELAUNCHED:
            return self._confirm_relaunch(job_id, job, request)
        now, record = self.clock(), job.record
        facts = DriverFacts(
            record,
            pending=self.executor.pending_relaunch(job_id),
            observe_only=self.config.observe_only,
            spares_checked_s=job.spares_checked_s,
            validation=self._validation(record) if quarantine_wanted(record) else (),
        )
        reply = driver_answer.answer(facts, request, now, self.policy)
        if reply.note:
            log.info("job %s: %s", job_id, reply.note)
        for seen in reply.observations:
            self.decisions.enqueue(job_id, seen)
        if reply.step_ended:
            self._note_step_ended(job_id, job, request, now)
        if reply.spares_checked:
            job.spares_checked_s = now
        if reply.aside is not None:
            job.aside = dict(reply.aside)
        return reply.answer

    def _confirm_relaunch(
        self, job_id: str, job: TrackedJob, request: DriverRequest
    ) -> DriverAnswer:
        """The driver started (or failed to start) the relaunch: finish its action."""
        assert request.action_id is not None and request.ok is not None
        now = self.clock()
        try:
            seen = self.executor.confirm_relaunch(
                job_id, request.action_id, request.ok, request.reason, now
            )
        except StoreError as error:
            return DriverAnswer(DriverAction.WAIT, job.record.attempt, reason=str(error))
        self.decisions.enqueue(job_id, seen)
        return DriverAnswer(DriverAction.WAIT, job.record.attempt, reason="confirmed",
                            retry_after_s=0.0)  # fmt: skip

    def _validation(self, record: JobRecord) -> tuple[Checked | PastRollback, ...]:
        """What the current attempt's checkpoint validation found, from the action log."""
        rollback = record.recovery is not None and record.recovery.resume_before is not None
        found: list[Checked | PastRollback] = []
        for row in self.store.list_actions(record.job_id):
            if (
                row.kind != KIND_OF[ValidateCheckpoints]
                or row.args.get("attempt") != record.attempt
            ):
                continue
            result = row.result or {}
            for checked in result.get("checked", []):
                found.append(
                    Checked(
                        checked.get("path") or "",
                        bool(checked.get("valid")),
                        checked.get("reason") or "",
                    )
                )
            for past in result.get("past_rollback", []) if rollback else ():
                found.append(PastRollback(past["path"], past["step"]))
        return tuple(found)

    def _note_quarantined(self, job_id: str, job: TrackedJob, request: DriverRequest) -> None:
        """Record each checkpoint the driver moved into quarantine as an event of the job."""
        now = self.clock()
        root = job.spec.ckpt_root
        for source, target in request.quarantined:
            why, past = job.aside.get(os.path.join(root, source), _UNKNOWN_ASIDE)
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

    def _note_step_ended(
        self, job_id: str, job: TrackedJob, request: DriverRequest, now: float
    ) -> None:
        """The driver's "the attempt's step ended": recorded once, and decided on when its
        agents say nothing (:func:`supervisor.core.steps.step_end_fallback`)."""
        note, first = note_step_end(job.step_ended, request.attempt, request.exit_code, now)
        job.step_ended = note
        if first:
            self.store.record_observation(
                job_id,
                "driver_step_ended",
                {"exit_code": request.exit_code, "attempt": request.attempt},
                now,
            )
        stopped = {job.incarnations.get(agent) for agent in job.stopped}
        seen = step_end_fallback(
            note, job.record, now, self.config.lease_s, job.last_report_s, stopped
        )
        if seen is None:
            return
        log.warning(
            "job %s: the driver saw attempt %s's step end (exit %s) %.0f s ago and no agent "
            "has reported since: recovering on the driver's word",
            job_id, note.attempt, note.exit_code, now - note.first_s,
        )  # fmt: skip
        self.decisions.enqueue(job_id, seen)


_UNKNOWN_ASIDE = Aside("failed validation", False)


def _goodput_doc(goodput: Goodput) -> dict[str, Any]:
    return {
        "ratio": round(goodput.ratio, 4),
        "wall_s": round(goodput.wall_s, 3),
        "productive_s": round(goodput.productive_s, 3),
        "badput_s": {kind.value: round(value, 3) for kind, value in goodput.badput_s.items()},
    }
