"""The decision core on what Slurm reports about the job: its states and requeues.

Preemption and time limits spend no budget, Slurm's own requeues are adopted (also
when missed between sightings or during our recovery), stale ended states are
ignored, end states end the job, and a submitted job starts then runs.
"""

from __future__ import annotations

import pytest

from supervisor.core.intents import DrainNode, RequeueSmaller, StopRanks
from supervisor.core.model import Cause, ClusterView, JobState, new_record
from supervisor.core.observations import (
    CheckpointValidated,
    LeaseExpired,
    SlurmJobSeen,
    SlurmNodeSeen,
    StepProgress,
)
from tests.unit.policy_world import CKPT, FOUR, NODES, NOW, kinds, run, running


@pytest.mark.parametrize(
    ("slurm_state", "cause"), [("PREEMPTED", Cause.PREEMPTED), ("TIMEOUT", Cause.TIME_LIMIT)]
)
def test_preemption_spends_no_budget(slurm_state, cause):
    record = running(restarts_without_progress=3, step_at_last_restart=100)
    seen, chosen = run(
        record, SlurmJobSeen(slurm_state, NODES, 0), CheckpointValidated(100, CKPT, True)
    )
    assert seen.cause is cause and DrainNode not in kinds(seen)
    assert seen.record.restarts_without_progress == 3
    (requeue,) = chosen.intents
    assert isinstance(requeue, RequeueSmaller) and requeue.n_nodes == 4 and requeue.exclude == ()


def test_slurm_requeue_is_adopted_not_fought():
    seen, chosen, back = run(
        running(),
        SlurmJobSeen("PENDING", (), 1, "NodeFail"),
        CheckpointValidated(100, CKPT, True),
        SlurmJobSeen("RUNNING", ("node1", "node2", "node4"), 1),
    )
    assert seen.record.state is JobState.REQUEUED and seen.cause is Cause.SLURM_REQUEUE
    assert not any(isinstance(i, RequeueSmaller | StopRanks) for i in seen.intents)
    assert chosen.intents == () and chosen.record.recovery is not None
    assert chosen.record.recovery.resume_from == CKPT
    assert back.record.state is JobState.STARTING and back.record.nodes == (
        "node1",
        "node2",
        "node4",
    )


def test_a_slurm_requeue_missed_between_sightings_is_adopted_then_followed():
    # The supervisor was down while Slurm requeued the job and started it again.
    moved = ("node4", "node6", "node7", "node8")
    adopted, chosen, started = run(
        running(),
        SlurmJobSeen("RUNNING", moved, 1),
        CheckpointValidated(100, CKPT, True),
        SlurmJobSeen("RUNNING", moved, 1),  # the next poll: the same sighting
    )
    assert adopted.record.state is JobState.REQUEUED and adopted.cause is Cause.SLURM_REQUEUE
    assert not any(isinstance(i, RequeueSmaller | StopRanks) for i in adopted.intents)
    assert chosen.record.recovery is not None and chosen.record.recovery.resume_from == CKPT
    assert started.record.state is JobState.STARTING and started.record.nodes == moved


@pytest.mark.parametrize(
    ("slurm_state", "expected"),
    [
        ("COMPLETED", JobState.COMPLETED),
        ("CANCELLED", JobState.CANCELLED),
        ("FAILED", JobState.FAILED),
    ],
)
def test_slurm_end_states_end_the_job(slurm_state, expected):
    (seen,) = run(running(), SlurmJobSeen(slurm_state, (), 0))
    assert seen.record.state is expected


def test_submitted_job_starts_then_runs():
    record = new_record("42", 4, NOW)
    started, ran = run(record, SlurmJobSeen("RUNNING", NODES, 0), StepProgress(1))
    assert started.record.state is JobState.STARTING and ran.record.state is JobState.RUNNING


