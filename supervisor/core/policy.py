"""The decision core: ``decide(record, observation, now, policy, cluster) -> Decision``.

One pure function (DESIGN §3): the daemon feeds it every observation about a
job, stores the new record, and hands the intents to the executor. Nothing
here reads a clock or touches the OS; ``now_s`` is an argument.

Per cause (issue 5, items 3-4):

- a rank failed -> collect the other ranks' exits until every node's
  launcher has ended, or for at most ``exit_evidence_window_s`` (their peers
  fail moments later and the reports arrive in any order), then act on the
  root cause alone: the earliest death, a node signal winning a tie
  (:func:`supervisor.core.blame.blame_exits`); once a death by a node signal
  is in, only a death before it could still be the root cause, and the window
  closes :data:`NODE_SIGNAL_EVIDENCE_S` later;
- rank killed by a node signal -> blame its node, drain (within the hourly
  share, else alert), stop ranks, validate checkpoints, relaunch smaller;
- Python exception -> no drain, ``user_exception_retries`` retries; the same
  failure at the same step again -> CRASH_LOOP, stop the job;
- hang -> collect the other nodes' reports for ``hang_evidence_window_s``
  (or until every node has reported), blame the rank behind / outside the
  collective / stopped first; ranks that exit meanwhile are the hang's
  consequences (or our stopping them);
  a hang report during an exit window is evidence only;
- node lost (lease expired, Slurm DOWN/NOT_RESPONDING) -> exclude it (drain
  it unless Slurm already did), requeue if it was the batch host;
- health check failed -> drain, relaunch without it;
- straggler -> alert; drain only when persistent and ``straggler_drain``;
- preemption, time limit -> requeue without blame, no budget spent;
- Slurm's own requeue -> adopt it (REQUEUED), never requeue on top of it;
  once a checkpoint is chosen, resize the pending job when nodes of its
  last allocation are down, drained or blamed (Slurm's request still names
  them: :func:`supervisor.core.recovery.resize_requeued`);
- grow back (no fault) -> a checkpoint committed while the job runs below
  its original size and idle nodes allow a larger one: stop the ranks and
  requeue at that size from the checkpoint, no budget spent (``grow_back``).
  A relaunch likewise requeues at a larger size instead of shrinking inside
  the allocation when idle nodes allow it (:func:`supervisor.core.recovery.relaunch`).

Every restart spends budget only without progress (no committed step newer
than at the previous restart), counted once the cause is decided (never
when an evidence window opens); ``max_restarts_without_progress`` of them in a
row stop the job. Between restarts the relaunch waits ``not_before_s``
(exponential backoff); a :class:`~supervisor.core.observations.Tick` releases it.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import assert_never

from supervisor.core import (
    clean_end,
    drains,
    failures,
    faults,
    follow_slurm,
    planned_stop,
    recovery,
    rollback,
    skips,
)
from supervisor.core.blame import (
    NODE_SIGNALS,
    Blame,
    blame,
    blame_exits,
    blame_hang,
    exit_seen,
    is_failure,
    suspects_of,
)
from supervisor.core.decision import LIVE, Context, Decision, Policy
from supervisor.core.failure_rules import DEFAULT_RULES, Rule
from supervisor.core.intents import Alert, Severity, ValidateCheckpoints
from supervisor.core.model import (
    MAX_EXITS,
    Cause,
    ClusterView,
    CrashSignature,
    ExitSeen,
    JobRecord,
    JobState,
    Recovery,
    Suspect,
    at_step,
)
from supervisor.core.observations import (
    AgentReport,
    AgentStopped,
    CancelRequested,
    CheckpointCommitted,
    CheckpointValidated,
    CheckpointWritten,
    HangReported,
    HealthCheckFailed,
    LauncherExited,
    LeaseExpired,
    Observation,
    RankExited,
    RelaunchFinished,
    RequeueFailed,
    SilenceShared,
    SlurmJobSeen,
    SlurmNodeSeen,
    SpareCheckFailed,
    StepEnded,
    StepProgress,
    StorageUnavailable,
    StragglerReported,
    Tick,
    TimeLimitNear,
    TimeLimitNoticed,
    TrainingAnomaly,
    WorldMismatched,
)

__all__ = ["ClusterView", "Decision", "Policy", "decide", "permits"]

# Once a rank's death by a node signal is in, how long the exit window stays open for
# a death before it (the root cause then): an earlier death's report is on its way
# from its agent (which polls its ranks' exits every 0.25 s); the deaths after it,
# the peers' tearing down, cannot change the root cause (a node signal wins a tie).
NODE_SIGNAL_EVIDENCE_S = 0.5


def permits(policy: Policy, cluster_size: int) -> str:
    """What ``policy`` lets the supervisor do on a cluster of ``cluster_size`` nodes, in words.

    Said at start and whenever the cluster's size changes, so that an operator
    sees before the first fault whether the policy can act here at all.
    """
    share = math.floor(policy.max_drain_share_per_hour * cluster_size + 1e-9)
    limit = drains.drain_limit(policy, cluster_size)
    if limit == 0:
        allowed = (
            "no drain at all (min_drains_per_hour 0, and max_drain_share_per_hour "
            f"{policy.max_drain_share_per_hour:g} of {cluster_size} rounds down to 0): a blamed "
            "node is only excluded and alerted on; raise either setting to drain"
        )
    else:
        source = (
            f"max_drain_share_per_hour {policy.max_drain_share_per_hour:g}"
            if limit == share
            else f"min_drains_per_hour {policy.min_drains_per_hour}; the share "
            f"{policy.max_drain_share_per_hour:g} alone allows {share}"
        )
        allowed = f"up to {limit} drain{'s' if limit != 1 else ''} per hour ({source})"
    stragglers = (
        f"drained after {policy.straggler_reports_to_drain} reports"
        if policy.straggler_drain
        else "reported, never drained"
    )
    return (
        f"on {cluster_size} node{'s' if cluster_size != 1 else ''}: {allowed}; a node is drained "
        f"when blamed with confidence >= {policy.drain_confidence:g}; stragglers are "
        f"{stragglers}; a job stops after {policy.max_restarts_without_progress} restarts "
        f"without progress; a node blamed {policy.lemon_blames} times within "
        f"{policy.lemon_window_s / 86400:g} d stays out"
    )


def decide(
    record: JobRecord,
    observation: Observation,
    now_s: float,
    policy: Policy,
    cluster: ClusterView,
    rules: tuple[Rule, ...] = DEFAULT_RULES,
) -> Decision:
    """The next record and intents for ``observation`` (see the module docstring);
    ``rules``: the failure rules in force (:mod:`supervisor.core.failure_rules`).

    Raises :class:`~supervisor.core.model.IllegalTransition` only on a bug in the core.
    """
    if record.state.terminal:
        return _nothing(record, f"job already {record.state.value}")
    ctx = Context(now_s, policy, cluster, rules)
    match observation:
        case CheckpointCommitted():
            return _on_commit(record, observation, ctx)
        case CheckpointWritten():
            return _on_written(record, observation)
        case TimeLimitNoticed(time_left_s=left):
            return planned_stop.on_notice(record, left, False, ctx)
        case WorldMismatched():
            return _on_world_mismatch(record, observation, ctx)
        case RankExited() | HangReported() if record.time_limit_end_s is not None:
            what = f"{observation.KIND.value} on {observation.node}"
            return planned_stop.during_stop(record, what)
        case RankExited():
            return _on_rank_exit(record, observation, ctx)
        case HangReported():
            return _on_hang(record, observation, ctx)
        case HealthCheckFailed(node=node) if node in record.nodes:
            return _on_node_fault(record, blame(observation, record, ctx.cluster), ctx)
        case LauncherExited() | AgentStopped():
            return _on_launcher_end(record, observation, ctx)
        case StragglerReported() if record.state is JobState.RUNNING:
            return _on_straggler(record, observation, ctx)
        case HealthCheckFailed() | StragglerReported():
            return _idle(record, observation)
        case LeaseExpired() | SlurmNodeSeen():
            return _on_node(record, observation, ctx)
        case SpareCheckFailed(node=node):
            if node not in record.spare_nodes:
                return _nothing(record, f"{node} failed a spare check but is no spare now")
            return recovery.lose_spare(record, blame(observation, record, ctx.cluster), blame=True)
        case SilenceShared(nodes=nodes, reason=reason):
            # Lease expiry alone blames no node here: Slurm's next reading
            # (the job ended, a node DOWN) is what decides.
            return _nothing(record, f"agents on {', '.join(nodes)} silent: {reason}; asking Slurm")
        case StepEnded():
            return _on_step_ended(record, observation, ctx)
        case SlurmJobSeen():
            return follow_slurm.on_job_seen(record, observation, ctx)
        case CheckpointValidated():
            return _on_checkpoint(record, observation, ctx)
        case StorageUnavailable():
            return failures.on_storage_unavailable(record, observation, ctx)
        case RelaunchFinished():
            return _on_relaunch(record, observation, ctx)
        case StepProgress():
            return _on_progress(record, ctx)
        case RequeueFailed():
            return _on_requeue_failed(record, observation, ctx)
        case TimeLimitNear(attempt=attempt) if attempt is not None and attempt != record.attempt:
            return _nothing(record, f"time-limit report of attempt {attempt} is stale")
        case TimeLimitNear():
            return planned_stop.on_notice(record, observation.time_left_s, observation.stopped, ctx)
        case TrainingAnomaly():
            return rollback.on_anomaly(record, observation, ctx)
        case CancelRequested(reason=reason):
            why = reason or "cancelled on request"
            return recovery.stop(record, ctx.now_s, JobState.CANCELLED, Cause.OPERATOR, why)
        case Tick():
            return _on_tick(record, ctx)
        case AgentReport():
            return faults.decide_reported(record, observation, ctx)
        case _:
            # Every observation type has its case above: mypy flags a missing one
            # here, and at run time an unknown value is a bug, never a tick.
            assert_never(observation)


def _nothing(record: JobRecord, why: str) -> Decision:
    return Decision(record, (), None, why)


def _on_progress(record: JobRecord, ctx: Context) -> Decision:
    pending = record.recovery
    if record.state is JobState.REQUEUED and pending is not None and not pending.requeue_seen:
        # A grow requeues running ranks: they train on until the stop reaches
        # them, and their steps are not the requeued job's.
        return _nothing(record, "progress from before the requeue took effect")
    if record.state in (JobState.STARTING, JobState.RELAUNCHING, JobState.REQUEUED):
        running = replace(recovery.to_state(record, JobState.RUNNING, ctx.now_s), recovery=None)
        first = record.state is JobState.STARTING and record.attempt == 1
        return _nothing(running, "training started" if first else "training steps again")
    return _nothing(record, "progress noted")


def _idle(record: JobRecord, report: AgentReport) -> Decision:
    return _nothing(record, f"{report.KIND.value} from {report.node} needs no action now")


def _on_written(record: JobRecord, event: CheckpointWritten) -> Decision:
    """A checkpoint the script wrote itself: the job's progress, as a commit of ours is
    (the restart budget and backoff count restarts without a newer one). It grows
    no job back: whether the script would resume from it is the script's choice."""
    if event.step is None or (record.last_step is not None and event.step <= record.last_step):
        return _nothing(record, "checkpoint already known")
    record = replace(record, last_step=event.step, last_checkpoint_path=event.path)
    return _nothing(record, f"checkpoint written at step {event.step}")


