"""Goodput accounting, MTBF, interval and resume verification: table tests, no clock."""

from __future__ import annotations

import math

import pytest

from agent.checkpoint.interval import recommended_interval_s
from supervisor.core.goodput import (
    STILL_RUNNING,
    Badput,
    Fact,
    FactKind,
    account,
    mtbf_estimate,
    recommended_interval,
    verify_cursor,
    verify_resume,
)

K = FactKind


def test_a_clean_run_is_all_productive_but_startup_queue_and_stalls():
    result = account(
        [
            Fact(0, K.QUEUED),
            Fact(10, K.ALLOCATED),
            Fact(40, K.STEP, 1),
            Fact(100, K.SAVE_STALL, 5),
            Fact(140, K.STEP, 100),
            Fact(140, K.ENDED),
        ]
    )
    assert result.wall_s == 140
    assert result.badput_s[Badput.QUEUE_WAIT] == 10
    assert result.badput_s[Badput.STARTUP] == 30
    assert result.badput_s[Badput.CHECKPOINT_STALL] == 5
    assert result.productive_s == 95
    assert result.ratio == pytest.approx(95 / 140)


def test_a_fault_charges_lost_work_detection_and_recovery_to_its_cause():
    result = account(
        [
            Fact(0, K.ALLOCATED),
            Fact(10, K.STEP, 1),
            Fact(50, K.STEP, 50),  # ckpt at 50 reached t=50
            Fact(50, K.CHECKPOINT, 50),
            Fact(80, K.STEP, 80),
            Fact(90, K.FAULT, cause="hang"),
            Fact(120, K.DETECTED, cause="hang"),
            Fact(150, K.RESUMED, 50),
            Fact(170, K.STEP, 51),
            Fact(200, K.ENDED),
        ]
    )
    assert result.badput_s[Badput.STARTUP] == 10
    assert result.badput_s[Badput.LOST_WORK] == 40  # from step 50 (t=50) to the fault (t=90)
    assert result.badput_s[Badput.DETECTION] == 30
    assert result.badput_s[Badput.RECOVERY] == 50  # detection at 120 -> first step at 170
    assert result.by_fault_cause_s == {"hang": 120}
    assert result.badput_s[Badput.SHUTDOWN] == 30  # the last step (t=170) -> the end
    assert result.productive_s == 200 - 10 - 40 - 30 - 50 - 30


def test_queue_wait_inside_a_requeue_is_queue_wait_not_recovery():
    result = account(
        [
            Fact(0, K.ALLOCATED),
            Fact(0, K.STEP, 0),
            Fact(100, K.DETECTED, cause="node_lost"),
            Fact(110, K.QUEUED),
            Fact(160, K.ALLOCATED),
            Fact(170, K.RESUMED, 0),
            Fact(180, K.STEP, 1),
            Fact(200, K.ENDED),
        ]
    )
    assert result.badput_s[Badput.QUEUE_WAIT] == 50
    assert result.badput_s[Badput.RECOVERY] == 10 + 20
    assert result.badput_s[Badput.LOST_WORK] == 100


def test_empty_timeline_is_zero():
    assert account([]).ratio == 0.0


def test_mtbf_is_node_seconds_per_fault_and_unknown_without_faults():
    assert mtbf_estimate([1.0, 2.0], 3600.0, 10) == 18000.0
    assert mtbf_estimate([], 3600.0, 10) is None
    with pytest.raises(ValueError):
        mtbf_estimate([1.0], 0.0, 1)


def test_recommended_interval_is_the_agents_daly():
    assert recommended_interval(120.0, 30.0, 3 * 3600.0) == recommended_interval_s(
        120.0, 30.0, 3 * 3600.0
    )
    assert recommended_interval(300.0, 0.0, 86400.0) / 60 == pytest.approx(116.7, abs=0.1)


