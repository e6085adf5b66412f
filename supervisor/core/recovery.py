"""The steps of one recovery, in DESIGN §3's order, as pure functions over the job record.

:func:`supervisor.core.policy.decide` calls these; each returns a
:class:`~supervisor.core.policy.Decision`. The order: account the restart against
the budget, drain the blamed node (rate-limited), stop the ranks, validate
checkpoints newest first, wait out the backoff, then relaunch inside the
allocation (fast path) or requeue with the new size. Besides recoveries, a job
running below its original size grows back (:func:`grow`) when a checkpoint
was just committed and idle nodes allow a larger size.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import replace

from supervisor.core.blame import Blame
from supervisor.core.decision import Context, Decision, decision
from supervisor.core.drains import exclude_and_drain
from supervisor.core.intents import (
    Intent,
    RelaunchStep,
    RequeueSmaller,
    ShrinkAllocation,
    StopJob,
    StopRanks,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import (
    MAX_SIGNATURES,
    NO_BUDGET_CAUSES,
    Cause,
    ClusterView,
    CrashSignature,
    JobRecord,
    JobState,
    Recovery,
    check_transition,
)


def to_state(record: JobRecord, state: JobState, now_s: float) -> JobRecord:
    """``record`` in ``state``; raises IllegalTransition for a change TRANSITIONS forbids."""
    check_transition(record.state, state)
    if record.state is state:
        return record
    return replace(record, state=state, state_since_s=now_s)


def world_size(available: int, record: JobRecord) -> int | None:
    """The largest size <= ``available`` and <= the original, a multiple of the unit,
    >= the minimum; None when there is none."""
    size = min(available, record.original_nodes)
    size -= size % record.unit
    return size if size >= record.min_nodes and size > 0 else None


def split_allocation(
    record: JobRecord, allocated: tuple[str, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A new allocation as the world and its hot spares.

    The world is the largest size the job may run at, on the first nodes (the
    batch host first); the rest are spares. A job without spares runs on the
    whole allocation, as one whose allocation is below its minimum does (it
    fails or recovers as before).
    """
    if not record.spares_wanted:
        return allocated, ()
    size = world_size(len(allocated), record)
    if size is None:
        return allocated, ()
    return allocated[:size], allocated[size:]


def swap_in(
    record: JobRecord, exclude: AbstractSet[str]
) -> tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, str], ...]]:
    """The world with each excluded node replaced by a free spare, where one is left.

    Returns the new world (a spare in the place of the node it replaces, so the
    layout of ranks per node stays; an excluded node with no spare left is
    dropped), the spares still free, and the ``(out, in)`` swaps made. Spares
    that are excluded themselves (down, drained, lemons, failed their health
    check) are never used.
    """
    free = [node for node in record.spare_nodes if node not in exclude]
    world: list[str] = []
    swaps: list[tuple[str, str]] = []
    for node in record.nodes:
        if node not in exclude:
            world.append(node)
        elif free:
            spare = free.pop(0)
            world.append(spare)
            swaps.append((node, spare))
    return tuple(world), tuple(free), tuple(swaps)


def lose_spare(record: JobRecord, verdict: Blame, blame: bool = False) -> Decision:
    """A hot spare went down, stopped responding or failed its health check while it
    waited: take it out of the allocation (before Slurm ends the job for a failed
    node); nothing restarts.

    A running job keeps training (the spare ran nothing); the spare's loss is
    counted only in the spares left. It is refilled like a used one. ``blame``
    (a failed health check: Slurm still offers the node) keeps the node out of
    this job's refills and requeues, as a node this job blamed is.
    """
    node = verdict.node
    assert node is not None and node in record.spare_nodes
    spares = tuple(n for n in record.spare_nodes if n != node)
    kept = replace(record, spare_nodes=spares)
    if blame:
        kept = replace(kept, blamed_nodes=tuple(sorted({*record.blamed_nodes, node})))
    evidence = "; ".join(verdict.evidence)
    if not record.nodes or record.state not in (
        JobState.STARTING,
        JobState.RUNNING,
        JobState.RELAUNCHING,
    ):
        # Recovering: the relaunch releases it with the blamed nodes.
        return decision(kept, (), None, f"spare {node} lost ({evidence})")
    shrink = ShrinkAllocation(record.job_id, record.attempt, (*record.nodes, *spares))
    return decision(
        kept, (shrink,), None, f"spare {node} lost ({evidence}): released; {len(spares)} left"
    )