def _on_world_mismatch(record: JobRecord, report: WorldMismatched, ctx: Context) -> Decision:
    # Each node training alone writes over the others' checkpoints: no restart
    # fixes the command, and a run that "completes" this way is not the job.
    reason = (
        f"{report.detail}: the launch command set its own node count (torchrun "
        "--standalone or --nnodes inside a wrapper script?). Give torchrun to resurgo "
        "submit directly, or drop those options from the wrapper"
    )
    return recovery.stop(record, ctx.now_s, JobState.FAILED, Cause.WORLD_MISMATCH, reason)


def _on_commit(record: JobRecord, event: CheckpointCommitted, ctx: Context) -> Decision:
    if event.step is None or (record.last_step is not None and event.step <= record.last_step):
        return _nothing(record, "checkpoint already known")
    record = replace(record, last_step=event.step, last_checkpoint_path=event.path)
    if record.state in (JobState.STARTING, JobState.RELAUNCHING):
        record = replace(recovery.to_state(record, JobState.RUNNING, ctx.now_s), recovery=None)
    committed = _nothing(record, f"checkpoint committed at step {event.step}")
    if not ctx.policy.grow_back or record.state is not JobState.RUNNING or event.path is None:
        return committed
    if record.time_limit_end_s is not None:
        return committed  # the planned stop requeues the job anyway
    # Right after a commit a restart loses no work: the moment to grow back.
    grown = recovery.grow(record, ctx, event.path, event.step)
    return grown or committed


