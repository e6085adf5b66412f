"""What an agent's lease says about its node: lost, excused, or not yet judged.

A lease is an agent's newest sign of life on a node. The daemon keeps them;
this module decides on them, with ``now`` passed in:

- :func:`leases_count`: after a start, leases count only once a lease plus
  the longest an agent waits between two tries
  (:data:`agent.wire.protocol.RETRY_MAX_S`) passed: while no supervisor was up
  the agents could not renew theirs, and that time is no evidence that a node
  is lost.
- :func:`expire`: each expired lease is dropped (its agent is not a live one
  of a tracked job), a lost node (:class:`LeaseExpired`), or part of a silence
  many agents share (:class:`SilenceShared`, :mod:`supervisor.core.silence`):
  then the quiet agents' leases count again from ``now`` (an agent still
  silent while its peers are back expires again one lease later, alone, as a
  node fault) and the job's next Slurm sighting is news again.
- :func:`judge_nodes`: Slurm's NOT_RESPONDING alone is a missed ping while the
  node's agent still holds its lease (a loaded slurmd answers late); a node
  really gone is marked DOWN by Slurm, or its agent's lease lapses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from agent.wire.protocol import RETRY_MAX_S
from supervisor.core import silence
from supervisor.core.decision import Policy
from supervisor.core.observations import LeaseExpired, SilenceShared, SlurmNodeSeen
from supervisor.store.rows import LeaseRow


def leases_count(now: float, started_s: float, lease_s: float) -> bool:
    """Whether leases may expire yet, ``started_s`` after this supervisor started."""
    return now - started_s > lease_s + RETRY_MAX_S


@dataclass(frozen=True)
class Expiry:
    """What one expired lease comes to.

    ``drop``: the lease to forget (None for a shared silence); ``renew``: the
    quiet agents' leases to count again from now; ``observation``: for the
    decision task (None: only dropped); ``reason``: the silence verdict's words.
    """

    lease: LeaseRow
    drop: bool
    renew: tuple[LeaseRow, ...] = ()
    observation: LeaseExpired | SilenceShared | None = None
    reason: str = ""


def expire(
    expired: Sequence[LeaseRow],
    live: Mapping[str, Sequence[LeaseRow]],
    now: float,
    lease_s: float,
    policy: Policy,
) -> list[Expiry]:
    """The verdict on each expired lease, in order.

    ``live``: per unfinished tracked job, the leases of its current agents that
    did not stop cleanly. A job's silence found shared is decided once; its
    other expired leases in ``expired`` are skipped.
    """
    silent_s = {
        (lease.job_id, lease.node): now - lease.last_seen_s
        for leases in live.values()
        for lease in leases
    }
    quiet = silence.quiet_by_job(silent_s, silence.quiet_after_s(lease_s))
    all_quiet = sum(len(nodes) for nodes in quiet.values())
    shared: set[str] = set()
    verdicts: list[Expiry] = []
    for lease in expired:
        if lease.job_id in shared:
            continue
        if lease.job_id not in live:
            verdicts.append(Expiry(lease, drop=True))
            continue
        agents = frozenset(row.node for row in live[lease.job_id])
        if lease.node not in agents:
            verdicts.append(Expiry(lease, drop=True))
            continue
        job_quiet = quiet.get(lease.job_id, frozenset())
        verdict = silence.common_cause(
            agents,
            job_quiet,
            len(silent_s),
            all_quiet,
            policy.silence_share,
            policy.silence_min_agents,
        )
        if verdict.common:
            shared.add(lease.job_id)
            renew = tuple(row for row in live[lease.job_id] if row.node in job_quiet)
            seen = SilenceShared(tuple(sorted(job_quiet)), verdict.reason)
            verdicts.append(Expiry(lease, False, renew, seen, verdict.reason))
            continue
        verdicts.append(Expiry(lease, True, (), LeaseExpired(lease.node), verdict.reason))
    return verdicts


@dataclass(frozen=True)
class NodeVerdicts:
    """:func:`judge_nodes`' result: the sightings to decide on, and what to remember.

    ``flagged``: nodes reported bad (reported once until they are fine again);
    ``excused``: NOT_RESPONDING nodes whose agent still calls in;
    ``newly_excused``: those excused at this poll (logged once).
    """

    report: tuple[SlurmNodeSeen, ...]
    flagged: frozenset[str]
    excused: frozenset[str]
    newly_excused: tuple[str, ...]


def judge_nodes(
    names: Sequence[str],
    seen: Mapping[str, SlurmNodeSeen],
    calling_in: Set[str],
    flagged: Set[str],
    excused: Set[str],
) -> NodeVerdicts:
    """Which of a job's nodes (``names``) Slurm's view (``seen``) reports as lost.

    ``calling_in``: nodes whose agent holds a lease (held until the daemon
    expires it: its one definition of an agent gone silent).
    """
    report: list[SlurmNodeSeen] = []
    flagged_now, excused_now = set(flagged), set(excused)
    newly: list[str] = []
    for name in names:
        node = seen.get(name)
        bad = node is not None and (node.down or node.not_responding)
        if node is not None and node.not_responding and not node.down and name in calling_in:
            if name not in excused_now:
                excused_now.add(name)
                newly.append(name)
            continue
        excused_now.discard(name)
        if bad and name not in flagged_now:
            flagged_now.add(name)
            assert node is not None
            report.append(node)
        elif not bad:
            flagged_now.discard(name)
    return NodeVerdicts(tuple(report), frozenset(flagged_now), frozenset(excused_now), tuple(newly))