def with_spares(record: JobRecord, size: int, available: int) -> int:
    """The node count to ask Slurm for: the world's ``size`` and as many of the
    spares wanted as ``available`` nodes leave room for."""
    return size + max(0, min(record.spares_wanted, available - size))


def grown_size(
    record: JobRecord, kept: tuple[str, ...], cluster: ClusterView, exclude: AbstractSet[str]
) -> int | None:
    """The world size ``kept`` makes with the cluster's idle nodes (less ``exclude``),
    when it is larger than the one ``kept`` makes alone; None when idle nodes add nothing.

    Idle nodes only: a job asking for them starts at once, where busy ones would
    leave it waiting in the queue.
    """
    idle = cluster.idle - exclude - set(kept)
    larger = world_size(len(kept) + len(idle), record)
    alone = world_size(len(kept), record) or 0
    return larger if larger is not None and larger > alone else None


def fast_path_started(record: JobRecord) -> bool:
    """The recovery relaunched a step inside the allocation (not through a requeue)."""
    pending = record.recovery
    return pending is not None and pending.validated and not pending.requeue


def made_progress(record: JobRecord) -> bool:
    """A checkpoint newer than the one at the previous restart was committed."""
    if record.last_step is None:
        return False
    return record.step_at_last_restart is None or record.last_step > record.step_at_last_restart


def stop(record: JobRecord, now_s: float, status: JobState, cause: Cause, reason: str) -> Decision:
    """End the job for good with ``reason`` (StopJob; the store keeps the reason)."""
    ended = replace(to_state(record, status, now_s), final_reason=reason, recovery=None)
    return decision(ended, (StopJob(record.job_id, record.attempt, status, reason),), cause, reason)


def start(
    record: JobRecord,
    ctx: Context,
    blame: Blame,
    *,
    requeue: bool = False,
    slurm_took_it: bool = False,
    stop_ranks: bool = True,
    resume_before: int | None = None,
    settle_until_s: float | None = None,
) -> Decision:
    """Begin a recovery for ``blame.cause``: budget, drain, stop ranks, validate checkpoints.

    ``resume_before``: only checkpoints of that step or earlier are candidates
    (a rollback past a training anomaly). ``settle_until_s``: a save still being
    written is awaited until then before the checkpoints are validated
    (:class:`~supervisor.core.intents.ValidateCheckpoints`).

    During a planned stop for the time limit the allocation is about to end:
    whatever the cause, the job is requeued, never relaunched inside it.
    """
    cause = blame.cause
    if record.time_limit_end_s is not None:
        requeue = True
        record = replace(record, time_limit_end_s=None)
    progress = made_progress(record)
    if cause in NO_BUDGET_CAUSES:
        not_before = None
        without_progress = record.restarts_without_progress
    else:
        without_progress = 0 if progress else record.restarts_without_progress + 1
        if without_progress > ctx.policy.max_restarts_without_progress:
            reason = (
                f"restart budget exhausted: {without_progress} restarts without a newer "
                f"checkpoint than step {record.step_at_last_restart} (last: {cause.value})"
            )
            return stop(record, ctx.now_s, JobState.FAILED, Cause.BUDGET_EXHAUSTED, reason)
        # A first fault after progress relaunches at once: the backoff guards against
        # a crash loop, and a newer checkpoint since the last restart is none.
        not_before = None
        if without_progress:
            backoff = ctx.policy.backoff_base_s * 2 ** (without_progress - 1)
            not_before = ctx.now_s + min(ctx.policy.backoff_max_s, backoff)
    earlier = record.recovery
    record = replace(
        to_state(record, JobState.RECOVERING, ctx.now_s).with_restart(cause),
        attempt=record.attempt + 1,
        restarts_without_progress=without_progress,
        step_at_last_restart=record.last_step,
        user_retries_without_progress=(0 if progress else record.user_retries_without_progress),
        not_before_s=not_before,
        stalls=(),
        recovery=Recovery(
            cause=cause,
            started_s=earlier.started_s if earlier else ctx.now_s,
            suspects=earlier.suspects if earlier else (),
            exclude=earlier.exclude if earlier else (),
            requeue=requeue or (earlier.requeue if earlier else False),
            resume_before=resume_before,
        ),
    )
    record, drain_intents, drained = exclude_and_drain(record, blame, ctx, slurm_took_it)
    intents: list[Intent] = list(drain_intents)
    if stop_ranks and not requeue:
        intents.append(StopRanks(record.job_id, record.attempt, ctx.policy.stop_grace_s))
    # Before the time limit, a full read of a large checkpoint takes longer than the
    # time left, and healthy ranks just wrote it (supervisor.core.planned_stop).
    level = ValidationLevel.QUICK if cause is Cause.TIME_LIMIT else ctx.policy.validation_level
    intents.append(
        ValidateCheckpoints(
            record.job_id, record.attempt, level, (), resume_before, settle_until_s=settle_until_s
        )
    )
    return decision(record, tuple(intents), cause, f"{cause.value}: {drained}")