def _on_rank_exit(record: JobRecord, event: RankExited, ctx: Context) -> Decision:
    seen = failures.classified(exit_seen(event), event, record, ctx)
    rank = f"rank {seen.global_rank} on {seen.node}"
    if not is_failure(seen):
        if seen.signal is None:
            return _nothing(clean_end.finished(record, seen), f"rank {seen.global_rank} finished")
        if seen.script_ended:  # stopped in its teardown: its training had ended
            finished = clean_end.finished(record, seen)
            return _nothing(finished, f"{rank} was stopped after its script ran to its end")
        return _nothing(record, "; ".join(blame(event, record, ctx.cluster).evidence))
    if record.state in LIVE:
        opened = _open_exit_window(record, seen, ctx)
        pending = opened.record.recovery
        if event.ranks_left == 0 and pending is not None and pending.collecting_exits:
            # The node's every rank has exited: its evidence is in (one rank a node).
            record = _settled(opened.record, event.node)
            return replace(opened, record=record) if _due(record) else _decide_exits(record, ctx)
        return opened
    pending = record.recovery
    if record.state is not JobState.RECOVERING or pending is None:
        return _nothing(record, f"{rank} exited while {record.state.value}")
    if pending.evidence_until_s is not None and not pending.exits:
        # The hang was reported first, so it is older than this death: the rank
        # died of it (a collective timeout, a watchdog) and the hang's blame stands.
        return _nothing(record, f"{rank} exited during a hang: evidence only")
    if not pending.collecting_exits:
        return _nothing(record, f"{rank} exited after the cause was decided")
    if seen in pending.exits:
        return _nothing(record, f"{rank} exit already known")
    exits = tuple(sorted((*pending.exits, seen), key=lambda e: e.died_at_s))[:MAX_EXITS]
    cause = blame_exits(exits, record)[1].cause
    until = pending.evidence_until_s
    if until is not None:
        until = min(until, _evidence_until(seen, ctx.now_s))
    record = replace(
        record, recovery=replace(pending, cause=cause, exits=exits, evidence_until_s=until)
    )
    if event.ranks_left == 0:  # this node's every rank has exited: its evidence is in
        record = _settled(record, event.node)
        if not _due(record):
            return _decide_exits(record, ctx)
    return Decision(record, (), cause, f"{rank} failed too: evidence for the root cause")


