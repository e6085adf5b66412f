"""The time limit as a planned stop, in the decision core: table tests with a fixed NOW."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from supervisor.core.intents import (
    DrainNode,
    RequeueSmaller,
    StopRanks,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import (
    Cause,
    ClusterView,
    JobRecord,
    JobState,
    record_from_json,
    record_to_json,
)
from supervisor.core.observations import (
    AgentReport,
    CheckpointCommitted,
    CheckpointValidated,
    HangReported,
    RequeueFailed,
    SlurmJobSeen,
    Tick,
    TimeLimitNear,
    TimeLimitNoticed,
)
from supervisor.core.planned_stop import REQUEUE_MARGIN_S, SETTLE_BEFORE_END_S
from supervisor.core.policy import Decision, decide
from tests.unit.policy_world import CLUSTER, NODES, NOW, POLICY, rank_exit, running

STRICT = replace(POLICY, validation_level=ValidationLevel.FULL)


def step(record: JobRecord, observation: object, at: float = NOW) -> Decision:
    return decide(record, observation, at, STRICT, CLUSTER)  # type: ignore[arg-type]


def noticed(left_s: float = 120.0) -> JobRecord:
    return step(running(), TimeLimitNear(left_s)).record


def test_a_notice_marks_the_job_stopping_and_plans_nothing() -> None:
    decision = step(running(), TimeLimitNear(120.0))
    assert decision.record.state is JobState.RUNNING
    assert decision.record.time_limit_end_s == NOW + 120.0
    assert decision.intents == ()
    assert decision.cause is Cause.TIME_LIMIT
    assert "requeued at 4 node(s)" in decision.explanation


def test_an_agents_notice_counts_from_its_own_clock() -> None:
    event = TimeLimitNoticed("node2", "42/node2/ab/1", NOW - 5000, time_left_s=90.0)
    assert step(running(), event).record.time_limit_end_s == NOW + 90.0


@pytest.mark.parametrize(
    "observation",
    [
        rank_exit("node3", sig=signal.SIGTERM),
        rank_exit("node1", code=1),
        HangReported("node2", "42/node2/ab/9", NOW),
    ],
    ids=["sigterm", "exit-1", "hang"],
)
def test_exits_and_hangs_during_the_stop_are_no_fault(observation: AgentReport) -> None:
    decision = step(noticed(), observation)
    assert decision.record.state is JobState.RUNNING
    assert decision.intents == ()
    assert decision.record.restarts == ()


def test_the_ranks_stopped_requeues_at_the_same_size_without_blame_or_budget() -> None:
    record = replace(noticed(), restarts_without_progress=2)
    stopped = step(record, TimeLimitNear(60.0, stopped=True))
    assert stopped.record.state is JobState.RECOVERING
    assert stopped.cause is Cause.TIME_LIMIT
    assert stopped.record.restarts_for(Cause.TIME_LIMIT) == 1
    assert stopped.record.restarts_without_progress == 2  # no budget spent
    assert stopped.record.not_before_s is None  # no backoff
    assert stopped.record.time_limit_end_s is None
    assert not any(isinstance(i, DrainNode | StopRanks) for i in stopped.intents)
    (validate,) = stopped.intents
    assert isinstance(validate, ValidateCheckpoints)
    # A full read of a large checkpoint would take longer than the time left.
    assert validate.level is ValidationLevel.QUICK
    chosen = step(stopped.record, CheckpointValidated(140, "/ckpt/step-140", True))
    (requeue,) = chosen.intents
    assert isinstance(requeue, RequeueSmaller)
    assert requeue.n_nodes == 4 and requeue.exclude == ()
    assert requeue.resume_from == "/ckpt/step-140"
    assert chosen.record.state is JobState.REQUEUED


def test_the_end_drawing_near_requeues_even_when_no_stop_was_reported() -> None:
    record = noticed(120.0)
    early = step(record, Tick(), at=NOW + 120.0 - REQUEUE_MARGIN_S - 1)
    assert early.record.state is JobState.RUNNING
    late = step(record, Tick(), at=NOW + 120.0 - REQUEUE_MARGIN_S)
    assert late.record.state is JobState.RECOVERING
    assert late.cause is Cause.TIME_LIMIT
    # The ranks may still be writing their final checkpoint: awaited, until shortly
    # before the end (the requeue takes about 2 s).
    (validate,) = [i for i in late.intents if isinstance(i, ValidateCheckpoints)]
    assert validate.settle_until_s == NOW + 120.0 - SETTLE_BEFORE_END_S
    assert NOW + 120.0 - REQUEUE_MARGIN_S < validate.settle_until_s <= NOW + 120.0 - 2.0


def test_ranks_reported_stopped_leave_no_save_to_await() -> None:
    stopped = step(noticed(), TimeLimitNear(60.0, stopped=True))
    (validate,) = [i for i in stopped.intents if isinstance(i, ValidateCheckpoints)]
    assert validate.settle_until_s is None


def test_a_requeue_by_the_driver_itself_is_adopted_as_the_time_limit() -> None:
    seen = SlurmJobSeen("PENDING", (), restart_count=1, reason="BeginTime")
    adopted = step(noticed(), seen)
    assert adopted.record.state is JobState.REQUEUED
    assert adopted.cause is Cause.TIME_LIMIT
    assert adopted.record.restarts == ((Cause.TIME_LIMIT, 1),)
    assert any(isinstance(i, ValidateCheckpoints) for i in adopted.intents)


def test_slurm_ending_the_job_first_still_requeues_without_blame() -> None:
    ended = step(noticed(), SlurmJobSeen("TIMEOUT", NODES, restart_count=0, reason="TimeLimit"))
    assert ended.record.state is JobState.RECOVERING
    assert ended.cause is Cause.TIME_LIMIT
    assert ended.record.recovery is not None and ended.record.recovery.requeue
    assert not any(isinstance(i, DrainNode) for i in ended.intents)


def test_a_notice_during_a_faults_recovery_turns_it_to_the_requeue_path() -> None:
    failed = step(running(), rank_exit("node3", sig=signal.SIGKILL))
    assert failed.record.state is JobState.RECOVERING
    assert failed.record.recovery is not None and not failed.record.recovery.requeue
    turned = step(failed.record, TimeLimitNear(100.0))
    assert turned.record.recovery is not None and turned.record.recovery.requeue


def test_no_grow_back_during_the_planned_stop() -> None:
    small = replace(noticed(), nodes=NODES[:2])
    idle = replace(CLUSTER, idle=frozenset({"node5", "node6"}))
    commit = CheckpointCommitted(
        "node1", "42/node1/ab/7", NOW, step=140,
        path="/ckpt/step-140",
    )  # fmt: skip
    decision = decide(small, commit, NOW, replace(STRICT, grow_back=True), idle)
    assert decision.record.last_step == 140
    assert decision.intents == ()
    assert decision.record.state is JobState.RUNNING


def test_records_without_the_time_limit_field_still_read() -> None:
    text = record_to_json(running()).replace(', "time_limit_end_s": null', "")
    assert "time_limit_end_s" not in text
    assert record_from_json(text).time_limit_end_s is None
    assert record_from_json(record_to_json(noticed())).time_limit_end_s == NOW + 120.0


def test_cluster_view_is_unchanged_by_a_notice() -> None:
    assert decide(running(), TimeLimitNear(None), NOW, STRICT, ClusterView()).intents == ()


def test_a_requeue_slurm_refuses_for_good_fails_the_job_saying_how_to_resume() -> None:
    chosen = step(
        step(noticed(), TimeLimitNear(60.0, stopped=True)).record,
        CheckpointValidated(140, "/ckpt/step-140", True),
    ).record
    assert chosen.state is JobState.REQUEUED
    refused = step(chosen, RequeueFailed(chosen.attempt, "job 42 is not listed"))
    assert refused.record.state is JobState.FAILED
    assert "resurgo submit" in refused.record.final_reason
    assert "same --ckpt-root" in refused.record.final_reason
    stale = step(chosen, RequeueFailed(chosen.attempt - 1, "old"))
    assert stale.record.state is JobState.REQUEUED


def test_a_late_report_of_an_earlier_attempt_does_not_requeue_its_successor() -> None:
    record = replace(running(), attempt=3)
    late = step(record, TimeLimitNear(30.0, stopped=True, attempt=2))
    assert late.record == record and late.intents == ()
