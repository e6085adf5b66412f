"""The decision core on hangs and stragglers reported by the agents' watchers.

A hang blames the rank furthest behind across nodes once its evidence window closes
(at once when every node was heard, a stall report counting for its node); a
straggler is alerted once per node and drained only when the policy says so.
"""

from __future__ import annotations

from dataclasses import replace

from supervisor.core.intents import Alert, DrainNode, StopRanks, ValidateCheckpoints
from supervisor.core.model import Cause, JobState, record_from_json, record_to_json
from supervisor.core.observations import Culprit, HangReported, Tick
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


def stall(node: str, rank: int, step: int, since: float) -> HangReported:
    """A node's stall report: its rank stopped outside any collective, nobody waits here."""
    culprit = Culprit(rank, step, False, since, "stopped outside any collective")
    return HangReported(node, f"42/{node}/abcdef01/9", NOW, culprits=(culprit,), stalled=True)


WINDOW = replace(POLICY, hang_evidence_window_s=30.0)


def test_a_stall_report_alone_starts_nothing_and_is_kept():
    (kept,) = run(running(), stall("node3", 2, 500, 40.0), policy=WINDOW)
    assert kept.record.state is JobState.RUNNING and kept.intents == ()
    assert [(s.node, s.global_rank, s.in_collective) for s in kept.record.stalls] == [
        ("node3", 2, False)
    ]
    # Read back from the store as it was written.
    assert record_from_json(record_to_json(kept.record)) == kept.record


def test_a_kept_stall_joins_the_window_and_the_stalled_node_is_blamed_at_once():
    # node3's rank sleeps outside any collective; the others wait for it in DDP's backward.
    *_, last = run(
        running(),
        stall("node3", 2, 500, 40.0),
        hang("node1", 0, 500, True, 40.0),
        hang("node2", 1, 500, True, 40.0),
        hang("node4", 3, 500, True, 40.0),
        policy=WINDOW,
    )
    # The window closes at NOW with every node heard, not 30 s later.
    assert kinds(last) == [DrainNode, StopRanks, ValidateCheckpoints]
    drain = last.intents[0]
    assert isinstance(drain, DrainNode) and drain.node == "node3"
    assert "outside the collective the others wait in" in drain.reason
    assert last.record.stalls == ()


def test_a_stall_reported_during_the_window_closes_it():
    *waiting, last = run(
        running(),
        hang("node1", 0, 500, True, 40.0),
        hang("node2", 1, 500, True, 40.0),
        hang("node4", 3, 500, True, 40.0),
        stall("node3", 2, 500, 40.0),
        policy=WINDOW,
    )
    assert all(decision.intents == () for decision in waiting)
    drain = last.intents[0]
    assert isinstance(drain, DrainNode) and drain.node == "node3"


def test_a_stall_of_another_step_is_no_evidence_for_a_later_hang():
    # A stall at step 200 (training went on after it) does not join a hang at step 500.
    stale, opened = run(
        running(), stall("node3", 2, 200, 400.0), hang("node1", 0, 500, True, 40.0), policy=WINDOW
    )
    assert stale.record.stalls != ()
    assert opened.record.recovery is not None
    assert {s.node for s in opened.record.recovery.suspects} == {"node1"}
    assert opened.intents == ()  # the window stays open for the other nodes