def _settled(record: JobRecord, node: str) -> JobRecord:
    """``record`` with ``node``'s exits all in: its launcher ended, or its last rank exited."""
    pending = record.recovery
    if pending is None or node not in record.nodes or node in pending.settled:
        return record
    settled = tuple(sorted({*pending.settled, node}))
    return replace(record, recovery=replace(pending, settled=settled))


def _due(record: JobRecord) -> list[str]:
    """The nodes whose exits are still due in the open exit window."""
    settled = record.recovery.settled if record.recovery is not None else ()
    return [node for node in record.nodes if node not in settled]


def _open_exit_window(record: JobRecord, seen: ExitSeen, ctx: Context) -> Decision:
    """The first rank failed: its peers' exits follow; the root cause waits for them."""
    window = ctx.policy.exit_evidence_window_s
    cause = blame_exits((seen,), record)[1].cause
    until = min(ctx.now_s + window, _evidence_until(seen, ctx.now_s))
    record = replace(
        recovery.to_state(record, JobState.RECOVERING, ctx.now_s),
        recovery=Recovery(
            cause=cause,
            started_s=ctx.now_s,
            evidence_until_s=until,
            exits=(seen,),
            before_first_step=failures.before_first_step(record),
        ),
    )
    if window == 0:
        return _decide_exits(record, ctx)
    explanation = (
        f"rank {seen.global_rank} on {seen.node} failed: "
        f"collecting the other ranks' exits for {until - ctx.now_s:g}s"
    )
    return Decision(record, (), cause, explanation)


