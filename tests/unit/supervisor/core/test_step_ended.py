"""The driver's "step of attempt N ended with exit code X" is decided on, not ignored
(supervisor.intake decides when: a lease after it, with no agent heard since)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from supervisor.core.intents import DrainNode
from supervisor.core.model import JobRecord, JobState
from supervisor.core.observations import StepEnded
from supervisor.core.policy import decide
from tests.unit.policy_world import CLUSTER, NOW, POLICY, running

RUNNING = running()  # attempt 0


@pytest.mark.parametrize(
    ("record", "ended", "recovers"),
    [
        # the job still runs for that attempt and no agent said why: a fault of the attempt
        (RUNNING, StepEnded(RUNNING.attempt, 1), True),
        (RUNNING, StepEnded(RUNNING.attempt, 137), True),
        (replace(RUNNING, state=JobState.STARTING), StepEnded(RUNNING.attempt, 1), True),
        # an older attempt's step: its end is already decided on
        (replace(RUNNING, attempt=2), StepEnded(1, 1), False),
        # a clean end: Slurm reports the job's end
        (RUNNING, StepEnded(RUNNING.attempt, 0), False),
        # a planned stop for the time limit: its end is no fault
        (replace(RUNNING, time_limit_end_s=NOW + 30), StepEnded(RUNNING.attempt, 143), False),
        # the agents' reports came first: the recovery is already open
        (replace(RUNNING, state=JobState.RECOVERING), StepEnded(RUNNING.attempt, 1), False),
    ],
)
def test_a_failed_step_of_the_running_attempt_opens_one_recovery_blaming_no_node(
    record: JobRecord, ended: StepEnded, recovers: bool
) -> None:
    decision = decide(record, ended, NOW, POLICY, CLUSTER)
    assert not any(isinstance(intent, DrainNode) for intent in decision.intents)
    if recovers:
        assert decision.record.state is JobState.RECOVERING
        assert decision.record.recovery is not None
        assert decision.intents
    else:
        assert decision.record == record and decision.intents == ()


def test_the_drivers_repeated_report_opens_no_second_recovery() -> None:
    first = decide(RUNNING, StepEnded(RUNNING.attempt, 1), NOW, POLICY, CLUSTER)
    again = decide(first.record, StepEnded(RUNNING.attempt, 1), NOW + 5, POLICY, CLUSTER)
    assert again.record == first.record and again.intents == ()