def test_slurm_requeue_during_our_recovery_is_adopted_without_spending_budget_twice():
    crash, adopted, chosen = run(
        running(),
        LeaseExpired("node2"),
        SlurmJobSeen("PENDING", (), 1, "NodeFail"),
        CheckpointValidated(100, CKPT, True),
    )
    assert adopted.record.state is JobState.REQUEUED and adopted.intents == ()
    assert adopted.record.restarts_without_progress == crash.record.restarts_without_progress
    assert adopted.record.attempt == crash.record.attempt
    assert chosen.record.recovery.resume_from == CKPT
    # Slurm's requeue kept node2 in the request; the pending job is resized without it.
    (requeue,) = chosen.intents
    assert isinstance(requeue, RequeueSmaller) and requeue.exclude == ("node2",)
    assert requeue.n_nodes == 4 and requeue.resume_from == CKPT
    assert chosen.record.state is JobState.REQUEUED


LEFT = frozenset(NODES) - {"node1"}


@pytest.mark.parametrize(
    "lost",
    [
        ClusterView(usable=LEFT, down=frozenset({"node1"})),
        ClusterView(usable=LEFT, drained=frozenset({"node1"})),
    ],
    ids=["down", "drained"],
)
def test_a_slurm_requeue_after_its_batch_host_died_is_resized_to_the_nodes_left(lost):
    # Slurm requeued the job itself (its batch host is down) before any lease of it
    # lapsed: its request still names four nodes, and only three are left.
    adopted, chosen, back = run(
        running(),
        SlurmJobSeen("PENDING", (), 1, "NodeFail"),
        CheckpointValidated(100, CKPT, True),
        SlurmJobSeen("RUNNING", ("node2", "node3", "node4"), 1),
        cluster=lost,
    )
    assert adopted.record.recovery is not None
    assert adopted.record.recovery.slurm_requeued == NODES
    (requeue,) = chosen.intents
    assert isinstance(requeue, RequeueSmaller)
    # Slurm places nothing on a down or drained node: no exclusion needed, the size is.
    assert (requeue.n_nodes, requeue.exclude, requeue.resume_from) == (3, (), CKPT)
    assert chosen.record.state is JobState.REQUEUED
    assert "would wait for node1" in chosen.explanation, chosen.explanation
    assert back.record.state is JobState.STARTING and len(back.record.nodes) == 3


def test_a_slurm_requeue_below_the_minimum_size_fails_the_job_saying_why():
    lost = ClusterView(usable=frozenset({"node2"}), down=frozenset({"node1", "node3", "node4"}))
    _, chosen = run(
        running(),
        SlurmJobSeen("PENDING", (), 1, "NodeFail"),
        CheckpointValidated(100, CKPT, True),
        cluster=lost,
    )
    assert chosen.record.state is JobState.FAILED and chosen.cause is Cause.BELOW_MIN_NODES
    assert "only 1 usable node(s)" in chosen.record.final_reason


def test_a_slurm_requeue_whose_nodes_are_all_in_service_keeps_slurms_request():
    # A preemption: the job's nodes are busy with another job, not out of service.
    _, chosen = run(
        running(),
        SlurmJobSeen("PENDING", (), 1, "Preempted"),
        CheckpointValidated(100, CKPT, True),
        cluster=FOUR,
    )
    assert chosen.intents == () and chosen.record.state is JobState.REQUEUED
    assert chosen.explanation == f"the requeued job resumes from {CKPT}"


def test_an_ended_state_seen_before_our_requeue_took_effect_is_stale_but_not_after():
    record = run(
        running(), SlurmNodeSeen("node1", down=True), CheckpointValidated(100, CKPT, True)
    )[-1].record
    assert record.state is JobState.REQUEUED
    stale, queued, cancelled = run(
        record,
        SlurmJobSeen("NODE_FAIL", ("node1",), 0),
        SlurmJobSeen("PENDING", (), 1),
        SlurmJobSeen("CANCELLED", (), 1),
    )
    assert stale.record.state is JobState.REQUEUED and stale.intents == ()
    assert queued.record.state is JobState.REQUEUED
    assert cancelled.record.state is JobState.CANCELLED