def _evidence_until(seen: ExitSeen, now: float) -> float:
    """The latest end of the exit window that ``seen``, in at ``now``, allows:
    :data:`NODE_SIGNAL_EVIDENCE_S` on when it died of a node signal, else no bound."""
    return now + NODE_SIGNAL_EVIDENCE_S if seen.signal in NODE_SIGNALS else math.inf


def _on_launcher_end(
    record: JobRecord, event: LauncherExited | AgentStopped, ctx: Context
) -> Decision:
    """A node's launcher ended: its ranks' exits are all reported; maybe every node's are."""
    pending = record.recovery
    idle = f"{event.KIND.value} from {event.node} needs no action now"
    if record.state is not JobState.RECOVERING or pending is None or not pending.collecting_exits:
        return _nothing(record, idle)
    if event.node not in record.nodes or event.node in pending.settled:
        return _nothing(record, idle)
    record = _settled(record, event.node)
    waiting = _due(record)
    if not waiting:
        return _decide_exits(record, ctx)
    return _nothing(record, f"launcher on {event.node} ended; exits still due from {waiting}")


def _on_step_ended(record: JobRecord, ended: StepEnded, ctx: Context) -> Decision:
    """The driver saw the attempt's step fail while the job still runs; no agent told why.

    Its agents' reports were lost (they exited while the supervisor was away)
    or never sent: the attempt failed all the same, and the recovery opens
    as for a launcher end, with no node blamed (no evidence names one).
    """
    if (
        ended.attempt != record.attempt
        or record.state not in LIVE
        or ended.exit_code in (None, 0)
        or record.time_limit_end_s is not None
    ):
        return _nothing(record, f"step of attempt {ended.attempt} ended; nothing to add")
    # srun exits 128 + N when a task died of signal N.
    signalled = ended.exit_code is not None and ended.exit_code > 128
    verdict = Blame(
        None,
        Cause.RANK_SIGNAL if signalled else Cause.USER_EXCEPTION,
        0.0,
        (f"the driver saw attempt {ended.attempt}'s step end (exit {ended.exit_code}) "
         "with no rank's exit reported; no node is named",),
    )  # fmt: skip
    return recovery.start(record, ctx, verdict)


def _decide_exits(record: JobRecord, ctx: Context) -> Decision:
    """The exit window closed: recover from the root cause alone."""
    assert record.recovery is not None
    ended_clean = clean_end.why(record)
    if ended_clean is not None:
        return recovery.stop(record, ctx.now_s, JobState.COMPLETED, Cause.SLURM_ENDED, ended_clean)
    root, verdict = blame_exits(
        record.recovery.exits, record, ctx.cluster.avoided_by(record.slurm_user)
    )
    record, by_class = failures.by_class(record, root, record.recovery.exits, ctx)
    if by_class is not None:
        return by_class
    verdict = failures.annotated(verdict, root, ctx)
    if verdict.cause is Cause.USER_EXCEPTION:
        return _on_exception(record, root, ctx, verdict)
    return recovery.start(record, ctx, verdict)


