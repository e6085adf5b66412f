"""Training anomalies in the decision core: rollback past the onset, skip its data,
and what a recurrence means (supervisor.core.rollback, supervisor.core.skips)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agent.skips import merge
from supervisor.core.anomaly import AnomalyAction
from supervisor.core.intents import (
    Alert,
    DrainNode,
    RelaunchStep,
    StopJob,
    StopRanks,
    ValidateCheckpoints,
)
from supervisor.core.model import AnomalySeen, Cause, JobState, record_from_json, record_to_json
from supervisor.core.observations import CheckpointValidated, TrainingAnomaly
from supervisor.core.skips import window
from tests.unit.policy_world import POLICY, rank_exit, run, running

G = 12  # the global batch


def nan(onset: int = 150, nodes: tuple[str, ...] = (), cursor: int | None = 1788, attempt=1):
    return TrainingAnomaly(
        "non_finite", onset, attempt, (2,), nodes, cursor, None if cursor is None else G,
        f"rank 2 reported a loss of nan at step {onset}",
    )  # fmt: skip


def rolled_back(record, anomaly, resume_step=120, policy=POLICY):
    """Feed an anomaly, then a valid checkpoint at ``resume_step``: the decisions."""
    path = f"/ckpt/step-{resume_step}"
    return run(
        record,
        anomaly,
        CheckpointValidated(resume_step, path, True),
        policy=policy,
    )


def test_a_first_nan_rolls_back_before_the_onset_and_skips_its_data_with_no_drain():
    first, chosen = rolled_back(running(), nan(150))
    assert first.record.state is JobState.RECOVERING
    assert first.cause is Cause.TRAINING_ANOMALY
    kinds = [type(intent) for intent in first.intents]
    assert kinds == [StopRanks, ValidateCheckpoints]  # no drain
    validate = first.intents[1]
    assert isinstance(validate, ValidateCheckpoints)
    # The params behind step 150's loss are step 149's; the margin goes 20 further.
    assert validate.before_step == 150 - 1 - POLICY.anomaly_margin_steps
    assert first.record.recovery.resume_before == 129
    assert first.record.rollbacks == 1
    assert first.record.restarts_without_progress == 0  # its own budget, not the restarts'
    relaunch = [i for i in chosen.intents if isinstance(i, RelaunchStep)]
    assert relaunch and relaunch[0].nodes == running().nodes
    assert relaunch[0].resume_from == "/ckpt/step-120"
    # The onset batch and the 19 after it: 20 batches of 12, from the onset's cursor.
    assert chosen.record.skipped_samples == ((1788, 1788 + 20 * G),)
    seen = chosen.record.anomalies[-1]
    assert (seen.action, seen.skipped, seen.resumed_step) == ("rollback", (1788, 2028), 120)
    assert chosen.record.blamed_nodes == ()


def test_the_lead_is_cut_at_the_checkpoint_so_nothing_trained_is_called_skipped():
    policy = replace(POLICY, anomaly_skip_lead_batches=50, anomaly_margin_steps=0)
    *_, chosen = rolled_back(running(), nan(150), resume_step=140, policy=policy)
    # Step 141 is the first after the checkpoint: 9 batches before the onset at most.
    assert chosen.record.skipped_samples == ((1788 - 9 * G, 1788 - 9 * G + 20 * G),)


def test_no_cursor_rolls_back_without_a_skip_and_says_so():
    first, chosen = rolled_back(running(), nan(150, cursor=None))
    assert "nothing can be skipped" in first.explanation
    assert chosen.record.skipped_samples == ()
    assert chosen.record.anomalies[-1].skipped is None


def test_a_recurrence_on_fresh_data_on_every_node_is_a_crash_loop_without_a_drain():
    *_, chosen = rolled_back(running(), nan(150))
    relaunched = replace(chosen.record, state=JobState.RUNNING, recovery=None)
    (again,) = run(relaunched, nan(152, cursor=2100, attempt=relaunched.attempt))
    assert again.record.state is JobState.FAILED
    assert again.cause is Cause.CRASH_LOOP
    assert "fresh data" in again.record.final_reason and "no drain" in again.record.final_reason
    assert not any(isinstance(i, DrainNode) for i in again.intents)
    assert any(isinstance(i, StopJob) for i in again.intents)


def test_a_recurrence_from_one_node_alone_on_fresh_data_drains_that_node():
    *_, chosen = rolled_back(running(), nan(150, nodes=("node3",)))
    relaunched = replace(chosen.record, state=JobState.RUNNING, recovery=None)
    (again,) = run(relaunched, nan(152, nodes=("node3",), cursor=2100, attempt=2))
    assert again.cause is Cause.SILENT_CORRUPTION
    assert again.record.state is JobState.RECOVERING
    drains = [i for i in again.intents if isinstance(i, DrainNode)]
    assert [d.node for d in drains] == ["node3"]
    validate = [i for i in again.intents if isinstance(i, ValidateCheckpoints)]
    assert validate[0].before_step == 152 - 1 - POLICY.anomaly_margin_steps
    assert again.record.anomalies[-1].action == "drain"


def test_a_recurrence_on_the_same_data_is_a_crash_loop_even_from_one_node():
    # No cursor: the data could not be skipped, so the same rank sees the same sample.
    *_, chosen = rolled_back(running(), nan(150, nodes=("node3",), cursor=None))
    relaunched = replace(chosen.record, state=JobState.RUNNING, recovery=None)
    (again,) = run(relaunched, nan(150, nodes=("node3",), cursor=None, attempt=2))
    assert again.cause is Cause.CRASH_LOOP
    assert "same data" in again.record.final_reason
    assert again.record.blamed_nodes == ()


def test_a_recurrence_at_the_same_cursor_means_the_skip_never_took_effect():
    *_, chosen = rolled_back(running(), nan(150, nodes=("node3",)))
    relaunched = replace(chosen.record, state=JobState.RUNNING, recovery=None)
    (again,) = run(relaunched, nan(150, nodes=("node3",), attempt=2))
    assert again.cause is Cause.CRASH_LOOP
    assert "did not take effect" in again.record.final_reason
    assert "skipping global samples [1788, 2028) (20 global batches)" in again.record.final_reason
    assert again.record.blamed_nodes == ()


def test_an_anomaly_far_after_the_last_is_a_new_one_until_the_budget_ends():
    record = running()
    policy = replace(POLICY, anomaly_max_rollbacks=2)
    onset = 150
    for attempt in (1, 2):
        *_, chosen = rolled_back(record, nan(onset, attempt=attempt), policy=policy)
        record = replace(chosen.record, state=JobState.RUNNING, recovery=None)
        onset += POLICY.anomaly_recurrence_steps + 1
    (third,) = run(record, nan(onset, attempt=3), policy=policy)
    assert third.record.state is JobState.FAILED
    assert third.cause is Cause.TRAINING_ANOMALY
    assert "anomaly_max_rollbacks 2" in third.record.final_reason


def test_alert_only_tells_a_person_once_and_trains_on():
    policy = replace(POLICY, anomaly_action=AnomalyAction.ALERT)
    first, second = run(running(), nan(150), nan(150), policy=policy)
    assert first.record.state is JobState.RUNNING
    assert [type(i) for i in first.intents] == [Alert]
    assert second.intents == ()
    assert first.record.anomalies[-1].action == "alert"


def test_an_anomaly_of_an_earlier_attempt_is_stale():
    (decision,) = run(running(attempt=3), nan(150, attempt=2))
    assert decision.intents == () and "stale" in decision.explanation


def test_no_checkpoint_before_the_onset_stops_with_what_to_do():
    _, none = run(running(), nan(150), CheckpointValidated(None, None, False, "none left"))
    assert none.record.state is JobState.FAILED
    assert "no checkpoint at or before step 129" in none.record.final_reason
    assert "anomaly_margin_steps" in none.record.final_reason


def test_a_rejected_candidate_is_retried_still_before_the_onset():
    _, rejected = run(
        running(), nan(150), CheckpointValidated(120, "/ckpt/step-120", False, "bad crc")
    )
    (retry,) = rejected.intents
    assert isinstance(retry, ValidateCheckpoints)
    assert retry.before_step == 129 and retry.skip == ("/ckpt/step-120",)


def test_ranks_dying_of_the_nan_are_the_anomalys_not_a_user_exception():
    """A script that raises on a NaN: the exits open a window, the anomaly takes it over."""
    policy = replace(POLICY, exit_evidence_window_s=30.0)
    opened, taken = run(running(), rank_exit(code=1, digest="abc"), nan(150), policy=policy)
    assert opened.record.state is JobState.RECOVERING
    assert taken.cause is Cause.TRAINING_ANOMALY
    assert taken.record.recovery.resume_before == 129
    assert taken.record.user_retries_without_progress == 0


def test_the_record_keeps_anomalies_and_skips_through_json():
    *_, chosen = rolled_back(running(), nan(150, nodes=("node3",)))
    again = record_from_json(record_to_json(chosen.record))
    assert again == chosen.record
    old = record_to_json(running()).replace('"anomalies": [], ', "")
    assert record_from_json(old).anomalies == ()


@pytest.mark.parametrize(
    ("ranges", "merged"),
    [
        ([], ()),
        ([(24, 48), (0, 12)], ((0, 12), (24, 48))),
        ([(0, 24), (12, 36), (36, 48)], ((0, 48),)),
    ],
)
def test_skipped_ranges_merge(ranges, merged):
    assert merge(ranges) == merged


def test_no_skip_batches_means_no_window():
    entry = AnomalySeen("loss_spike", 10, 1, (), 100, G, "", "rollback")
    assert window(entry, 5, replace(POLICY, anomaly_skip_batches=0)) is None
    assert window(entry, 5, POLICY) == (100, 100 + 20 * G)
