"""Whether a blamed node is drained, ticketed, checked first or only kept out of its job. Pure.

:func:`exclude_and_drain` is the drain step of every recovery
(:mod:`supervisor.core.recovery`): the blamed node always leaves the job, and
what else happens to it passes, in order, the user flag, the storm brake, the
hourly drain share, the user's share of it, and corroboration.

Corroboration. Everything a job reports comes from processes its owner
controls: a script can SIGKILL its own rank, and a buggy one can hang its own
collective. Under ``policy.corroborate_drains`` such a blame excludes the node
from the job that blamed it (the job is relaunched or requeued without it) and
raises a check (:class:`~supervisor.core.intents.CheckNode`): a Slurm job of
the supervisor's own user on the node, once the blaming job has left it, that
runs the built-in node checks and the operator's command
(:mod:`agent.node.nodecheck`, run by :mod:`supervisor.act.node_checks`). The
node is drained only when

- that check fails (the check's output is the drain's evidence:
  :func:`after_check`), or
- jobs of another user blamed the node too (within the lemon window), or
- the evidence is the machine's own: Slurm reports the node not responding.

A node whose check passes stays in service. A check that cannot start in time,
or whose job is cancelled or forgotten, has no verdict: nothing is drained,
and the blaming user's jobs keep leaving the node out for ``probation_s``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace

from supervisor.core.blame import Blame
from supervisor.core.decision import Context, Policy
from supervisor.core.intents import (
    Alert,
    CheckNode,
    DrainNode,
    DrainTicket,
    Intent,
    Severity,
)
from supervisor.core.model import Cause, ClusterView, JobRecord
from supervisor.store.rows import CheckResult, NodeCheckRow
from supervisor.text import fragment

# The blame's share of a drain reason after a failed check; the check's words follow.
BLAME_CHARS = 100


def drain_limit(policy: Policy, cluster_size: int) -> int:
    """Drains allowed per hour on a cluster of ``cluster_size`` nodes: the share of
    the nodes (rounded down), but never fewer than ``min_drains_per_hour``."""
    # The share rounds down (10% of 15 nodes is 1 drain, not 2: the limit is a
    # promise); the floor keeps a small cluster's policy able to act at all.
    share = math.floor(policy.max_drain_share_per_hour * cluster_size + 1e-9)
    return max(share, policy.min_drains_per_hour)


def drains_allowed(policy: Policy, cluster: ClusterView) -> int:
    """How many more drains the hourly share allows now (never negative)."""
    return max(0, drain_limit(policy, cluster.size) - cluster.drains_last_hour)


def drain_storm(
    policy: Policy, cluster: ClusterView, job_id: str, node: str
) -> tuple[frozenset[str], frozenset[str], bool] | None:
    """Whether ``job_id`` blaming ``node`` is part of a storm: (the nodes, the jobs,
    whether this blame begins it), or None.

    A storm is blames of at least ``storm_nodes`` distinct nodes from at least
    ``storm_jobs`` jobs within ``storm_window_s`` (``cluster.recent_blames``
    holds the window's blames before this one). It begins with the blame that
    makes the counts reach the bar, so a burst raises one alert.
    """
    if not storm_holds(policy, ((node, job_id), *cluster.recent_blames)):
        return None
    nodes = frozenset(blamed for blamed, _ in cluster.recent_blames) | {node}
    jobs = frozenset(job for _, job in cluster.recent_blames) | {job_id}
    return nodes, jobs, not storm_holds(policy, cluster.recent_blames)


def _held_back(
    policy: Policy, cluster: ClusterView, record: JobRecord, node: str
) -> tuple[str, str | None] | None:
    """Why a blame of ``node`` drains and tickets nothing, and the alert to raise when
    this blame is the one that starts it; None when nothing holds it back."""
    flagged = user_flagged(policy, cluster, record.slurm_user, node)
    if flagged is not None:
        blamed, begins = flagged
        user = record.slurm_user
        what = (
            f"jobs of {user} blamed {len(blamed)} nodes within {policy.lemon_window_s / 86400:g} d"
        )
        message = (
            f"user flagged: {what} ({', '.join(sorted(blamed))}), at least "
            f"{user_flag_limit(policy, cluster.size)} on {cluster.size} nodes. That many "
            f"faulty nodes under one user's jobs points at the jobs (a bug in the "
            f"script, or reports made up), not at the nodes: their blames drain and "
            f"ticket nothing now, and each job goes on without the node it blamed. "
            f"Look at {user}'s jobs; `resurgo nodes` lists the blames (the policy's "
            f"user_flag_share {policy.user_flag_share:g}, user_flag_min_nodes "
            f"{policy.user_flag_min_nodes})."
        )
        return f"{what} (flagged)", message if begins else None
    storm = drain_storm(policy, cluster, record.job_id, node)
    if storm is not None:
        nodes, jobs, begins = storm
        what = f"{len(nodes)} nodes blamed by {len(jobs)} jobs within {policy.storm_window_s:g} s"
        message = (
            f"drain storm: {what} ({', '.join(sorted(nodes))}; jobs "
            f"{', '.join(sorted(jobs))}). A shared cause (storage, the network, the "
            f"scheduler) is likelier than that many bad nodes: Resurgo drains no node "
            f"while blames keep coming this fast, and each job goes on without the node "
            f"it blamed. Look for the shared cause; `resurgo nodes` lists the blames. "
            f"The brake is the policy's storm_nodes {policy.storm_nodes} / storm_jobs "
            f"{policy.storm_jobs} / storm_window_s {policy.storm_window_s:g}."
        )
        return f"the storm brake holds ({what})", message if begins else None
    return None


def user_drain_limit(policy: Policy, cluster_size: int) -> int:
    """Drains and drain tickets one user's jobs may take an hour: their share of the
    hourly drain limit (rounded down), at least one."""
    share = math.floor(policy.max_user_drain_share * drain_limit(policy, cluster_size) + 1e-9)
    return max(share, 1)


def user_over_share(policy: Policy, cluster: ClusterView, user: str) -> int | None:
    """How many nodes ``user``'s jobs had drained or ticketed within the hour when that
    uses their share of the drains up; None while it does not (or the user is unknown)."""
    if not user:
        return None
    used = dict(cluster.user_acts).get(user, 0)
    return used if used >= user_drain_limit(policy, cluster.size) else None


def user_flag_limit(policy: Policy, cluster_size: int) -> int:
    """Distinct nodes one user's jobs may blame within the lemon window before the user
    is flagged: the share of the cluster (rounded down), at least the minimum."""
    share = math.floor(policy.user_flag_share * cluster_size + 1e-9)
    return max(share, policy.user_flag_min_nodes)


def user_flagged(
    policy: Policy, cluster: ClusterView, user: str, node: str
) -> tuple[frozenset[str], bool] | None:
    """Whether ``user``'s blame of ``node`` comes from a flagged user: (the nodes their
    jobs blamed, whether this blame flags them), or None. A user is flagged while
    their jobs' blames within the lemon window (``cluster.user_blames``) name at
    least :func:`user_flag_limit` distinct nodes; ``user_flag_min_nodes`` 0: never."""
    if not user or policy.user_flag_min_nodes == 0:
        return None
    before = frozenset(blamed for who, blamed in cluster.user_blames if who == user)
    limit = user_flag_limit(policy, cluster.size)
    if len(before | {node}) < limit:
        return None
    return before | {node}, len(before) < limit


def storm_holds(policy: Policy, blames: Iterable[tuple[str, str]]) -> bool:
    """Whether (node, job) ``blames`` of one storm window meet the storm brake's bar."""
    pairs = tuple(blames)
    nodes = {node for node, _ in pairs}
    jobs = {job for _, job in pairs}
    return (
        policy.storm_nodes > 0
        and len(nodes) >= policy.storm_nodes
        and len(jobs) >= policy.storm_jobs
    )


