"""Table tests of blame: which node is at fault, how sure, and why."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from agent.protocol import EventKind
from supervisor.blame import (
    CONFIDENCE_HANG_BEHIND,
    CONFIDENCE_HANG_FIRST_STOPPED,
    CONFIDENCE_HANG_OUTSIDE_COLLECTIVE,
    blame,
    blame_hang,
)
from supervisor.model import Cause, ClusterView, JobState, Suspect, new_record
from supervisor.observations import AgentEvent, Culprit, LeaseExpired, SlurmNodeSeen
from supervisor.policy import Policy

NOW = 1_000_000.0
RECORD = replace(
    new_record("7", 2, NOW), state=JobState.RUNNING, nodes=("a", "b"), procs_per_node=2
)


def exited(sig: int | None, code: int | None) -> AgentEvent:
    return AgentEvent(
        EventKind.RANK_EXITED, "b", "e", NOW, global_rank=3, exit_code=code, signal=sig, step=12
    )


@pytest.mark.parametrize(
    ("sig", "code", "node", "cause", "drainable"),
    [
        (signal.SIGKILL.value, None, "b", Cause.RANK_SIGNAL, True),
        (signal.SIGSEGV.value, None, "b", Cause.RANK_SIGNAL, True),
        (signal.SIGBUS.value, None, "b", Cause.RANK_SIGNAL, True),
        (signal.SIGABRT.value, None, "b", Cause.RANK_SIGNAL, False),
        (signal.SIGTERM.value, None, None, Cause.RANK_SIGNAL, False),
        (None, 1, None, Cause.USER_EXCEPTION, False),
    ],
)
def test_rank_exit_blame_table(sig, code, node, cause, drainable):
    verdict = blame(exited(sig, code), RECORD)
    assert (verdict.node, verdict.cause) == (node, cause)
    assert (verdict.confidence >= 0.6) is drainable
    assert verdict.evidence


def test_a_python_exception_is_never_a_node_fault():
    verdict = blame(exited(None, 1), RECORD, ClusterView(lemons=frozenset({"b"})))
    assert verdict.node is None and verdict.confidence == 0.0


def test_lease_expiry_and_slurm_down_blame_the_node_with_certainty():
    assert blame(LeaseExpired("a"), RECORD).confidence == 1.0
    assert blame(SlurmNodeSeen("a", not_responding=True), RECORD).node == "a"
    assert blame(SlurmNodeSeen("a"), RECORD).node is None


def test_health_check_failure_blames_the_node():
    event = AgentEvent(EventKind.HEALTH_CHECK_FAILED, "a", "e", NOW, detail="gpu lost")
    verdict = blame(event, RECORD)
    assert verdict.node == "a" and verdict.cause is Cause.HEALTH_CHECK
    assert "gpu lost" in verdict.evidence[0]


def s(node: str, rank: int, step: int | None, coll: bool | None, stopped: float) -> Suspect:
    return Suspect(node, rank, step, coll, stopped, "")


@pytest.mark.parametrize(
    ("suspects", "node", "confidence"),
    [
        # behind beats everything else
        ((s("a", 0, 10, True, 5.0), s("b", 2, 9, True, 9.0)), "b", CONFIDENCE_HANG_BEHIND),
        # same step: outside the collective
        (
            (s("a", 0, 10, True, 5.0), s("b", 2, 10, False, 9.0)),
            "b",
            CONFIDENCE_HANG_OUTSIDE_COLLECTIVE,
        ),
        # same step, all inside: stopped first
        ((s("a", 0, 10, True, 5.0), s("b", 2, 10, True, 9.0)), "a", CONFIDENCE_HANG_FIRST_STOPPED),
        # nothing stands out
        ((s("a", 0, 10, True, 5.0), s("b", 2, 10, True, 5.0)), None, 0.0),
    ],
)
def test_collective_hang_blame_across_nodes(suspects, node, confidence):
    verdict = blame_hang(suspects)
    assert verdict.node == node and verdict.confidence == confidence


def test_hang_event_is_compared_with_suspects_already_collected():
    from supervisor.model import Recovery

    record = replace(
        RECORD,
        recovery=Recovery(Cause.HANG, NOW, NOW + 30, suspects=(s("a", 0, 10, True, NOW - 50),)),
    )
    event = AgentEvent(
        EventKind.HANG, "b", "e", NOW, culprits=(Culprit(2, 8, True, 60.0, "behind"),)
    )
    verdict = blame(event, record)
    assert verdict.node == "b" and verdict.cause is Cause.HANG
    assert "2 step(s) behind" in verdict.evidence[0]


def test_lemons_raise_confidence():
    plain = blame(exited(signal.SIGABRT.value, None), RECORD)
    lemon = blame(exited(signal.SIGABRT.value, None), RECORD, ClusterView(lemons=frozenset("b")))
    assert lemon.confidence > plain.confidence


def test_rank_maps_to_its_node_when_the_event_has_none():
    assert RECORD.node_of_rank(3) == "b" and RECORD.node_of_rank(9) is None


NODE_DAY = 86400.0


@pytest.mark.parametrize(
    ("blames", "drained_at", "health", "now", "resumed"),
    [
        ((NOW - 4000,), NOW - 4000, True, NOW, True),  # single transient, probation over
        ((NOW - 4000,), NOW - 4000, False, NOW, False),  # health check still failing
        ((NOW - 100,), NOW - 100, True, NOW, False),  # still on probation
        ((NOW - 2 * NODE_DAY, NOW - 4000), NOW - 4000, True, NOW, False),  # a lemon
        ((NOW - 30 * NODE_DAY, NOW - 4000), NOW - 4000, True, NOW, True),  # old blame expired
        ((NOW - 4000,), None, True, NOW, False),  # not drained by Resurgo
    ],
)
def test_probation_returns_a_single_offender_and_keeps_lemons_out(
    blames, drained_at, health, now, resumed
):
    from supervisor.probation import NodeHistory, lemons, release

    history = NodeHistory("n7", blames, drained_at, "42", 2)
    verdict = release(history, health, now, Policy())
    assert (verdict is not None) is resumed
    if verdict is not None:
        assert verdict.action_id == "42/2/resume/n7"
    assert ("n7" in lemons((history,), now, Policy())) is (
        len([b for b in blames if now - b <= 7 * NODE_DAY]) >= 2
    )