@pytest.mark.parametrize(
    ("before", "after", "tolerance", "verified", "first"),
    [
        ({1: 2.0, 2: 1.5}, {1: 2.0, 2: 1.5, 3: 1.2}, 0.0, True, None),
        ({1: 2.0, 2: 1.5}, {1: 2.0, 2: 1.5000001}, 0.0, False, 2),
        ({1: 2.0, 2: 1.5}, {1: 2.0, 2: 1.5000001}, 1e-3, True, None),
        ({1: math.nan}, {1: math.nan}, 0.0, True, None),
        ({1: 2.0}, {2: 2.0}, 0.0, False, None),
    ],
)
def test_verify_resume_table(before, after, tolerance, verified, first):
    result = verify_resume(before, after, tolerance)
    assert (result.verified, result.first_diverging_step) == (verified, first)


def test_resized_resume_must_start_at_the_checkpoint_cursor():
    assert verify_cursor(4096, 4096, step=64).verified
    off = verify_cursor(4096, 4000, step=64)
    assert not off.verified and off.first_diverging_step == 64 and "-96" in off.reason


def test_interval_is_pushed_only_when_it_changes_enough():
    from supervisor.core.goodput import interval_push

    job_mtbf = 3 * 3600.0
    target = recommended_interval_s(120.0, 0.0, job_mtbf)
    push = interval_push("42", 1, None, job_mtbf * 4, 4, 120.0, 0.0)
    assert push is not None and push.interval_s == pytest.approx(target)
    assert interval_push("42", 1, target * 1.05, job_mtbf * 4, 4, 120.0, 0.0) is None
    assert interval_push("42", 1, 600.0, None, 4, 120.0, 0.0) is None


def test_a_resume_past_the_last_reported_step_loses_none_of_the_run():
    """A checkpoint newer than the last step report (a save right before a kill, steps
    reported late): the time since that checkpoint is lost, not the whole run before it."""
    lost = {}
    for resumed_at in (80, 85):
        result = account(
            [
                Fact(0, K.ALLOCATED),
                Fact(10, K.STEP, 1),
                Fact(80, K.STEP, 80),
                Fact(90, K.FAULT, cause="rank_signal"),
                Fact(95, K.DETECTED, cause="rank_signal"),
                Fact(110, K.RESUMED, resumed_at),
                Fact(120, K.STEP, 86),
                Fact(130, K.ENDED),
            ]
        )
        lost[resumed_at] = result.badput_s[Badput.LOST_WORK]
    assert lost == {80: 10, 85: 0}  # from step 80 (t=80) to the fault; nothing


def test_the_time_after_the_last_step_of_an_ended_job_is_shutdown_not_productive():
    """A final save and the processes' exit are no training step; a job still running is
    accounted up to now without that charge (its next step may come at any moment)."""
    steps = [Fact(0, K.ALLOCATED), Fact(10, K.STEP, 1), Fact(90, K.STEP, 80)]
    ended = account([*steps, Fact(100, K.ENDED)])
    assert ended.badput_s[Badput.SHUTDOWN] == 10
    assert ended.productive_s == 100 - 10 - 10
    running = account([*steps, Fact(100, K.ENDED, cause=STILL_RUNNING)])
    assert running.badput_s[Badput.SHUTDOWN] == 0
    assert running.productive_s == 100 - 10


def test_a_step_the_failed_run_reports_after_the_detection_does_not_end_the_recovery():
    """Rank 0 finished one more step before its peers stopped: its report after the
    detection is the failed run's. The recovery ends at the relaunched run's first step."""
    result = account(
        [
            Fact(0, K.ALLOCATED),
            Fact(10, K.STEP, 1),
            Fact(50, K.STEP, 40),
            Fact(50, K.FAULT, cause="rank_signal"),
            Fact(51, K.DETECTED, cause="rank_signal"),
            Fact(52, K.STEP, 41),  # the failed run's last report
            Fact(70, K.RESUMED, 40),
            Fact(80, K.STEP, 41),
            Fact(120, K.STEP, 80),
            Fact(120, K.ENDED),
        ]
    )
    assert result.badput_s[Badput.RECOVERY] == 80 - 51
    assert result.productive_s == 120 - 10 - 1 - 29