def exclude_and_drain(
    record: JobRecord, blame: Blame, ctx: Context, slurm_took_it: bool
) -> tuple[JobRecord, tuple[Intent, ...], str]:
    """Exclude and (rate limit permitting) drain the blamed node; what was done, in words.

    A supervisor without Slurm operator rights (``ctx.cluster.may_drain`` False)
    raises a drain ticket for the admins instead: the node is kept out of the
    job all the same.
    """
    node = blame.node
    if node is None:
        if blame.cause is Cause.TIME_LIMIT:
            return record, (), "a planned stop for the time limit: no node is at fault"
        said = "; ".join(blame.evidence) if blame.evidence else "the evidence names none"
        return record, (), f"no node blamed: {said}"
    if blame.confidence < ctx.policy.drain_confidence:
        return (
            record,
            (),
            (
                f"no node blamed with enough confidence ({blame.confidence:.2f}, "
                f"drain_confidence {ctx.policy.drain_confidence:g})"
            ),
        )
    recovery = record.recovery
    assert recovery is not None  # a drain belongs to a recovery
    excluded = replace(
        record,
        recovery=replace(recovery, exclude=tuple(sorted({*recovery.exclude, node}))),
        blamed_nodes=tuple(sorted({*record.blamed_nodes, node})),
    )
    evidence = "; ".join(blame.evidence)
    if slurm_took_it or node in ctx.cluster.drained or node in ctx.cluster.down:
        return excluded, (), f"{node} excluded; Slurm already took it out of service"
    held = _held_back(ctx.policy, ctx.cluster, record, node)
    if held is not None:
        why, message = held
        alerts: tuple[Intent, ...] = ()
        if message is not None:
            alerts = (Alert(record.job_id, record.attempt, Severity.CRITICAL, message),)
        return excluded, alerts, f"{node} excluded, not drained: {why}: {evidence}"
    if ctx.cluster.may_drain and drains_allowed(ctx.policy, ctx.cluster) < 1:
        limit = drain_limit(ctx.policy, ctx.cluster.size)
        message = (
            f"job {record.job_id}: {node} was not drained ({blame.cause.value}: {evidence}): "
            f"{ctx.cluster.drains_last_hour} drain(s) in the last hour (done or decided) use the "
            f"{limit} the policy allows on {ctx.cluster.size} nodes (max_drain_share_per_hour "
            f"{ctx.policy.max_drain_share_per_hour:g}, at least min_drains_per_hour "
            f"{ctx.policy.min_drains_per_hour}). The job goes on without {node}; a person should "
            f"look at it. To let Resurgo drain more, raise either setting."
        )
        alert = Alert(record.job_id, record.attempt, Severity.CRITICAL, message)
        return excluded, (alert,), f"{node} excluded, not drained: hourly drain share reached"
    used = user_over_share(ctx.policy, ctx.cluster, record.slurm_user)
    if used is not None:
        verb = "drained" if ctx.cluster.may_drain else "ticketed"
        limit = drain_limit(ctx.policy, ctx.cluster.size)
        message = (
            f"job {record.job_id}: {node} was not {verb} ({blame.cause.value}: {evidence}): "
            f"jobs of {record.slurm_user} had {used} node(s) drained or ticketed in the last "
            f"hour, the most one user's jobs may take (max_user_drain_share "
            f"{ctx.policy.max_user_drain_share:g} of the {limit} "
            f"drain(s) an hour on {ctx.cluster.size} nodes). The job goes on without {node}; "
            f"one user's jobs cannot take the whole share."
        )
        alert = Alert(record.job_id, record.attempt, Severity.WARNING, message)
        why = f"{record.slurm_user}'s share of the drains is used"
        return excluded, (alert,), f"{node} excluded, not {verb}: {why}"
    at_once = drain_at_once(ctx.policy, ctx.cluster, blame, record.slurm_user)
    if at_once is None or not ctx.cluster.may_drain:
        # One job's word: the supervisor checks the node first. No rights: the admins drain.
        ask = CheckNode if at_once is None else DrainTicket
        done = (
            "drained only if the supervisor's own check of it fails (one job's word)"
            if at_once is None
            else "a drain ticket raised (no Slurm operator rights to drain)"
        )
        intent = ask(
            record.job_id, record.attempt, node, blame.cause, evidence[:500], record.slurm_user
        )
        return excluded, (intent,), f"{node} excluded; {done}: {blame.confidence:.2f}: {evidence}"
    drain = DrainNode(
        record.job_id, record.attempt, node, blame.cause, evidence[:200], record.slurm_user
    )
    return excluded, (drain,), f"drain {node} ({blame.confidence:.2f}: {evidence})"