def add_fault(
    record: JobRecord, ctx: Context, blame: Blame, *, requeue: bool, slurm_took_it: bool
) -> Decision:
    """A further node fault during a recovery: exclude (and drain) it too; nothing restarts."""
    record, intents, drained = exclude_and_drain(record, blame, ctx, slurm_took_it)
    assert record.recovery is not None
    if requeue:
        record = replace(record, recovery=replace(record.recovery, requeue=True))
    return decision(record, intents, blame.cause, f"during recovery: {drained}")


def remember(record: JobRecord, signature: CrashSignature) -> JobRecord:
    """``record`` with ``signature`` kept for crash-loop detection (the newest few)."""
    return replace(record, signatures=(*record.signatures, signature)[-MAX_SIGNATURES:])


def relaunch(record: JobRecord, ctx: Context) -> Decision:
    """Relaunch once a checkpoint is chosen and the backoff passed, else wait.

    Fast path: the allocation's healthy nodes, batch host first, each blamed
    node replaced by a healthy hot spare while one is left (the world keeps its
    size and layout: no reshard), else shrunk to the new world size; the
    blamed nodes leave the allocation. Requeue path (batch host lost, allocation gone, or too few
    healthy nodes inside it): as many usable nodes as the cluster has, up to
    the original size, so a requeue goes back to full size when it can, plus
    the spares wanted as far as nodes free now allow.

    When the fast path would shrink the job below its original size and idle
    nodes allow a larger size, the job is requeued at that size instead. The
    trade-off: a requeue gives up the allocation and costs a new one (the
    batch script, the agents and the ranks start over, and a job queued ahead
    may take the idle nodes first), where the fast path is a new srun step in
    seconds; but with idle nodes Slurm starts the requeued job at once
    (StartTime=now), and the job then trains at the larger size until its end
    instead of at reduced throughput.
    """
    recovery = record.recovery
    assert recovery is not None and recovery.validated
    cause = recovery.cause
    if record.not_before_s is not None and ctx.now_s < record.not_before_s:
        return decision(
            record, (), cause, f"backing off {record.not_before_s - ctx.now_s:.0f} s more"
        )
    # Every node this job blamed stays out, not this fault's alone: a drain the
    # hourly share refused, or a spare that failed its health check, left it in
    # service and idle, where a larger size or a refill would take it again.
    blamed = {*recovery.exclude, *record.blamed_nodes}
    avoided = ctx.cluster.avoided_by(record.slurm_user)
    exclude = {*blamed, *avoided, *ctx.cluster.down, *ctx.cluster.drained}
    healthy = tuple(n for n in record.nodes if n not in exclude)
    world, spares, swapped = swap_in(record, exclude)
    size = world_size(len(world), record)
    ready = replace(record, not_before_s=None)
    fast = not recovery.requeue and size is not None and record.batch_host in healthy
    grown = grown_size(record, world, ctx.cluster, exclude | set(spares)) if fast else None
    if fast and grown is None and size is not None:
        # Nodes the unit leaves over stay as spares as far as the job wants them.
        keep, spares = world[:size], (*spares, *world[size:])[: record.spares_wanted]
        swapped = tuple((out, spare) for out, spare in swapped if spare in keep)
        intents: list[Intent] = []
        if (*keep, *spares) != (*record.nodes, *record.spare_nodes):
            intents.append(ShrinkAllocation(record.job_id, record.attempt, (*keep, *spares)))
        intents.append(RelaunchStep(record.job_id, record.attempt, keep, recovery.resume_from))
        launched = replace(
            to_state(ready, JobState.RELAUNCHING, ctx.now_s), nodes=keep, spare_nodes=spares
        )
        for _ in swapped:
            launched = launched.with_swap(cause)
        swaps = "".join(f"spare {spare} replaces {out}; " for out, spare in swapped)
        return decision(
            launched,
            tuple(intents),
            cause,
            f"{swaps}relaunch on {len(keep)} node(s) {_resuming(recovery.resume_from)}",
        )
    why = ""
    if grown is not None:
        why = f"idle nodes allow {grown} node(s) instead of {size}: "
    return _requeue(ready, ctx, world, spares, grown, why)