def _on_exception(record: JobRecord, root: ExitSeen, ctx: Context, verdict: Blame) -> Decision:
    # A raised exception is named the same whether the rank then exited 1 or was
    # stopped while it unwound: the same crash reads as the same crash.
    digest = root.error_digest or (
        f"raised:{root.raised}" if root.raised is not None else f"exit:{root.exit_code}"
    )
    signature = CrashSignature(digest, root.step)
    if signature in record.signatures:
        reason = (
            f"crash loop: {signature.digest} {at_step(signature.step)} again "
            f"(rank {root.global_rank} on {root.node}); not a node fault, no drain"
        )
        return recovery.stop(record, ctx.now_s, JobState.FAILED, Cause.CRASH_LOOP, reason)
    retries = 0 if recovery.made_progress(record) else record.user_retries_without_progress
    if retries >= ctx.policy.user_exception_retries:
        reason = (
            f"user exception ({signature.digest} {at_step(signature.step)}) after "
            f"{retries} retr{'y' if retries == 1 else 'ies'} without progress"
        )
        return recovery.stop(record, ctx.now_s, JobState.FAILED, Cause.USER_EXCEPTION, reason)
    record = replace(recovery.remember(record, signature), user_retries_without_progress=retries)
    started = recovery.start(record, ctx, verdict)
    if started.record.state is JobState.RECOVERING:
        started = replace(
            started, record=replace(started.record, user_retries_without_progress=retries + 1)
        )
    return started


def _on_hang(record: JobRecord, event: HangReported, ctx: Context) -> Decision:
    if event.stalled:
        return _on_stall(record, event, ctx)
    pending = record.recovery
    if record.state in LIVE:
        suspects = suspects_of(event)
        record = replace(
            recovery.to_state(record, JobState.RECOVERING, ctx.now_s),
            stalls=(),
            recovery=Recovery(
                cause=Cause.HANG,
                started_s=ctx.now_s,
                evidence_until_s=ctx.now_s + ctx.policy.hang_evidence_window_s,
                suspects=(*suspects, *_stalled_with(record.stalls, suspects)),
            ),
        )
    elif _hang_window_open(record):
        assert pending is not None
        record = replace(
            record, recovery=replace(pending, suspects=(*pending.suspects, *suspects_of(event)))
        )
    else:
        # In an exit window ranks already died: whatever hangs now waits on
        # them, and their exits name the root cause.
        return _nothing(record, f"hang report from {event.node} during recovery: evidence only")
    if ctx.policy.hang_evidence_window_s == 0 or _every_node_reported(record):
        return _blame_hang(record, ctx)
    return Decision(record, (), Cause.HANG, f"hang on {event.node}: collecting evidence")


def _hang_window_open(record: JobRecord) -> bool:
    """A hang's evidence is being collected (not a rank exit's)."""
    pending = record.recovery
    return pending is not None and pending.evidence_until_s is not None and not pending.exits


def _on_stall(record: JobRecord, event: HangReported, ctx: Context) -> Decision:
    """A node whose ranks stopped outside any collective, none of them waiting in one.

    Evidence, never a recovery by itself: a long computation on one rank that
    the hooks do not see stops its steps too, and whether anyone waits for it
    is for the other nodes' hang reports to say. During a hang's evidence
    window it is that node's report, so the window closes once every node has
    spoken and blame finds the rank outside the collective the others wait in;
    before one, it is kept for the window a peer's report opens.
    """
    stalled = suspects_of(event)
    if _hang_window_open(record):
        assert record.recovery is not None
        pending = record.recovery
        record = replace(record, recovery=replace(pending, suspects=(*pending.suspects, *stalled)))
        if _every_node_reported(record):
            return _blame_hang(record, ctx)
        return Decision(
            record, (), Cause.HANG, f"ranks on {event.node} stopped outside any collective"
        )
    if record.state not in LIVE:
        return _nothing(record, f"stall report from {event.node} while {record.state.value}")
    kept = (*(s for s in record.stalls if s.node != event.node), *stalled)
    return _nothing(
        replace(record, stalls=kept),
        f"ranks on {event.node} stopped outside any collective: kept as evidence, should "
        "other nodes report ranks waiting for them",
    )