def drain_at_once(policy: Policy, cluster: ClusterView, blame: Blame, user: str) -> str | None:
    """Why ``blame`` (of a job of ``user``) may drain its node without the supervisor's
    check, in words; None when it needs the check."""
    if not policy.corroborate_drains:
        return "corroborate_drains is off"
    if blame.hardware:
        return "the evidence is Slurm's own"
    others = sorted(
        {who for who, node in cluster.user_blames if node == blame.node and who and who != user}
    )
    if others:
        return f"jobs of {', '.join(others)} blamed it too"
    return None


def after_check(
    check: NodeCheckRow, result: CheckResult, detail: str, policy: Policy, cluster: ClusterView
) -> tuple[Intent, ...]:
    """What a check's end calls for: a drain when it failed (a drain ticket for a supervisor
    without operator rights; a critical alert when the hourly share is used up), else
    nothing (a pass returns nothing to do: the node never left service)."""
    if result is not CheckResult.FAILED:
        return ()
    cause = Cause(check.cause)
    user = check.slurm_user or ""
    # The blame (its class, rule and quoted line) leads: it says why the node was
    # checked at all. A ticket has room for all of it; a drain reason keeps 160
    # characters, so there the blame gets its first BLAME_CHARS.
    failed = f"failed the supervisor's check: {detail}"
    if not cluster.may_drain:
        evidence = f"{check.evidence}; {failed}"[:500]
        return (DrainTicket(check.job_id, check.attempt, check.node, cause, evidence, user),)
    if drains_allowed(policy, cluster) < 1:
        message = (
            f"{check.node} failed the supervisor's check ({detail}) but was not drained: "
            f"{cluster.drains_last_hour} drain(s) in the last hour use the "
            f"{drain_limit(policy, cluster.size)} the policy allows on {cluster.size} nodes. "
            f"No job is given it meanwhile (it is on every user's avoid list for "
            f"probation_s); drain it by hand or raise max_drain_share_per_hour."
        )
        return (Alert(check.job_id, check.attempt, Severity.CRITICAL, message),)
    evidence = f"{fragment(check.evidence, BLAME_CHARS)}; {failed}"[:200]
    return (DrainNode(check.job_id, check.attempt, check.node, cause, evidence, user),)
