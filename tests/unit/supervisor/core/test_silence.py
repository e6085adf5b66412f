"""Silence of many agents at once is one common cause, not many node faults."""

from __future__ import annotations

import pytest

from supervisor.core.observations import LeaseExpired, SilenceShared
from supervisor.core.policy import decide
from supervisor.core.silence import common_cause, quiet_after_s, quiet_by_job
from tests.unit.policy_world import CLUSTER, NOW, POLICY, running

FOUR = frozenset({"node1", "node2", "node3", "node4"})
SHARE = 0.5
MIN_AGENTS = 4


@pytest.mark.parametrize(
    ("job_agents", "job_quiet", "all_agents", "all_quiet", "common"),
    [
        # every agent of a 4-node job quiet: the supervisor, the network or the job
        (FOUR, FOUR, 4, 4, True),
        # both agents of a 2-node job quiet among 10 agents that report: still common
        (frozenset({"node1", "node2"}), frozenset({"node1", "node2"}), 10, 2, True),
        # one agent quiet while its three peers report: that node's fault
        (FOUR, frozenset({"node2"}), 4, 1, False),
        # half of all agents (8, over two jobs) quiet: common even for this job's one
        (FOUR, frozenset({"node1"}), 8, 4, True),
        # below the share: a node fault
        (FOUR, frozenset({"node1"}), 8, 3, False),
        # a one-node job's agent alone is no pattern
        (frozenset({"node1"}), frozenset({"node1"}), 1, 1, False),
        # two agents of which one is quiet: under the least count for the share
        (frozenset({"node1", "node2"}), frozenset({"node1"}), 2, 1, False),
    ],
)
def test_silence_is_common_only_when_all_of_a_job_or_a_large_share_goes_quiet(
    job_agents: frozenset[str],
    job_quiet: frozenset[str],
    all_agents: int,
    all_quiet: int,
    common: bool,
) -> None:
    verdict = common_cause(job_agents, job_quiet, all_agents, all_quiet, SHARE, MIN_AGENTS)
    assert verdict.common is common
    assert verdict.reason


def test_an_agent_quiet_for_half_a_lease_went_silent_with_the_others() -> None:
    silent = {("7", "node1"): 31.0, ("7", "node2"): 29.0, ("8", "node1"): 45.0}
    assert quiet_by_job(silent, quiet_after_s(60.0)) == {
        "7": frozenset({"node1"}),
        "8": frozenset({"node1"}),
    }


def test_a_shared_silence_drains_nothing_where_a_lone_lease_expiry_recovers() -> None:
    record = running()
    shared = decide(record, SilenceShared(("node1", "node2"), "all silent"), NOW, POLICY, CLUSTER)
    assert shared.record == record and shared.intents == () and "asking Slurm" in shared.explanation
    lone = decide(record, LeaseExpired("node2"), NOW, POLICY, CLUSTER)
    assert lone.intents and lone.record.state is not record.state