def _stalled_with(stalls: tuple[Suspect, ...], hung: tuple[Suspect, ...]) -> tuple[Suspect, ...]:
    """The kept stalls of the same episode as ``hung``: stopped within a step of a hung
    rank (an earlier episode's stall stopped at another step)."""
    steps = [s.last_step for s in hung if s.last_step is not None]
    return tuple(
        stall
        for stall in stalls
        if stall.last_step is not None and any(abs(stall.last_step - step) <= 1 for step in steps)
    )


def _every_node_reported(record: JobRecord) -> bool:
    """Every node of the attempt sent its hung ranks: no more evidence is due.

    The window exists for the reports still in flight; once each node's agent
    has spoken, waiting it out changes nothing but the time to recover.
    """
    assert record.recovery is not None
    reported = {suspect.node for suspect in record.recovery.suspects}
    return bool(record.nodes) and reported.issuperset(record.nodes)


def _blame_hang(record: JobRecord, ctx: Context) -> Decision:
    assert record.recovery is not None
    verdict = blame_hang(
        record.recovery.suspects, ctx.cluster.avoided_by(record.slurm_user), record.nodes
    )
    return recovery.start(record, ctx, verdict)


def _on_straggler(record: JobRecord, event: StragglerReported, ctx: Context) -> Decision:
    counts = dict(record.straggler_reports)
    counts[event.node] = counts.get(event.node, 0) + 1
    record = replace(record, straggler_reports=tuple(sorted(counts.items())))
    count = counts[event.node]
    message = f"job {record.job_id}: straggler on {event.node} ({count}x): "
    alert = Alert(record.job_id, record.attempt, Severity.WARNING, message + event.detail)
    if not ctx.policy.straggler_drain or count < ctx.policy.straggler_reports_to_drain:
        # One alert per node; a straggler that lasts is reported again, and counted.
        alerts = (alert,) if count == 1 else ()
        why = f"straggler on {event.node} reported ({count}x), not drained: {event.detail}"
        return Decision(record, alerts, Cause.STRAGGLER, why)
    verdict = blame(event, record, ctx.cluster)
    # Persistent and configured: treat as a fault of the node, whatever the score.
    verdict = replace(verdict, confidence=max(verdict.confidence, ctx.policy.drain_confidence))
    started = recovery.start(record, ctx, verdict)
    return replace(started, intents=(alert, *started.intents))


def _on_node(
    record: JobRecord, observation: LeaseExpired | SlurmNodeSeen, ctx: Context
) -> Decision:
    verdict = blame(observation, record, ctx.cluster)
    if verdict.node is not None and verdict.node in record.spare_nodes:
        return recovery.lose_spare(record, verdict)
    if verdict.node is None or verdict.node not in record.nodes:
        return _nothing(record, "; ".join(verdict.evidence) or "node not in this job")
    return _on_node_fault(
        record,
        verdict,
        ctx,
        # Slurm marks a DOWN node unusable by itself: draining it too adds nothing.
        slurm_took_it=isinstance(observation, SlurmNodeSeen),
    )


def _on_node_fault(
    record: JobRecord, verdict: Blame, ctx: Context, slurm_took_it: bool = False
) -> Decision:
    lost_batch_host = verdict.cause is Cause.NODE_LOST and verdict.node == record.batch_host
    if record.state in LIVE:
        return recovery.start(
            record,
            ctx,
            verdict,
            requeue=lost_batch_host,
            slurm_took_it=slurm_took_it,
        )
    if record.state is JobState.RECOVERING and record.recovery is not None:
        return recovery.add_fault(
            record, ctx, verdict, requeue=lost_batch_host, slurm_took_it=slurm_took_it
        )
    return _nothing(record, f"{verdict.cause.value} on {verdict.node} while {record.state.value}")