def _requeue(
    record: JobRecord,
    ctx: Context,
    world: tuple[str, ...],
    spares: tuple[str, ...],
    size: int | None,
    why: str,
) -> Decision:
    """Requeue at ``size`` nodes (None: as many usable nodes as the cluster has, up to
    the original size), avoiding what this job blamed and what the cluster avoids.

    ``world`` and ``spares``: the allocation's own healthy nodes, usable
    whatever Slurm shows them as (the job holds them).
    """
    recovery = record.recovery
    assert recovery is not None
    cause = recovery.cause
    blamed = {*recovery.exclude, *record.blamed_nodes}
    avoided = ctx.cluster.avoided_by(record.slurm_user)
    exclude = {*blamed, *avoided, *ctx.cluster.down, *ctx.cluster.drained}
    usable = (ctx.cluster.usable - exclude) | set(world) | set(spares)
    if size is None:
        size = world_size(len(usable), record)
        if size is None:
            reason = (
                f"only {len(usable)} usable node(s); the job needs at least {record.min_nodes} "
                f"in multiples of {record.unit}"
            )
            return stop(record, ctx.now_s, JobState.FAILED, Cause.BELOW_MIN_NODES, reason)
    blocked = tuple(sorted({*blamed, *avoided}))
    # Spares only as far as nodes free now allow: a spare never holds the restart in the queue.
    free_now = (ctx.cluster.idle - exclude) | set(world) | set(spares)
    asked = with_spares(record, size, len(free_now))
    requeue = RequeueSmaller(record.job_id, record.attempt, asked, blocked, recovery.resume_from)
    queued = replace(to_state(record, JobState.REQUEUED, ctx.now_s), nodes=(), spare_nodes=())
    # This fault's cause names its nodes; with earlier ones among them, the job alone.
    when = f"in this job ({cause.value})" if blamed == set(recovery.exclude) else "in this job"
    job_nodes = record.nodes or recovery.slurm_requeued
    excluded = exclusions(blamed, when, job_nodes, ctx.cluster, record.slurm_user)
    return decision(
        queued,
        (requeue,),
        cause,
        f"{why}requeue with {size} node(s) {excluded} {_resuming(recovery.resume_from)}",
    )


def resize_requeued(record: JobRecord, ctx: Context) -> Decision:
    """Slurm requeued the job itself and a checkpoint is chosen: resize the pending job
    when its allocation's nodes are out, else leave Slurm's request as it is.

    Slurm's own requeue (its batch host lost, a preemption, a requeue from
    inside the job) keeps the job's request: the size of its last allocation,
    nothing excluded. A node of that allocation that is down or drained then
    holds the job in the queue until the node comes back, for a dead node all
    night; one this job blamed (a drain the hourly share refused) takes it
    again. So the pending job is resized as a requeue of ours would ask
    (:class:`RequeueSmaller` finds it pending and only updates it).
    """
    recovery = record.recovery
    assert recovery is not None and recovery.validated
    allocation = set(recovery.slurm_requeued)
    out = allocation & {
        *recovery.exclude,
        *record.blamed_nodes,
        *ctx.cluster.avoided_by(record.slurm_user),
        *ctx.cluster.down,
        *ctx.cluster.drained,
    }
    if not out:
        return decision(
            record, (), recovery.cause, f"the requeued job resumes from {recovery.resume_from}"
        )
    why = f"Slurm's requeue would wait for {', '.join(sorted(out))}: "
    return _requeue(record, ctx, (), (), None, why)


