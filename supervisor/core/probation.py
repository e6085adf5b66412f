"""Probation and the lemon list: when a drained node may come back, and when never; pure.

A node drained once for a transient cause (a hang, a killed rank, a lost
agent) is often fine after a reboot or a cleanup: it returns to service after
``probation_s`` once its health check passes. A node blamed ``lemon_blames``
times within ``lemon_window_s``, across jobs, is a repeat offender: it stays
drained, and every relaunch avoids it (``ClusterView.lemons``). DESIGN §3
step 4; the store keeps the blame history and calls these on its schedule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from supervisor.core.intents import ResumeNode
from supervisor.core.policy import Policy
from supervisor.slurm.parse import SlurmNode
from supervisor.store.rows import CheckResult, Lemon, NodeCheckRow, TicketRow


@dataclass(frozen=True)
class NodeHistory:
    """What the store knows about one node's blames (all jobs) and its current drain.

    ``blames_s`` are the times Resurgo blamed the node and ``blame_users`` whose
    jobs blamed it, in the same order (empty: not known, each blame counts as
    another user's); ``drained_at_s`` is when
    Resurgo drained it (None: not drained by Resurgo, never ours to resume);
    ``drain_job_id``/``drain_attempt`` name the drain's job and attempt;
    ``failed_check_s`` is when the node last failed the supervisor's own check.
    """

    node: str
    blames_s: tuple[float, ...]
    drained_at_s: float | None = None
    drain_job_id: str = ""
    drain_attempt: int = 0
    blame_users: tuple[str, ...] = ()
    failed_check_s: float | None = None


def is_lemon(history: NodeHistory, now_s: float, policy: Policy) -> bool:
    """True when the node was blamed ``lemon_blames`` times within the window, by jobs
    of at least ``lemon_users`` users, or of fewer when it failed the supervisor's own
    check within the window (the check is no user's word)."""
    recent = [i for i, t in enumerate(history.blames_s) if now_s - t <= policy.lemon_window_s]
    if len(recent) < policy.lemon_blames:
        return False
    checked = history.failed_check_s
    if checked is not None and now_s - checked <= policy.lemon_window_s:
        return True
    if len(history.blame_users) != len(history.blames_s):
        return len(recent) >= policy.lemon_users  # users unknown: each blame another's
    return len({history.blame_users[i] for i in recent}) >= policy.lemon_users


def lemons(histories: tuple[NodeHistory, ...], now_s: float, policy: Policy) -> frozenset[str]:
    """The lemon list for a :class:`~supervisor.core.model.ClusterView`."""
    return frozenset(h.node for h in histories if is_lemon(h, now_s, policy))


def release(
    history: NodeHistory, health_check_passed: bool, now_s: float, policy: Policy
) -> ResumeNode | None:
    """A ResumeNode when a node on probation may return to service, else None."""
    if history.drained_at_s is None or not health_check_passed:
        return None
    if is_lemon(history, now_s, policy) or now_s - history.drained_at_s < policy.probation_s:
        return None
    return ResumeNode(history.drain_job_id, history.drain_attempt, history.node)


def lifted_outside(
    open_drains: Iterable[tuple[str, float]], seen: Mapping[str, SlurmNode], read_s: float
) -> tuple[str, ...]:
    """The nodes whose open Resurgo drain someone lifted outside Resurgo, sorted.

    ``open_drains`` are (node, drained_s) of Resurgo's open drains; ``seen``
    is an ``sinfo`` read that started at ``read_s``. A node counts when Slurm
    lists it and it is not drained: someone resumed it (an admin's
    ``scontrol update nodename=X state=resume``). A drain recorded after the
    read started may not show in it yet (Resurgo records a drain once
    ``scontrol`` returned), so it is left for the next read. A node drained
    again under someone else's reason is theirs now, but was not lifted: its
    verdict stands. A node Slurm does not list is unknown, not lifted.
    """
    lifted = set()
    for node, drained_s in open_drains:
        slurm_node = seen.get(node)
        if drained_s < read_s and slurm_node is not None and not slurm_node.drained:
            lifted.add(node)
    return tuple(sorted(lifted))


def ticketed(
    open_tickets: Iterable[TicketRow | NodeCheckRow],
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(node, the users whose jobs raised its open tickets or checks) pairs, sorted by node;
    the users are empty when one's job is of unknown user (then it is everyone's)."""
    users: dict[str, set[str] | None] = {}
    for ticket in open_tickets:
        known = users.setdefault(ticket.node, set())
        if ticket.slurm_user is None or known is None:
            users[ticket.node] = None
        else:
            known.add(ticket.slurm_user)
    return tuple((node, tuple(sorted(users[node] or ()))) for node in sorted(users))


def held_by_checks(
    checks: Iterable[NodeCheckRow], now_s: float, policy: Policy
) -> list[NodeCheckRow]:
    """The supervisor's node checks that keep their node out of jobs now: an open or
    expired one (no verdict) out of its blaming user's, for ``probation_s`` after it was
    raised, as a drain ticket; a failed one out of everyone's (``slurm_user`` None), for
    ``probation_s`` after it ended, whether or not a drain could follow it."""
    held = []
    for check in checks:
        if check.result is CheckResult.FAILED and check.ended_s is not None:
            if now_s - check.ended_s < policy.probation_s:
                held.append(replace(check, slurm_user=None))
        elif check.result is not CheckResult.PASSED and now_s - check.raised_s < policy.probation_s:
            held.append(check)
    return held


def avoid_list(
    lemon_rows: Iterable[Lemon],
    open_tickets: Iterable[TicketRow],
    policy: Policy,
    checks: Iterable[NodeCheckRow] = (),
) -> list[dict[str, Any]]:
    """The nodes a user's next jobs leave out (``resurgo submit`` adds them to ``--exclude``).

    Lemons, until their blames age out of ``lemon_window_s``, for everyone;
    and, for a supervisor that may not drain, each node with an open drain
    ticket, for ``probation_s`` after it was raised (as long as a drained node
    would stay out before its health check), for the users whose jobs raised
    its tickets only (``users``): one user's word keeps a node out of their own
    next jobs, never out of everyone's. A ticket of a job whose user is not
    known keeps it out for everyone. The supervisor's node checks
    (:func:`held_by_checks`) count as tickets, a failed one for everyone.
    Sorted by node; each entry says why.
    """
    entries: dict[str, dict[str, Any]] = {}
    tickets = list(open_tickets)
    held = list(checks)
    for ticket in tickets:
        entries[ticket.node] = {
            "node": ticket.node,
            "why": f"drain ticket {ticket.ticket_id}: {ticket.cause} in job {ticket.job_id}",
            "until_s": ticket.raised_s + policy.probation_s,
        }
    for check in held:
        if check.node in entries:
            continue
        if check.result is CheckResult.FAILED:
            why = f"failed the supervisor's check: {check.detail}"
            until = (check.ended_s or check.raised_s) + policy.probation_s
        else:
            why = f"the supervisor checks it: {check.cause} in job {check.job_id}"
            until = check.raised_s + policy.probation_s
        entries[check.node] = {"node": check.node, "why": why[:300], "until_s": until}
    for node, users in ticketed([*tickets, *held]):
        if users:
            entries[node]["users"] = list(users)
    for lemon in lemon_rows:
        entries[lemon.node] = {
            "node": lemon.node,
            "why": f"lemon: blamed {lemon.drains} times within {policy.lemon_window_s / 86400:g} d",
            "until_s": lemon.last_drained_s + policy.lemon_window_s,
        }
    return [entries[node] for node in sorted(entries)]
