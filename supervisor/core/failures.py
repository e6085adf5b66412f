"""A failed rank's class decides the recovery: the glue between the rule table and the core.

:mod:`supervisor.core.failure_rules` says what a rank's evidence is; this
module gives each collected exit its class (:func:`classified`) and, once the
exit window closed and the root cause is chosen, turns the root cause's class
into the recovery (:func:`by_class`):

- ``stop`` (``user_error``): the job ends FAILED at once, no node blamed,
  when the script failed this way before its first step on every node of the
  attempt (one node alone failing so is that node's environment, not the
  script, and is decided as before);
- ``retry`` (``oom``): relaunched with no node blamed while the class's
  failures stay within the rule's budget, then stopped FAILED with the
  kernel's or the framework's words;
- ``blame_node`` (``hardware``): the root cause's node is blamed with the
  rule's confidence (drained or ticketed as the policy and corroboration say);
- ``wait_storage`` (``storage``): no node blamed; the checkpoints are
  validated, and the job relaunched, only once the checkpoint root takes a
  checkpoint again. The executor looks before it validates; each look that
  finds the root still unusable
  (:class:`~supervisor.core.observations.StorageUnavailable`) schedules the
  next one with a doubling backoff (:data:`STORAGE_BACKOFF_S` up to
  :data:`STORAGE_BACKOFF_MAX_S`), and once ``storage_wait_s`` has passed the
  job stops as FAILED with what was last seen. Jobs whose roots share a file
  system are one storage incident: the first to find it unusable raises one
  critical alert, the others join it silently (``ClusterView.storage_waits``);
- ``default``: decided as by how the rank ended, the class named.

Every recovery counts its root cause's class on the record (``failures``).
Pure.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core import recovery
from supervisor.core.blame import Blame
from supervisor.core.decision import Context, Decision
from supervisor.core.failure_rules import Action, Classified, Evidence, FailureClass, classify
from supervisor.core.intents import Alert, Severity, ValidateCheckpoints
from supervisor.core.model import Cause, ExitSeen, JobRecord, JobState
from supervisor.core.observations import RankExited, StorageUnavailable

# The storage wait's looks: the first right away, then after 5, 10, 20, 40, 60, 60 ... s.
STORAGE_BACKOFF_S = 5.0
STORAGE_BACKOFF_MAX_S = 60.0
# A storage incident's log line names at most this many of its other jobs.
MAX_NAMED_JOBS = 5

# The states of a launch that has not made a training step yet.
BEFORE_FIRST_STEP = frozenset({JobState.STARTING, JobState.RELAUNCHING, JobState.REQUEUED})


def evidence_of(event: RankExited, at_start: bool) -> Evidence:
    """What the rank's ``rank_exited`` says about its failure."""
    return Evidence(
        exit_code=event.exit_code,
        signal=event.signal,
        raised=event.raised,
        message=event.message,
        errno=event.errno,
        stderr_tail=event.stderr_tail,
        oom_kill=event.oom_kill,
        xid=event.xid,
        at_start=at_start,
    )


def before_first_step(record: JobRecord) -> bool:
    """The launch has not made a training step: it is starting, or its exit window
    opened while it was."""
    pending = record.recovery
    return record.state in BEFORE_FIRST_STEP or (
        record.state is JobState.RECOVERING and pending is not None and pending.before_first_step
    )


def classified(seen: ExitSeen, event: RankExited, record: JobRecord, ctx: Context) -> ExitSeen:
    """``seen`` with its class, rule and quoted evidence line (no rule: class ``unknown``)."""
    found = classify(evidence_of(event, before_first_step(record)), ctx.rules)
    return replace(seen, failure=found.failure_class.value, rule=found.rule, quote=found.evidence)


def class_of(seen: ExitSeen, ctx: Context) -> Classified:
    """The classification ``seen`` carries, with its rule's action and budget."""
    failure = FailureClass(seen.failure) if seen.failure else FailureClass.UNKNOWN
    rule = next((r for r in ctx.rules if r.name == seen.rule), None)
    if rule is None:
        return Classified(failure, Action.DEFAULT)
    return Classified(failure, rule.action, rule.name, seen.quote, rule.budget,
                      rule.confidence, rule.operator)  # fmt: skip


