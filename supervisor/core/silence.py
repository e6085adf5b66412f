"""Whether agents that stopped calling in went silent for one common cause.

When a lease expires the daemon asks :func:`common_cause` before it blames
a node. An agent that went silent while its peers go on reporting points at
its node; every agent of a job, or a large share of all agents, going quiet
together points elsewhere: the supervisor itself was away or held up, the
network between the nodes and the head node failed, or the job ended. None
of those is a node fault, and draining for them would empty the cluster. The
supervisor then reads Slurm instead, whose own view (the job ended, a node
DOWN) decides. Pure: no clock, no OS.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# Agents heartbeat many times per lease: one still quiet for half a lease when
# a peer's lease expires stopped at about the same time as that peer.
QUIET_SHARE_OF_LEASE = 0.5


@dataclass(frozen=True)
class SilenceVerdict:
    """``common``: the job's silent agents share a cause; ``reason`` says why (or why not)."""

    common: bool
    reason: str


def quiet_after_s(lease_s: float) -> float:
    """Silence (seconds since the last renewal) that counts as gone quiet with the others."""
    return lease_s * QUIET_SHARE_OF_LEASE


def common_cause(
    job_agents: frozenset[str],
    job_quiet: frozenset[str],
    all_agents: int,
    all_quiet: int,
    share: float,
    min_agents: int,
) -> SilenceVerdict:
    """Whether the quiet agents of one job (``job_quiet`` of ``job_agents``) share a cause.

    ``all_agents`` / ``all_quiet`` count every unfinished job's agents (leases)
    and how many of them are quiet. The silence is common when every agent of
    the job is quiet (two at least: one agent alone is no pattern), or when
    at least ``share`` of all agents are and there are at least ``min_agents``
    of them.
    """
    if len(job_agents) >= 2 and job_agents <= job_quiet:
        return SilenceVerdict(
            True, f"every agent of the job ({len(job_agents)}) went silent at once"
        )
    if all_agents >= min_agents and all_agents and all_quiet / all_agents >= share:
        return SilenceVerdict(
            True,
            f"{all_quiet} of {all_agents} agents went silent at once "
            f"(at least {share:.0%} is a common cause)",
        )
    talking = len(job_agents - job_quiet)
    return SilenceVerdict(False, f"{talking} other agent(s) of the job still report")


def quiet_by_job(
    silent_s: Mapping[tuple[str, str], float], quiet_s: float
) -> dict[str, frozenset[str]]:
    """The quiet nodes of each job, from each (job, node) lease's seconds of silence."""
    quiet: dict[str, set[str]] = {}
    for (job_id, node), seconds in silent_s.items():
        if seconds > quiet_s:
            quiet.setdefault(job_id, set()).add(node)
    return {job_id: frozenset(nodes) for job_id, nodes in quiet.items()}
