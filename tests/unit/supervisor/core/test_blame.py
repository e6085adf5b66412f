"""Table tests of blame: which node is at fault, how sure, and why."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from supervisor.core.blame import (
    CONFIDENCE_HANG_BEHIND,
    CONFIDENCE_HANG_FIRST_STOPPED,
    CONFIDENCE_HANG_OUTSIDE_COLLECTIVE,
    CONFIDENCE_NODE_SIGNAL,
    EXIT_TIE_TOLERANCE_S,
    blame,
    blame_exits,
    blame_hang,
    exit_seen,
    is_failure,
)
from supervisor.core.model import Cause, ClusterView, ExitSeen, JobState, Suspect, new_record
from supervisor.core.observations import (
    Culprit,
    HangReported,
    HealthCheckFailed,
    LeaseExpired,
    RankExited,
    SlurmNodeSeen,
)
from supervisor.core.policy import Policy

NOW = 1_000_000.0
RECORD = replace(
    new_record("7", 2, NOW), state=JobState.RUNNING, nodes=("a", "b"), procs_per_node=2
)


def exited(sig: int | None, code: int | None) -> RankExited:
    return RankExited("b", "e", NOW, global_rank=3, exit_code=code, signal=sig, step=12)


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
    event = HealthCheckFailed("a", "e", NOW, detail="gpu lost")
    verdict = blame(event, RECORD)
    assert verdict.node == "a" and verdict.cause is Cause.HEALTH_CHECK
    assert "gpu lost" in verdict.evidence[0]


@pytest.mark.parametrize(
    ("failed", "node"),
    [
        (("builtin:ckpt_root",), None),
        (("builtin:rdzv_addr", "builtin:ckpt_root"), None),
        (("builtin:ckpt_root", "builtin:gpus"), "a"),
        (("/opt/nhc/run",), "a"),
    ],
    ids=["checkpoint root", "both shared", "shared and gpus", "operator's command"],
)
def test_a_failed_check_of_what_the_nodes_share_blames_no_node(failed, node):
    event = HealthCheckFailed("a", "e", NOW, detail="FAIL", failed_checks=failed)
    verdict = blame(event, RECORD)
    assert verdict.node == node and verdict.cause is Cause.HEALTH_CHECK
    assert (verdict.confidence == 0.0) is (node is None)


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
    from supervisor.core.model import Recovery

    record = replace(
        RECORD,
        recovery=Recovery(Cause.HANG, NOW, NOW + 30, suspects=(s("a", 0, 10, True, NOW - 50),)),
    )
    event = HangReported("b", "e", NOW, culprits=(Culprit(2, 8, True, 60.0, "behind"),))
    verdict = blame(event, record)
    assert verdict.node == "b" and verdict.cause is Cause.HANG
    assert "2 step(s) behind" in verdict.evidence[0]


def test_an_exit_dies_at_its_exit_time_else_when_it_was_reported():
    event = exited(signal.SIGKILL.value, None)
    assert exit_seen(event).died_at_s == NOW
    assert exit_seen(replace(event, exit_time_s=NOW - 2.5)).died_at_s == NOW - 2.5


@pytest.mark.parametrize(
    ("sig", "code", "failure"),
    [
        (None, 0, False),
        (signal.SIGTERM.value, None, False),
        (signal.SIGINT.value, None, False),
        (None, 1, True),
        (None, None, True),
        (signal.SIGKILL.value, None, True),
        (signal.SIGABRT.value, None, True),
    ],
)
def test_finished_and_stopped_ranks_are_no_failures(sig, code, failure):
    assert is_failure(exit_seen(exited(sig, code))) is failure


@pytest.mark.parametrize(
    ("sig", "code", "ended"),
    [(signal.SIGTERM.value, None, "ended by SIGTERM"), (None, 1, "exit code 1")],
)
def test_a_rank_that_raised_failed_when_it_raised_and_blames_the_users_code(sig, code, ended):
    event = replace(
        exited(sig, code), exit_time_s=NOW - 1.0, raised="RuntimeError", raised_time_s=NOW - 1.4
    )
    seen = exit_seen(event)
    assert is_failure(seen) and (seen.raised, seen.raised_at_s) == ("RuntimeError", NOW - 1.4)
    assert seen.died_at_s == NOW - 1.0
    _, verdict = blame_exits((seen,), RECORD)
    assert (verdict.node, verdict.cause) == (None, Cause.USER_EXCEPTION)
    assert verdict.evidence == (
        f"rank 3 on b raised RuntimeError at step 12 ({ended}): the user's code",
    )


def test_a_raise_before_a_peers_death_is_the_root_cause_unless_a_node_signal_killed_one():
    raiser = ExitSeen("b", 3, None, signal.SIGTERM.value, 12, NOW, raised="E", raised_at_s=NOW - 2)
    abort = ExitSeen("a", 0, None, signal.SIGABRT.value, 12, NOW - 1)
    root, verdict = blame_exits((abort, raiser), RECORD)
    assert root is raiser and verdict.cause is Cause.USER_EXCEPTION
    # A SIGKILL's record can trail its peers' exceptions (they raise on its closed
    # connections): with a node signal among the exits, the deaths alone decide.
    killed = ExitSeen("a", 0, None, signal.SIGKILL.value, 12, NOW - 1)
    root, verdict = blame_exits((killed, raiser), RECORD)
    assert root is killed and (verdict.node, verdict.cause) == ("a", Cause.RANK_SIGNAL)


def gone(node: str, rank: int, died: float, sig: int | None = None) -> ExitSeen:
    return ExitSeen(node, rank, None if sig else 1, sig, 12, died, None if sig else "E")


KILLED = signal.SIGKILL.value
TIE = EXIT_TIE_TOLERANCE_S / 2


@pytest.mark.parametrize(
    ("exits", "rank", "cause"),
    [
        ((gone("a", 0, NOW + 1), gone("b", 3, NOW, KILLED)), 3, Cause.RANK_SIGNAL),
        ((gone("a", 0, NOW), gone("b", 3, NOW + 1, KILLED)), 0, Cause.USER_EXCEPTION),
        ((gone("a", 0, NOW), gone("b", 3, NOW + TIE, KILLED)), 3, Cause.RANK_SIGNAL),
        ((gone("a", 0, NOW + TIE, KILLED), gone("b", 3, NOW)), 0, Cause.RANK_SIGNAL),
        ((gone("a", 0, NOW + TIE), gone("b", 3, NOW)), 3, Cause.USER_EXCEPTION),
        ((gone("a", 0, NOW + 1), gone("b", 3, NOW + 2)), 0, Cause.USER_EXCEPTION),
    ],
)
def test_the_root_cause_is_the_earliest_death_and_a_node_signal_wins_a_tie(exits, rank, cause):
    root, verdict = blame_exits(exits, RECORD)
    assert (root.global_rank, verdict.cause) == (rank, cause)


def test_the_root_cause_evidence_names_it_and_counts_the_ranks_that_failed_after_it():
    exits = (gone("b", 3, NOW, KILLED), gone("a", 0, NOW + 0.3), gone("a", 1, NOW + 1.2))
    root, verdict = blame_exits(exits, RECORD, frozenset({"b"}))
    assert root == exits[0] and verdict.node == "b"
    assert verdict.confidence > CONFIDENCE_NODE_SIGNAL  # b is a lemon
    assert verdict.evidence == (
        "rank 3 on b died by SIGKILL at step 12, first of 3 failed ranks; "
        "the others failed 0.3-1.2s later",
        "b is on the lemon list",
    )
    alone = blame_exits(exits[:1], RECORD)[1]
    assert alone.evidence == ("rank 3 on b died by SIGKILL at step 12",)
    tied = blame_exits((gone("a", 0, NOW), gone("b", 3, NOW + 0.02, KILLED)), RECORD)[1]
    assert tied.evidence[0].endswith(
        "first of 2 failed ranks; the other failed -0.02s from it (a tie goes to the node signal)"
    )


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
    from supervisor.core.probation import NodeHistory, lemons, release

    history = NodeHistory("n7", blames, drained_at, "42", 2)
    verdict = release(history, health, now, Policy())
    assert (verdict is not None) is resumed
    if verdict is not None:
        assert verdict.action_id == "42/2/resume/n7"
    assert ("n7" in lemons((history,), now, Policy())) is (
        len([b for b in blames if now - b <= 7 * NODE_DAY]) >= 2
    )


def test_the_one_node_that_reports_no_hang_while_all_others_wait_in_a_collective_is_blamed():
    # A SIGSTOPped or busy rank outside any collective looks hung to no detector;
    # everybody else waits for it inside the collective.
    waiting = (
        s("n1", 0, None, True, 5.0),
        s("n2", 1, None, True, 5.0),
        s("n4", 3, None, True, 5.0),
    )
    verdict = blame_hang(waiting, job_nodes=("n1", "n2", "n3", "n4"))
    assert verdict.node == "n3" and verdict.confidence == CONFIDENCE_HANG_OUTSIDE_COLLECTIVE
    assert "n3 reported none" in verdict.evidence[0]
    # Two silent nodes: no way to tell which.
    verdict = blame_hang(waiting[:2], job_nodes=("n1", "n2", "n3", "n4"))
    assert verdict.node != "n3" or verdict.confidence < CONFIDENCE_HANG_OUTSIDE_COLLECTIVE
    # A reported rank outside the collective is evidence enough: the usual comparison.
    mixed = (*waiting[:2], s("n4", 3, None, False, 5.0))
    assert blame_hang(mixed, job_nodes=("n1", "n2", "n3", "n4")).node == "n4"


def test_one_users_two_blames_are_no_lemon_and_the_node_returns_after_probation():
    from supervisor.core.probation import NodeHistory, is_lemon, release

    blames = (NOW - 2 * NODE_DAY, NOW - 4000)
    alone = NodeHistory("n7", blames, NOW - 4000, "42", 2, blame_users=("alice", "alice"))
    assert not is_lemon(alone, NOW, Policy())
    assert release(alone, True, NOW, Policy()) is not None
    two = NodeHistory("n7", blames, NOW - 4000, "42", 2, blame_users=("alice", "bob"))
    assert is_lemon(two, NOW, Policy())
    assert release(two, True, NOW, Policy()) is None
    assert is_lemon(alone, NOW, Policy(lemon_users=1))  # the setting keeps the old rule