def by_class(
    record: JobRecord, root: ExitSeen, exits: tuple[ExitSeen, ...], ctx: Context
) -> tuple[JobRecord, Decision | None]:
    """The record with the root cause's class counted, and the decision its class makes
    (None: decide as by how the rank ended)."""
    root = unechoed(root, exits)
    found = class_of(root, ctx)
    record = record.with_failure(found.failure_class.value)
    rank = f"rank {root.global_rank} on {root.node}"
    words = found.words()
    match found.action:
        case Action.STOP:
            every = {seen.node for seen in exits if seen.rule == root.rule}
            if every < set(record.nodes):
                return record, None  # one node's environment, not the script
            reason = (
                f"{words} on every node ({rank} first), before the first step: no retry can "
                "help; fix the script and submit again"
            )
            return record, recovery.stop(record, ctx.now_s, JobState.FAILED, Cause.USER_ERROR,
                                         reason)  # fmt: skip
        case Action.RETRY:
            count = record.failures_of(found.failure_class.value)
            if count > found.budget:
                reason = (
                    f"{words}: {rank}; {count} such failures, the rule allows "
                    f"{found.budget} retr{'y' if found.budget == 1 else 'ies'}: the script needs "
                    "more memory than its nodes give it (a smaller batch, more nodes, or a "
                    "larger allocation)"
                )
                return record, recovery.stop(record, ctx.now_s, JobState.FAILED,
                                             _cause(found), reason)  # fmt: skip
            verdict = Blame(None, _cause(found), 0.0, (
                f"{rank}: {words}; retry {count} of {found.budget}, no node blamed",))  # fmt: skip
            return record, recovery.start(record, ctx, verdict)
        case Action.BLAME_NODE:
            verdict = Blame(root.node, Cause.HARDWARE, found.confidence, (f"{rank}: {words}",))
            return record, recovery.start(record, ctx, verdict)
        case Action.WAIT_STORAGE:
            verdict = Blame(None, Cause.STORAGE, 0.0, (
                f"{rank}: {words}; waiting up to {ctx.policy.storage_wait_s:g} s for the "
                "checkpoint root to take a checkpoint again",))  # fmt: skip
            return record, _waiting_for_storage(recovery.start(record, ctx, verdict), ctx)
        case Action.DEFAULT:
            return record, None


def _waiting_for_storage(started: Decision, ctx: Context) -> Decision:
    """The recovery's validation looks at the storage first, and the wait's clock starts."""
    pending = started.record.recovery
    if pending is None or started.record.state is not JobState.RECOVERING:
        return started  # stopped (the restart budget): nothing to wait for
    until = ctx.now_s + ctx.policy.storage_wait_s
    waiting = replace(pending, storage_until_s=until, storage_probes=1)
    record = replace(started.record, recovery=waiting)
    intents = tuple(
        replace(intent, storage_probe=1) if isinstance(intent, ValidateCheckpoints) else intent
        for intent in started.intents
    )
    return replace(started, record=record, intents=intents)


def on_storage_unavailable(record: JobRecord, seen: StorageUnavailable, ctx: Context) -> Decision:
    """A look found the checkpoint root still unusable: look again later, or give up."""
    pending = record.recovery
    if (
        seen.attempt != record.attempt
        or record.state is not JobState.RECOVERING
        or pending is None
        or pending.storage_until_s is None
    ):
        return Decision(record, (), None, f"storage report of attempt {seen.attempt} is stale")
    if ctx.now_s >= pending.storage_until_s:
        reason = (
            f"the checkpoint root did not take a checkpoint again within "
            f"{ctx.policy.storage_wait_s:g} s: {seen.detail}; free space on it (or fix the "
            "mount) and submit again"
        )
        return recovery.stop(record, ctx.now_s, JobState.FAILED, Cause.STORAGE, reason)
    alerts, incident = _incident(record, seen, ctx) if pending.storage_fs is None else ((), "")
    delay = min(STORAGE_BACKOFF_MAX_S, STORAGE_BACKOFF_S * 2 ** max(pending.storage_probes - 1, 0))
    waiting = replace(pending, storage_next_s=ctx.now_s + delay,
                      storage_fs=pending.storage_fs or seen.filesystem)  # fmt: skip
    left = pending.storage_until_s - ctx.now_s
    return Decision(replace(record, recovery=waiting), alerts, Cause.STORAGE,
                    f"storage not usable yet ({seen.detail}){incident}; looking again in "
                    f"{delay:g} s, {left:.0f} s of the wait left")  # fmt: skip