def grow(record: JobRecord, ctx: Context, checkpoint: str, step: int) -> Decision | None:
    """Requeue a RUNNING job at a larger size from the checkpoint just committed, when
    idle nodes allow one; None when they do not (the job runs on as it is).

    A planned restart, no fault (:attr:`Cause.GROW`): no budget spent, no
    backoff, nothing blamed or drained, the budget's baseline
    (``step_at_last_restart``) kept, so the grow is invisible to the next
    fault's accounting. The ranks are stopped and the job requeued in one
    decision, straight to REQUEUED: the checkpoint was committed moments ago
    by ranks that were running well, so it is the resume point without a
    validation pass (validating would hold the stopped job for a full read of
    the checkpoint, and a later choice could fall on an older one and lose
    work). The size only grows strictly (never past the original), and the
    requeued job comes back at it, so growing cannot loop.

    Nodes this job blamed stay out: a drain the hourly share refused leaves a
    blamed node in service, and idle once the job left it.

    The same path replenishes hot spares: a job at its full size whose last
    spare was used is requeued with as many as idle nodes allow. Not sooner:
    each refill is a restart (the in-flight save replayed, a relaunch), and
    while a spare is left the next fault costs no shrink.
    """
    if not record.nodes:
        return None
    avoided = ctx.cluster.avoided_by(record.slurm_user)
    exclude = {*record.blamed_nodes, *avoided, *ctx.cluster.down, *ctx.cluster.drained}
    kept = tuple(n for n in record.nodes if n not in exclude)
    spares = tuple(n for n in record.spare_nodes if n not in exclude)
    idle = ctx.cluster.idle - exclude - set(kept) - set(spares)
    available = len(kept) + len(spares) + len(idle)
    size = world_size(available, record)
    if size is None or size < len(record.nodes):
        return None
    asked = with_spares(record, size, available)
    before = len(record.nodes) + len(spares)  # a spare Slurm took out is none
    if asked <= before or (size == len(record.nodes) and spares):
        return None  # spares are refilled only once the last is used: each refill is a restart
    attempt = record.attempt + 1
    blocked = tuple(sorted({*record.blamed_nodes, *avoided}))
    grown = replace(
        to_state(record, JobState.REQUEUED, ctx.now_s).with_restart(Cause.GROW),
        attempt=attempt,
        nodes=(),
        spare_nodes=(),
        not_before_s=None,
        recovery=Recovery(
            cause=Cause.GROW,
            started_s=ctx.now_s,
            exclude=blocked,
            requeue=True,
            validated=True,
            resume_from=checkpoint,
            resume_step=step,
        ),
    )
    intents = (
        StopRanks(record.job_id, attempt, ctx.policy.stop_grace_s),
        RequeueSmaller(record.job_id, attempt, asked, blocked, checkpoint),
    )
    if size > len(record.nodes):
        larger = f"{size} node(s) instead of {len(record.nodes)}"
    else:
        larger = f"{asked - size} spare(s) instead of {len(record.spare_nodes)}"
    excluded = exclusions(
        set(record.blamed_nodes), "in this job", record.nodes, ctx.cluster, record.slurm_user
    )
    return decision(
        grown,
        intents,
        Cause.GROW,
        f"idle nodes allow {larger}: requeue {excluded} from {checkpoint}",
    )


def exclusions(
    blamed_nodes: AbstractSet[str],
    blamed_when: str,
    job_nodes: tuple[str, ...],
    cluster: ClusterView,
    user: str = "",
) -> str:
    """Which nodes a requeue excludes and why, each by name, for the decision's explanation.

    The exclusion list is ``blamed_nodes`` (``blamed_when`` says when this job
    blamed them), the cluster's lemons and the nodes ``user``'s jobs ticketed.
    The job's nodes that Slurm took out (drained by Slurm or an admin, or down)
    are named as left out: Slurm places nothing there, so they need no exclusion.
    """
    lemon_blames = dict(cluster.lemon_blames)
    window_s = cluster.lemon_window_s
    window = f"{window_s / 86400:g} d" if window_s >= 86400 else f"{window_s / 3600:g} h"
    avoided = cluster.avoided_by(user)
    reasons = []
    for node in sorted({*blamed_nodes, *avoided}):
        why = [f"blamed {blamed_when}"] if node in blamed_nodes else []
        if node in cluster.lemons:
            count = lemon_blames.get(node)
            why.append(f"lemon: {count} blames in {window}" if count else "lemon")
        elif node in avoided:
            why.append("drain ticket open")
        reasons.append(f"{node} ({', '.join(why)})")
    left_out = [
        f"{node} ({'down' if node in cluster.down else 'drained by Slurm/admin'})"
        for node in job_nodes
        if node not in blamed_nodes
        and node not in avoided
        and (node in cluster.down or node in cluster.drained)
    ]
    text = "excluding " + (", ".join(reasons) if reasons else "no node")
    return text + (f"; left out: {', '.join(left_out)}" if left_out else "")


def _resuming(resume_from: str | None) -> str:
    """Where the relaunch resumes, in words."""
    if resume_from is not None:
        return f"from {resume_from}"
    return "with no Resurgo checkpoint to resume from (a script that keeps its own resumes from it)"
