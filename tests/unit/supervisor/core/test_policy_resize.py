"""The decision core on job size: back to the original size when free nodes exist.

Idle nodes turn a shrink into a requeue at the largest size they allow (in multiples
of the unit), and a job running below its original size grows back after a checkpoint
commit without spending restart budget.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.core.intents import RelaunchStep, RequeueSmaller, ShrinkAllocation, StopRanks
from supervisor.core.model import Cause, ClusterView, JobRecord, JobState
from supervisor.core.observations import CheckpointValidated, SlurmJobSeen, StepProgress
from supervisor.core.policy import Decision
from tests.unit.policy_world import (
    CKPT,
    CLUSTER,
    KILL,
    POLICY,
    commit,
    rank_exit,
    run,
    running,
)


def _sigkill_then_valid(record: JobRecord, cluster: ClusterView) -> Decision:
    _crash, chosen = run(
        record,
        rank_exit("node3", sig=KILL),
        CheckpointValidated(100, CKPT, True),
        cluster=cluster,
    )
    return chosen


@pytest.mark.parametrize(
    "cluster",
    [
        CLUSTER,
        replace(CLUSTER, idle=frozenset({"node9"}), lemons=frozenset({"node9"})),
        replace(CLUSTER, idle=frozenset({"node9"}), drained=frozenset({"node9"})),
        replace(CLUSTER, idle=frozenset({"node9"}), down=frozenset({"node9"})),
    ],
    ids=["none idle", "idle lemon", "idle drained", "idle down"],
)
def test_relaunch_keeps_the_fast_path_when_no_usable_node_is_idle(cluster):
    chosen = _sigkill_then_valid(running(), cluster)
    assert chosen.record.state is JobState.RELAUNCHING
    assert chosen.intents == (
        ShrinkAllocation("42", 2, ("node1", "node2", "node4")),
        RelaunchStep("42", 2, ("node1", "node2", "node4"), CKPT),
    )


def test_relaunch_requeues_at_the_original_size_when_idle_nodes_exist():
    cluster = replace(CLUSTER, idle=frozenset({"node9", "node10"}))
    chosen = _sigkill_then_valid(running(), cluster)
    assert chosen.record.state is JobState.REQUEUED and chosen.record.nodes == ()
    assert chosen.intents == (RequeueSmaller("42", 2, 4, ("node3",), CKPT),)
    assert chosen.explanation.startswith("idle nodes allow 4 node(s) instead of 3")


@pytest.mark.parametrize(("idle", "expected"), [(1, 6), (2, 6), (3, 8), (5, 10), (9, 10)])
def test_relaunch_requeues_at_the_largest_size_idle_nodes_allow_in_multiples_of_the_unit(
    idle, expected
):
    nodes = tuple(f"node{i}" for i in range(1, 7))
    record = running(nodes=nodes, original_nodes=10, unit=2)
    cluster = replace(CLUSTER, idle=frozenset(f"node{i}" for i in range(11, 11 + idle)))
    chosen = _sigkill_then_valid(record, cluster)  # five healthy nodes: the fast path runs 4
    assert chosen.intents == (RequeueSmaller("42", 2, expected, ("node3",), CKPT),)


def test_relaunch_keeps_the_fast_path_when_idle_nodes_do_not_make_a_larger_multiple():
    nodes = tuple(f"node{i}" for i in range(1, 7))
    record = running(nodes=nodes, original_nodes=8, unit=4)
    cluster = replace(CLUSTER, idle=frozenset({"node11"}))
    chosen = _sigkill_then_valid(record, cluster)  # 5 healthy + 1 idle: still 4
    assert chosen.intents[-1] == RelaunchStep("42", 2, ("node1", "node2", "node4", "node5"), CKPT)


SHRUNK = ("node1", "node2", "node4")


def shrunk(**changes: object) -> JobRecord:
    """Running on three of its four nodes since node3 was blamed, one restart without progress."""
    defaults: dict[str, object] = {
        "nodes": SHRUNK,
        "attempt": 2,
        "blamed_nodes": ("node3",),
        "step_at_last_restart": 100,
        "restarts_without_progress": 1,
    }
    return running(**{**defaults, **changes})


def test_a_commit_below_the_original_size_grows_back_onto_idle_nodes_spending_no_budget():
    cluster = replace(CLUSTER, idle=frozenset({"node3", "node9"}))
    (grown,) = run(shrunk(), commit(200), cluster=cluster)
    assert grown.cause is Cause.GROW
    assert grown.intents == (
        StopRanks("42", 3, POLICY.stop_grace_s),
        RequeueSmaller("42", 3, 4, ("node3",), "/c/200"),
    )
    record = grown.record
    assert record.state is JobState.REQUEUED and record.nodes == () and record.attempt == 3
    assert record.restarts_for(Cause.GROW) == 1 and record.not_before_s is None
    assert (record.restarts_without_progress, record.step_at_last_restart) == (1, 100)
    assert (record.last_step, record.last_checkpoint_path) == (200, "/c/200")
    assert record.recovery is not None and record.recovery.validated
    assert (record.recovery.resume_from, record.recovery.resume_step) == ("/c/200", 200)


def test_a_grown_job_is_our_requeue_not_slurms_and_comes_back_at_the_new_size_for_good():
    cluster = replace(CLUSTER, idle=frozenset({"node9"}))
    big = ("node1", "node2", "node4", "node9")
    grown, stale, queued, again, started, committed = run(
        shrunk(slurm_restart_count=1),
        commit(200),
        StepProgress(201),  # the old ranks train on until the stop reaches them
        SlurmJobSeen("PENDING", (), 2),
        SlurmJobSeen("PENDING", (), 2),
        SlurmJobSeen("RUNNING", big, 2),
        commit(300),
        cluster=cluster,
    )
    assert stale.record == grown.record and stale.intents == ()
    assert queued.record.state is JobState.REQUEUED and queued.intents == ()
    assert queued.cause is None and queued.record.restarts_for(Cause.SLURM_REQUEUE) == 0
    assert queued.record.attempt == grown.record.attempt
    assert again.record == queued.record
    assert started.record.state is JobState.STARTING and started.record.nodes == big
    assert committed.record.state is JobState.RUNNING and committed.intents == ()
    assert committed.record.restarts_for(Cause.GROW) == 1


@pytest.mark.parametrize(
    ("record", "policy", "idle"),
    [
        (running(), POLICY, {"node9"}),
        (shrunk(), replace(POLICY, grow_back=False), {"node9"}),
        (shrunk(), POLICY, set()),
        (shrunk(), POLICY, {"node3"}),
        (shrunk(unit=2, nodes=("node1", "node2")), POLICY, {"node9"}),
        (shrunk(state=JobState.RECOVERING), POLICY, {"node9"}),
    ],
    ids=[
        "at original size",
        "grow_back off",
        "nothing idle",
        "only the blamed node idle",
        "no larger multiple of the unit",
        "recovering",
    ],
)
def test_a_checkpoint_commit_does_not_grow_when_no_larger_size_is_allowed(record, policy, idle):
    cluster = replace(CLUSTER, idle=frozenset(idle), lemons=frozenset({"node8"}))
    (seen,) = run(record, commit(200), policy=policy, cluster=cluster)
    assert seen.intents == () and seen.cause is None
    assert seen.record == replace(record, last_step=200, last_checkpoint_path="/c/200")


def test_idle_lemons_down_and_drained_nodes_are_no_room_to_grow():
    cluster = replace(
        CLUSTER,
        idle=frozenset({"node7", "node8", "node9"}),
        lemons=frozenset({"node7"}),
        down=frozenset({"node8"}),
        drained=frozenset({"node9"}),
    )
    (seen,) = run(shrunk(), commit(200), cluster=cluster)
    assert seen.intents == () and seen.record.state is JobState.RUNNING
