"""The job lifecycle table, the record's JSON and intents' ids (purity: test_purity.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.wire.protocol import EventKind, make_event
from supervisor.core.intents import (
    Alert,
    DrainNode,
    RelaunchStep,
    RequeueSmaller,
    Severity,
    StopJob,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import (
    TRANSITIONS,
    Cause,
    CrashSignature,
    ExitSeen,
    IllegalTransition,
    JobState,
    RecordFormatError,
    Recovery,
    Suspect,
    check_transition,
    new_record,
    record_from_json,
    record_to_json,
)
from supervisor.core.observations import from_event

NOW = 1_000_000.0


def test_terminal_states_have_no_way_out_and_every_state_is_in_the_table():
    assert set(TRANSITIONS) == set(JobState)
    assert {s for s in JobState if s.terminal} == {
        JobState.COMPLETED,
        JobState.FAILED,
        JobState.CANCELLED,
    }
    for source, targets in TRANSITIONS.items():
        assert source not in targets, "staying is not a transition"
        if not source.terminal:
            assert JobState.CANCELLED in targets and JobState.FAILED in targets


@pytest.mark.parametrize("source", list(JobState))
@pytest.mark.parametrize("target", list(JobState))
def test_check_transition_follows_the_table(source, target):
    if source is target or target in TRANSITIONS[source]:
        check_transition(source, target)
    else:
        with pytest.raises(IllegalTransition, match=f"{source.value} -> {target.value}"):
            check_transition(source, target)


def test_recovering_cannot_skip_the_relaunch():
    with pytest.raises(IllegalTransition):
        check_transition(JobState.RECOVERING, JobState.RUNNING)


def full_record():
    record = new_record("42", 4, NOW, min_nodes=2, unit=2, procs_per_node=8)
    return replace(
        record.with_restart(Cause.HANG).with_restart(Cause.HANG).with_restart(Cause.RANK_SIGNAL),
        state=JobState.RECOVERING,
        nodes=("n1", "n2"),
        attempt=3,
        last_step=100,
        last_checkpoint_path="/c/100",
        signatures=(CrashSignature("ValueError:ab", 12), CrashSignature("exit:1", None)),
        blamed_nodes=("n3",),
        straggler_reports=(("n2", 2),),
        not_before_s=NOW + 5,
        recovery=Recovery(
            Cause.HANG,
            NOW,
            evidence_until_s=NOW + 30,
            suspects=(Suspect("n1", 0, 9, False, NOW, "x"),),
            exclude=("n3",),
            requeue=True,
            validated=True,
            resume_from="/c/100",
            resume_step=100,
            rejected=("/c/200",),
        ),
    )


def test_record_json_round_trips_with_a_version():
    record = full_record()
    text = record_to_json(record)
    assert '"version": 1' in text and '"state": "recovering"' in text
    assert record_from_json(text) == record
    assert record.restarts_for(Cause.HANG) == 2 and record.restarts_for(Cause.STRAGGLER) == 0


def window_record():
    """A record in an exit window: two exits collected, the root cause not chosen yet."""
    return replace(
        new_record("42", 4, NOW, min_nodes=2),
        state=JobState.RECOVERING,
        nodes=("n1", "n2", "n3", "n4"),
        recovery=Recovery(
            Cause.USER_EXCEPTION,
            NOW,
            evidence_until_s=NOW + 3,
            exits=(
                ExitSeen("n3", 5, None, 9, 12, NOW - 1.5),
                ExitSeen("n1", 0, 1, None, None, NOW - 1.2, "RuntimeError:gloo"),
            ),
        ),
    )


def test_record_json_round_trips_the_exits_of_an_open_exit_window():
    record = window_record()
    assert record.recovery is not None and record.recovery.collecting_exits
    text = record_to_json(record)
    assert '"died_at_s": 999998.5' in text
    assert record_from_json(text) == record


def test_a_record_stored_before_exit_windows_reads_with_no_exits():
    doc = json.loads(record_to_json(window_record()))
    del doc["recovery"]["exits"]
    recovery = record_from_json(json.dumps(doc)).recovery
    assert recovery is not None and recovery.exits == () and not recovery.collecting_exits


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "not JSON"),
        ('{"version": 99}', "version 99"),
        ('{"version": 1}', "missing"),
        (record_to_json(new_record("1", 1, NOW)).replace('"submitted"', '"bogus"'), "malformed"),
    ],
)
def test_unreadable_records_name_the_problem(text, message):
    with pytest.raises(RecordFormatError, match=message):
        record_from_json(text)


@given(
    st.integers(0, 10**6),
    st.integers(1, 64),
    st.sampled_from(list(JobState)),
    st.lists(st.sampled_from(list(Cause)), max_size=6),
)
def test_any_record_round_trips(step, nodes, state, causes):
    record = replace(new_record("j1", nodes, NOW), state=state, last_step=step)
    for cause in causes:
        record = record.with_restart(cause)
    assert record_from_json(record_to_json(record)) == record


def test_action_ids_are_deterministic_and_name_job_attempt_kind_and_target():
    drain = DrainNode("42", 3, "n3", Cause.HANG, "stuck")
    assert drain.action_id == DrainNode("42", 3, "n3", Cause.HANG, "other words").action_id
    assert drain.action_id == "42/3/drain/n3"
    assert drain.slurm_reason == "resurgo: hang job=42 stuck"
    ids = {
        drain.action_id,
        RelaunchStep("42", 3, ("n1",), None).action_id,
        RequeueSmaller("42", 3, 1, ("n3",), None).action_id,
        StopJob("42", 3, JobState.FAILED, "x").action_id,
        ValidateCheckpoints("42", 3, ValidationLevel.FULL).action_id,
        ValidateCheckpoints("42", 3, ValidationLevel.FULL, ("/c",)).action_id,
        Alert("42", 3, Severity.WARNING, "a").action_id,
        Alert("42", 3, Severity.WARNING, "b").action_id,
    }
    assert len(ids) == 8


def test_validation_level_matches_the_agents_ladder_by_value():
    from agent.checkpoint.validate import Level

    assert {level.value for level in ValidationLevel} == {level.value for level in Level}


def test_agent_events_become_observations():
    hang = make_event(
        EventKind.HANG,
        "42",
        "n2",
        "abcdef01",
        3,
        NOW,
        {
            "hung": [
                {
                    "global_rank": 5,
                    "local_rank": 1,
                    "pid": 99,
                    "last_step": 7,
                    "phase": "train",
                    "seconds_since_progress": 80.0,
                    "timeout_s": 60.0,
                    "detector": "heartbeat",
                }
            ],
            "stacks": {},
            "culprits": [
                {"global_rank": 5, "last_step": 7, "in_collective": False, "reason": "behind"}
            ],
        },
    )
    observed = from_event(hang)
    assert observed.node == "n2" and observed.culprits[0].seconds_since_progress == 80.0
    exited = make_event(
        EventKind.RANK_EXITED,
        "42",
        "n2",
        "abcdef01",
        4,
        NOW,
        {
            "global_rank": 5,
            "local_rank": 1,
            "pid": 99,
            "exit_code": None,
            "signal": 9,
            "signal_name": "SIGKILL",
            "last_step": 7,
            "phase": "train",
        },
    )
    assert (from_event(exited).signal, from_event(exited).step) == (9, 7)
    assert from_event(exited).exit_time_s is None
    timed = replace(exited, payload={**exited.payload, "exit_time_unix_s": NOW - 0.5})
    assert from_event(timed).exit_time_s == NOW - 0.5


@pytest.mark.parametrize(
    "mangle",
    [
        lambda doc: "[" * 100_000,
        lambda doc: json.dumps({**doc, "restarts": [["hang", float("inf")]]}),
        lambda doc: json.dumps({**doc, "straggler_reports": [["node1", float("inf")]]}),
        lambda doc: json.dumps({**doc, "attempt": "x"}),
        lambda doc: json.dumps({**doc, "attempt": True}),
        lambda doc: json.dumps({**doc, "job_id": 7}),
    ],
)
def test_a_damaged_record_is_a_record_format_error(mangle) -> None:  # type: ignore[no-untyped-def]
    doc = json.loads(record_to_json(new_record("1", 4, 1.0)))
    with pytest.raises(RecordFormatError):
        record_from_json(mangle(doc))
