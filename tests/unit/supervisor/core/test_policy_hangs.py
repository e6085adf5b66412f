"""The decision core on hangs and stragglers reported by the agents' watchers.

A hang blames the rank furthest behind across nodes once its evidence window closes;
a straggler is alerted once per node and drained only when the policy says so.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core.intents import Alert, DrainNode, StopRanks, ValidateCheckpoints
from supervisor.core.model import Cause, JobState
from supervisor.core.observations import Tick
from tests.unit.policy_world import NOW, POLICY, hang, kinds, run, running, straggler


def test_hang_blames_the_rank_behind_across_nodes_after_the_evidence_window():
    policy = replace(POLICY, hang_evidence_window_s=30.0)
    first, second, early = run(
        running(),
        hang("node1", 0, 500, True, 100.0),
        hang("node4", 3, 499, True, 120.0),
        Tick(),
        policy=policy,
    )
    assert first.record.state is JobState.RECOVERING and first.intents == ()
    assert early.intents == ()  # the window is still open at NOW
    (late,) = run(second.record, Tick(), policy=policy, now=NOW + 31)
    assert kinds(late) == [DrainNode, StopRanks, ValidateCheckpoints]
    drain = late.intents[0]
    assert isinstance(drain, DrainNode) and drain.node == "node4" and drain.cause is Cause.HANG


def test_hang_without_a_standout_rank_restarts_without_drain():
    (decision,) = run(running(), hang("node1", 0, 500, True, 100.0))
    assert decision.record.state is JobState.RECOVERING
    assert kinds(decision) == [StopRanks, ValidateCheckpoints]


def test_straggler_is_reported_and_never_drained_by_default():
    decisions = run(running(), *[straggler()] * 5, straggler("node3"))
    # One alert per node: a straggler that lasts is counted, not alerted again.
    assert [kinds(d) for d in decisions] == [[Alert], [], [], [], [], [Alert]]
    assert all(d.cause is Cause.STRAGGLER for d in decisions)
    assert "reported (5x), not drained: 2x median" in decisions[4].explanation
    assert decisions[-1].record.straggler_reports == (("node2", 5), ("node3", 1))
    assert decisions[-1].record.state is JobState.RUNNING


def test_persistent_straggler_is_drained_when_configured():
    policy = replace(POLICY, straggler_drain=True, straggler_reports_to_drain=3)
    decisions = run(running(), *[straggler()] * 3, policy=policy)
    assert decisions[1].record.state is JobState.RUNNING
    assert kinds(decisions[2])[:2] == [Alert, DrainNode]
    drain = decisions[2].intents[1]
    assert isinstance(drain, DrainNode) and drain.node == "node2"
    assert drain.cause is Cause.STRAGGLER and "2x median" in drain.reason


def test_the_hang_window_closes_once_every_node_has_reported():
    policy = replace(POLICY, hang_evidence_window_s=30.0)
    record = running()
    *waiting, last = run(
        record,
        *(
            hang(node, rank, 500 if node != "node3" else 499, True, 100.0)
            for rank, node in enumerate(record.nodes)
        ),
        policy=policy,
    )
    assert all(decision.intents == () for decision in waiting)
    # The last node's report closes the window at NOW, not 30 s later.
    assert kinds(last) == [DrainNode, StopRanks, ValidateCheckpoints]
    drain = last.intents[0]
    assert isinstance(drain, DrainNode) and drain.node == "node3"