def storage_wait_of(record: JobRecord) -> str | None:
    """The file system ``record`` waits for in a storage incident (None: it waits for none)."""
    pending = record.recovery
    if record.state is not JobState.RECOVERING or pending is None:
        return None
    return pending.storage_fs or None


def _incident(
    record: JobRecord, seen: StorageUnavailable, ctx: Context
) -> tuple[tuple[Alert, ...], str]:
    """The first look that found the root unusable: the job opens a storage incident on
    its file system (one critical alert), or joins the one other jobs already wait in
    (no alert: a full shared file system pages once, not once per job)."""
    where = seen.filesystem or "the checkpoint root's file system"
    waits = ctx.cluster.storage_waits if seen.filesystem else ()
    others = sorted({job for fs, job in waits if fs == seen.filesystem and job != record.job_id})
    if others:
        named = ", ".join(others[:MAX_NAMED_JOBS]) + (
            ", ..." if len(others) > MAX_NAMED_JOBS else ""
        )
        return (), (f"; joins the storage incident on {where}: {len(others)} other "
                    f"job{'s' if len(others) > 1 else ''} wait on it ({named})")  # fmt: skip
    message = (
        f"storage incident on {where}: {seen.detail}. Job {record.job_id} waits up to "
        f"{ctx.policy.storage_wait_s:g} s for it, no node blamed; other jobs that fail on "
        f"{where} join this incident without an alert of their own"
    )
    alert = Alert(record.job_id, record.attempt, Severity.CRITICAL, message)
    return (alert,), f"; opens a storage incident on {where}"


def storage_look_due(record: JobRecord, ctx: Context) -> Decision | None:
    """On a tick: the next look at the storage, once it is due (None: none is)."""
    pending = record.recovery
    if (
        record.state is not JobState.RECOVERING
        or pending is None
        or pending.storage_next_s is None
        or ctx.now_s < pending.storage_next_s
    ):
        return None
    probes = pending.storage_probes + 1
    record = replace(record, recovery=replace(pending, storage_probes=probes, storage_next_s=None))
    look = ValidateCheckpoints(record.job_id, record.attempt, ctx.policy.validation_level, (),
                               pending.resume_before, storage_probe=probes)  # fmt: skip
    return Decision(record, (look,), Cause.STORAGE, f"looking at the storage again ({probes})")


def unechoed(root: ExitSeen, exits: tuple[ExitSeen, ...]) -> ExitSeen:
    """``root``, unless all it says is that it lost a peer: then the earliest exit of a
    class of its own.

    A closed connection (``network``) is what the peers of a failed rank say,
    and they can say it before that rank is seen dead: a rank that prints its
    fault and exits closes its gloo connections while Python shuts down, a
    second or more before its exit, and its peers' exceptions come first
    (:func:`supervisor.core.blame.root_cause` counts a raise when it was).
    An exit with a class of its own (neither ``network`` nor ``unknown``) is
    the failure they echo.
    """
    if root.failure != FailureClass.NETWORK.value:
        return root
    echoed = (FailureClass.NETWORK.value, FailureClass.UNKNOWN.value, None)
    own = [seen for seen in exits if seen.failure not in echoed]
    return min(own, key=lambda seen: seen.died_at_s, default=root)


def _cause(found: Classified) -> Cause:
    return Cause.OOM if found.failure_class is FailureClass.OOM else Cause.USER_EXCEPTION


def annotated(verdict: Blame, root: ExitSeen, ctx: Context) -> Blame:
    """A verdict decided as before, its evidence naming the root cause's class when a rule
    gave one (``network``, ``storage``, or an operator's ``default`` rule)."""
    found = class_of(root, ctx)
    if found.rule is None:
        return verdict
    first, *rest = verdict.evidence or ("",)
    return replace(verdict, evidence=(f"{first}; {found.words()}", *rest))