def test_a_requeue_that_slurm_ends_before_the_job_ran_again_is_made_again_then_given_up():
    record = run(
        running(), SlurmNodeSeen("node1", down=True), CheckpointValidated(100, CKPT, True)
    )[-1].record
    first = record.attempt
    queued, lost, queued_again, lost_again, queued_last, given_up = run(
        record,
        SlurmJobSeen("PENDING", (), 1),
        SlurmJobSeen("FAILED", (), 1, "NonZeroExitCode"),
        SlurmJobSeen("PENDING", (), 2),
        SlurmJobSeen("FAILED", (), 2, "NonZeroExitCode"),
        SlurmJobSeen("PENDING", (), 3),
        SlurmJobSeen("FAILED", (), 3, "NonZeroExitCode"),
    )
    assert queued.record.state is JobState.REQUEUED
    # Nothing ran since the requeue: the earlier run's end overrode it; made again.
    assert lost.record.state is JobState.REQUEUED
    (requeue,) = lost.intents
    assert isinstance(requeue, RequeueSmaller) and requeue.attempt == first + 1
    assert requeue.resume_from == CKPT and "node1" in requeue.exclude
    assert "requeue again" in lost.explanation
    assert queued_again.record.state is JobState.REQUEUED and queued_again.intents == ()
    assert kinds(lost_again) == [RequeueSmaller]
    assert lost_again.intents[0].attempt == first + 2
    assert queued_last.record.state is JobState.REQUEUED
    assert given_up.record.state is JobState.FAILED and given_up.intents == ()
    assert "after each of 3 requeues" in given_up.record.final_reason
    assert f"resumes from {CKPT}" in given_up.record.final_reason


def test_a_requeue_lost_between_two_sightings_is_made_again_not_taken_for_the_end():
    """Under load the sightings may miss the requeued job's COMPLETING and PENDING: the
    first one after our requeue is the earlier run's FAILED, with the restart count our
    own requeue raised. Nothing ran since: the requeue is made again."""
    record = run(
        running(), SlurmNodeSeen("node1", down=True), CheckpointValidated(100, CKPT, True)
    )[-1].record
    (lost,) = run(record, SlurmJobSeen("FAILED", (), 1, "NonZeroExitCode"))
    assert lost.record.state is JobState.REQUEUED, lost.explanation
    (requeue,) = lost.intents
    assert isinstance(requeue, RequeueSmaller) and requeue.attempt == record.attempt + 1
    assert "requeue again" in lost.explanation


def test_a_failed_end_after_the_requeued_job_ran_again_ends_the_job():
    record = run(
        running(), SlurmNodeSeen("node1", down=True), CheckpointValidated(100, CKPT, True)
    )[-1].record
    *_, failed = run(
        record,
        SlurmJobSeen("PENDING", (), 1),
        SlurmJobSeen("RUNNING", tuple(NODES[1:]), 1),
        SlurmJobSeen("FAILED", (), 1, "NonZeroExitCode"),
    )
    assert failed.record.state is JobState.FAILED and failed.intents == ()


def test_a_cancel_slurm_gives_no_reason_for_is_told_without_slurms_none():
    (cancelled,) = run(running(), SlurmJobSeen("CANCELLED", (), 0, "None"))
    assert cancelled.record.final_reason == "cancelled in Slurm", cancelled.record.final_reason
    (told,) = run(running(), SlurmJobSeen("CANCELLED", (), 0, "Preempted by admin"))
    assert told.record.final_reason == "cancelled in Slurm (Preempted by admin)"


def test_a_time_limit_requeue_says_no_node_is_at_fault_not_that_confidence_was_low():
    (seen,) = run(running(), SlurmJobSeen("TIMEOUT", NODES, 0))
    assert "a planned stop for the time limit: no node is at fault" in seen.explanation
    assert "confidence" not in seen.explanation


def test_a_requeue_first_seen_completing_then_pending_is_adopted():
    """Slurm 22.05 after `scontrol requeue` from inside the job (Lightning's auto-requeue,
    the driver's own): COMPLETING with the new restart count, then PENDING. The first
    sighting must not use up the count that says the job was requeued."""
    completing, pending = run(
        running(),
        SlurmJobSeen("COMPLETING", NODES, 1),
        SlurmJobSeen("PENDING", (), 1, "BeginTime"),
    )
    adopted = completing if completing.record.state is JobState.REQUEUED else pending
    assert adopted.record.state is JobState.REQUEUED, (completing.explanation, pending.explanation)
    assert adopted.cause is Cause.SLURM_REQUEUE
    assert pending.record.state is JobState.REQUEUED
    assert dict(pending.record.restarts) == {Cause.SLURM_REQUEUE: 1}
