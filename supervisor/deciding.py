"""The decision task: one observation at a time through the core, stored, then acted on.

:class:`Deciding` is the daemon's decision component: the intake, the Slurm
poll and the timers hand it what they observed (it is their
:class:`~supervisor.jobtable.DecisionQueue`). Everything that wants a decision
puts an item on one queue; one task takes them in arrival order, runs the pure
:func:`~supervisor.core.policy.decide`, stores the new record, the decision
and the planned actions in ONE transaction, then has the
:class:`~supervisor.act.executor.Executor` carry them out, feeding what they
report back in.

At start nothing is decided before Slurm answered once. Then the executor
reconciles (an action half done when the previous daemon died is finished
exactly once), each unfinished job's last decision is carried on, and the
agents' events stored after the newest one a decision names are decided on
again. A Slurm sighting read before the supervisor's requeue of the job
finished is dropped and read again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from agent.wire.protocol import Event, EventKind
from supervisor.act.executor import Executor
from supervisor.act.reconcile import KIND_OF, intent_of
from supervisor.cluster import Cluster
from supervisor.core import faults
from supervisor.core.decision import Decision, Policy
from supervisor.core.drains import (
    drain_storm,
    drains_allowed,
    user_flagged,
    user_over_share,
)
from supervisor.core.failure_rules import DEFAULT_RULES, Rule
from supervisor.core.failures import storage_wait_of
from supervisor.core.faults import REPLAYED_KINDS
from supervisor.core.intents import (
    Alert,
    CheckNode,
    DrainNode,
    DrainTicket,
    Intent,
    RequeueSmaller,
)
from supervisor.core.model import Cause, JobRecord, JobState, record_to_doc
from supervisor.core.observations import Observation, SlurmJobSeen, StorageUnavailable, Tick
from supervisor.core.periodic import next_deadline
from supervisor.core.policy import decide
from supervisor.jobtable import JobTable
from supervisor.store import ActionState, BlameOutcome, EventSource, Store

log = logging.getLogger("resurgo.supervisor")

# A deadline's Tick comes this much after it, so the clock the core reads has passed it.
DEADLINE_SLACK_S = 0.01


class Deciding:
    """The decision task over the job table; the daemon starts :meth:`loop`."""

    def __init__(
        self,
        jobs: JobTable,
        store: Store,
        executor: Executor,
        cluster: Cluster,
        policy: Policy,
        clock: Callable[[], float],
        rules: tuple[Rule, ...] = DEFAULT_RULES,
    ) -> None:
        self.jobs = jobs
        self.store = store
        self.executor = executor
        self.cluster = cluster
        self.policy = policy
        self.clock = clock
        # The failure rules in force, the operator's first (supervisor.core.failure_rules).
        self.rules = rules
        self.queue: asyncio.Queue[_Item] = asyncio.Queue()

    def act(self, job_id: str, intents: tuple[Intent, ...]) -> None:
        """Have the decision task plan and run intents decided outside the core."""
        self.queue.put_nowait(_Act(job_id, intents))

    def sighted(self, job_id: str, observation: SlurmJobSeen, read_s: float) -> None:
        """Hand the decision task what a poll that began at ``read_s`` saw of the job."""
        self.queue.put_nowait(_Sighting(job_id, observation, read_s))

    async def ask_reconcile(self) -> None:
        """Have the decision task run the executor's reconcile (it alone uses the executor)."""
        self.queue.put_nowait(_RECONCILE)

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
        for job_id, job in self.jobs.items():
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
        for job_id, job in self.jobs.items():
            if job.record.state.terminal:
                continue
            named = {row.event_id for row in self.store.decisions_for(job_id) if row.event_id}
            events = self.store.events_for(job_id, kinds=REPLAYED_KINDS)
            cursor = max((row.seq for row in events if row.event_id in named), default=0)
            for row in events:
                if row.seq <= cursor or row.source is not EventSource.AGENT:
                    continue
                event = Event(
                    EventKind(row.kind), job_id, row.node or "", row.event_id,
                    row.agent_seq or 0, row.time_s, row.payload,
                )  # fmt: skip
                if job.current(event.incarnation):
                    await self.apply(job_id, faults.read(event), row.event_id)

    def enqueue(self, job_id: str, observation: Observation, ref: str | None = None) -> None:
        """Have ``observation`` decided on, after everything queued before it."""
        self.queue.put_nowait((job_id, observation, ref))

    async def loop(self) -> None:
        """The decision task: the start steps once Slurm answered, then the queue forever."""
        # Deciding needs the cluster view (usable, idle and drained nodes): a
        # relaunch decided on an empty view would requeue the job with the few
        # nodes it still holds. Until Slurm answers once, observations wait.
        await self.cluster.known.wait()
        for start_step in (self.reconcile, self.resume_recoveries, self.replay_undecided):
            try:
                await start_step()
            except Exception:
                # The periodic reconcile finishes what this left unfinished.
                log.exception("%s at start failed; continuing", start_step.__name__)
        while True:
            await self._handle(await self.queue.get())
            # A queue that is not empty hands its next item over without a pause: let
            # the frames and batches that came meanwhile in between two decisions
            # (each persists its job's record; dozens queue behind a burst of reports).
            await asyncio.sleep(0)

    async def settle(self) -> None:
        """Handle everything queued so far (the decision task's work, run to empty)."""
        while not self.queue.empty():
            await self._handle(self.queue.get_nowait())

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
        view = self.cluster.view
        if isinstance(observation, StorageUnavailable):
            view = replace(view, storage_waits=self._storage_waits())
        decision = decide(before, observation, now, self.policy, view, self.rules)
        if set(decision.record.blamed_nodes) - set(before.blamed_nodes):
            decision = decide(
                before, observation, now, self.policy, self.cluster.fresh(now), self.rules
            )
        after = decision.record
        if after == before and not decision.intents:
            return
        self._persist(job_id, before, decision, ref, now)
        job.record = after
        newest = after.last_checkpoint_path
        if newest is not None and (newest, after.last_step) != (
            before.last_checkpoint_path,
            before.last_step,
        ):  # a new checkpoint, or one path saved again (Lightning's last.ckpt)
            self.executor.note_checkpoint(job_id, newest, self.policy.validation_level)
        if after.attempt != before.attempt:
            self.store.drop_leases(job_id)
            job.compute.clear()  # the new launch's ranks measure afresh
        if after.state is not before.state or decision.intents:
            _log_decision(job_id, before, decision)
        self._wake_at_deadline(job_id, after, now)
        for seen in await self.executor.execute(job_id, decision.intents, now):
            await self.apply(job_id, seen)

    def _storage_waits(self) -> tuple[tuple[str, str], ...]:
        """(file system, job) of every job waiting for its storage now: decisions are taken
        one at a time, so the table holds every wait decided so far, even between polls."""
        waits = ((storage_wait_of(job.record), job_id) for job_id, job in self.jobs.items())
        return tuple((fs, job_id) for fs, job_id in waits if fs)

    def _wake_at_deadline(self, job_id: str, record: JobRecord, now: float) -> None:
        """A Tick for ``record``'s next deadline (the end of an evidence window, of a
        backoff) at that moment: the periodic tick alone releases it up to ``tick_s``
        late, on the way from the fault to the relaunch. An early or extra Tick
        decides nothing."""
        due_s = next_deadline(record, now)
        if due_s is not None:
            delay_s = due_s - now + DEADLINE_SLACK_S
            asyncio.get_running_loop().call_later(delay_s, self.enqueue, job_id, Tick())

    def _persist(
        self, job_id: str, before: JobRecord, decision: Decision, ref: str | None, now: float
    ) -> None:
        after = decision.record
        # A record that only took news in (a newer checkpoint) or counted a
        # straggler report (and alerted on it) moves nothing: committed without
        # the fsync, which on a busy head node held the event loop up to 0.1 s,
        # and at 16,384 nodes came dozens of times a second with the straggler
        # reports. A power loss may take such a decision back; a straggler is
        # measured and reported again while it lasts (its reports are not
        # replayed), and its alert raised then. Whatever moves the job, blames a
        # node, plans an action beyond an alert or decides on any other cause is
        # fsynced.
        news = decision.cause is None and not decision.intents
        straggler = decision.cause is Cause.STRAGGLER and all(
            isinstance(intent, Alert) for intent in decision.intents
        )
        routine = (
            after.state is before.state
            and after.attempt == before.attempt
            and set(after.blamed_nodes) <= set(before.blamed_nodes)
            and (news or straggler)
        )
        with self.store.transaction(durable=not routine):
            self.store.update_record(
                job_id,
                state=after.state.value,
                record=record_to_doc(after),
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
            self._record_blames(job_id, before, decision, now)
            self.executor.plan(job_id, decision.intents, now)

    def _record_blames(
        self, job_id: str, before: JobRecord, decision: Decision, now: float
    ) -> None:
        """A blame row for each node ``decision`` blamed, with what was done about it."""
        blamed = set(decision.record.blamed_nodes) - set(before.blamed_nodes)
        if not blamed:
            return
        drained = {i.node for i in decision.intents if isinstance(i, DrainNode)}
        ticketed = {i.node for i in decision.intents if isinstance(i, DrainTicket)}
        checked = {i.node for i in decision.intents if isinstance(i, CheckNode)}
        cluster = self.cluster.view
        took_out = cluster.drained | cluster.down
        user = decision.record.slurm_user
        observing = self.executor.observe_only
        for node in sorted(blamed):
            if node in drained:
                outcome = BlameOutcome.WOULD_DRAIN if observing else BlameOutcome.DRAINED
            elif node in ticketed:
                outcome = BlameOutcome.WOULD_TICKET if observing else BlameOutcome.TICKETED
            elif node in checked:
                outcome = BlameOutcome.WOULD_CHECK if observing else BlameOutcome.CHECKING
            elif node in took_out:
                outcome = BlameOutcome.SLURM
            elif user_flagged(self.policy, cluster, user, node) is not None:
                outcome = BlameOutcome.FLAGGED
            elif drain_storm(self.policy, cluster, job_id, node) is not None:
                outcome = BlameOutcome.STORM
            elif cluster.may_drain and drains_allowed(self.policy, cluster) < 1:
                outcome = BlameOutcome.EXCLUDED  # the hourly share was used
            elif user_over_share(self.policy, cluster, user) is not None:
                outcome = BlameOutcome.USER_SHARE
            else:
                outcome = BlameOutcome.EXCLUDED
            self.store.record_blame(
                node,
                job_id=job_id,
                attempt=before.attempt,
                cause=decision.cause.value if decision.cause else "none",
                outcome=outcome,
                now_s=now,
            )

    def _end_attempt(self, job_id: str, before: JobRecord, decision: Decision, now: float) -> None:
        attempts = {row.attempt for row in self.store.attempts_for(job_id)}
        if before.attempt in attempts:
            cause = decision.cause.value if decision.cause else decision.record.state.value
            self.store.end_attempt(job_id, before.attempt, cause=cause, now_s=now)

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
# A requeue touched the job once it started: started, done or failed.
_REQUEUE_TOUCHED = (ActionState.STARTED, ActionState.DONE, ActionState.FAILED)
_Item = tuple[str, Observation, str | None] | _Reconcile | _Act | _Sighting


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