def _on_checkpoint(record: JobRecord, seen: CheckpointValidated, ctx: Context) -> Decision:
    pending = record.recovery
    # While evidence is collected no validation was asked for: a report is stale.
    if (
        pending is None
        or pending.validated
        or pending.evidence_until_s is not None
        or record.state
        not in (
            JobState.RECOVERING,
            JobState.REQUEUED,
        )
    ):
        return _nothing(record, "no checkpoint choice pending")
    if seen.path is not None and not seen.valid:
        rejected = (*pending.rejected, seen.path)
        record = replace(record, recovery=replace(pending, rejected=rejected))
        retry = ValidateCheckpoints(
            record.job_id,
            record.attempt,
            ctx.policy.validation_level,
            rejected,
            pending.resume_before,
        )
        return Decision(record, (retry,), pending.cause, f"{seen.path} invalid: {seen.reason}")
    if seen.path is None and record.last_step is not None:
        reason = (
            f"no checkpoint passed {ctx.policy.validation_level.value} validation "
            f"(rejected: {', '.join(pending.rejected) or 'none found'})"
        )
        if pending.resume_before is not None:
            reason = rollback.nothing_before(pending.resume_before, pending.rejected, ctx.policy)
        return recovery.stop(record, ctx.now_s, JobState.FAILED, Cause.NO_CHECKPOINT, reason)
    chosen = replace(pending, validated=True, resume_from=seen.path, resume_step=seen.step)
    record = skips.with_skip(replace(record, recovery=chosen), ctx.policy)
    if record.state is JobState.REQUEUED:
        return recovery.resize_requeued(record, ctx)
    return recovery.relaunch(record, ctx)


def _on_relaunch(record: JobRecord, seen: RelaunchFinished, ctx: Context) -> Decision:
    relaunched = record.state is JobState.STARTING and recovery.fast_path_started(record)
    if seen.attempt != record.attempt or not (record.state is JobState.RELAUNCHING or relaunched):
        return _nothing(record, f"report on attempt {seen.attempt} is stale")
    if seen.ok:
        if relaunched:
            return _nothing(record, "new step already started")
        return _nothing(recovery.to_state(record, JobState.STARTING, ctx.now_s), "new step started")
    assert record.recovery is not None
    # The fast path failed (or its step never started: its agents never called
    # in): fall back to the requeue path with the same checkpoint.
    failing = replace(
        recovery.to_state(record, JobState.RECOVERING, ctx.now_s),
        recovery=replace(record.recovery, requeue=True),
    )
    fallback = recovery.relaunch(failing, ctx)
    return replace(fallback, cause=Cause.RELAUNCH_FAILED)


def _on_requeue_failed(record: JobRecord, seen: RequeueFailed, ctx: Context) -> Decision:
    """The requeue cannot happen (the job left Slurm): end the job saying how to go on,
    rather than show it requeued forever."""
    if seen.attempt != record.attempt or record.state is not JobState.REQUEUED:
        return _nothing(record, f"requeue report on attempt {seen.attempt} is stale")
    resume = record.last_checkpoint_path or "its newest valid checkpoint"
    reason = (
        f"Slurm could not requeue the job ({seen.reason}); resubmit it with `resurgo submit` "
        f"and the same --ckpt-root: it resumes from {resume}"
    )
    return recovery.stop(record, ctx.now_s, JobState.FAILED, Cause.RELAUNCH_FAILED, reason)


def _on_tick(record: JobRecord, ctx: Context) -> Decision:
    look = failures.storage_look_due(record, ctx)
    if look is not None:
        return look
    deadline = planned_stop.on_tick(record, ctx)
    if deadline is not None:
        return deadline
    pending = record.recovery
    if record.state is not JobState.RECOVERING or pending is None:
        return _nothing(record, "nothing waits")
    if pending.evidence_until_s is not None:
        if ctx.now_s < pending.evidence_until_s:
            collecting = "rank exits" if pending.exits else "hang evidence"
            return _nothing(record, f"collecting {collecting}")
        if pending.exits:
            return _decide_exits(record, ctx)
        return _blame_hang(record, ctx)
    if pending.validated:
        return recovery.relaunch(record, ctx)
    return _nothing(record, "waiting for checkpoint validation")
