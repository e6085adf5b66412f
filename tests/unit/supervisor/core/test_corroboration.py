"""Corroboration before a drain: one job's word takes a node out of that job only.

The core's side (``supervisor.core.drains``): under the default policy a
blame of one job raises the supervisor's own check of the node instead of a
drain or a ticket; Slurm's own report, or a second user's blame, drains at
once; a failed check drains (or tickets, or alerts past the hourly share)
with the check's output, a passed or expired one does nothing.
"""

from __future__ import annotations

import signal
from dataclasses import replace

from supervisor.core.drains import after_check, drain_at_once
from supervisor.core.intents import (
    Alert,
    CheckNode,
    DrainNode,
    DrainTicket,
    RelaunchStep,
    ShrinkAllocation,
    StopRanks,
    ValidateCheckpoints,
)
from supervisor.core.observations import CheckpointValidated, SlurmNodeSeen
from supervisor.core.policy import Policy
from supervisor.store import CheckResult, NodeCheckRow
from tests.unit.policy_world import CKPT, FOUR, NOW, POLICY, kinds, rank_exit, run, running

CHECKING = replace(POLICY, corroborate_drains=True)
KILL = signal.SIGKILL.value


def alice(**changes: object):
    return running(slurm_user="alice", **changes)


def test_one_jobs_sigkilled_rank_excludes_its_node_and_asks_for_a_check_not_a_drain():
    crash, validated = run(
        alice(), rank_exit(sig=KILL), CheckpointValidated(100, CKPT, True),
        policy=CHECKING, cluster=FOUR,
    )  # fmt: skip
    assert kinds(crash) == [CheckNode, StopRanks, ValidateCheckpoints]
    check = crash.intents[0]
    assert isinstance(check, CheckNode)
    assert (check.node, check.user, check.action_id) == ("node3", "alice", "42/2/check/node3")
    assert "died by SIGKILL" in check.evidence
    assert "drained only if the supervisor's own check of it fails" in crash.explanation
    assert crash.record.blamed_nodes == ("node3",)
    # The job goes on without the node all the same.
    assert validated.intents == (
        ShrinkAllocation("42", 2, ("node1", "node2", "node4")),
        RelaunchStep("42", 2, ("node1", "node2", "node4"), CKPT),
    )


def test_the_default_policy_checks_before_it_drains():
    assert Policy().corroborate_drains is True
    crash, *_ = run(
        alice(), rank_exit(sig=KILL), policy=replace(Policy(), exit_evidence_window_s=0)
    )
    assert DrainNode not in kinds(crash) and CheckNode in kinds(crash)


def test_without_operator_rights_one_jobs_word_is_checked_too_not_ticketed():
    crash, *_ = run(
        alice(), rank_exit(sig=KILL), policy=CHECKING, cluster=replace(FOUR, may_drain=False)
    )
    assert kinds(crash) == [CheckNode, StopRanks, ValidateCheckpoints]


def test_a_node_slurm_reports_not_responding_needs_no_check_slurm_took_it_out():
    seen = SlurmNodeSeen("node2", down=False, not_responding=True, drained=False)
    crash, *_ = run(alice(), seen, policy=CHECKING, cluster=FOUR)
    assert CheckNode not in kinds(crash) and DrainNode not in kinds(crash)
    assert "Slurm already took it out of service" in crash.explanation


def test_a_node_another_users_jobs_blamed_too_is_drained_at_once():
    blamed_by_bob = replace(FOUR, user_blames=(("bob", "node3"),))
    crash, *_ = run(alice(), rank_exit(sig=KILL), policy=CHECKING, cluster=blamed_by_bob)
    assert kinds(crash)[0] is DrainNode
    # Her own earlier blame of the node is still one user's word.
    by_herself = replace(FOUR, user_blames=(("alice", "node3"),))
    crash, *_ = run(alice(), rank_exit(sig=KILL), policy=CHECKING, cluster=by_herself)
    assert kinds(crash)[0] is CheckNode


def test_drain_at_once_says_why():
    from supervisor.core.blame import Blame
    from supervisor.core.model import Cause

    word = Blame("node3", Cause.RANK_SIGNAL, 0.8, ("rank 2 died",))
    assert drain_at_once(CHECKING, FOUR, word, "alice") is None
    assert drain_at_once(POLICY, FOUR, word, "alice") == "corroborate_drains is off"
    assert drain_at_once(CHECKING, FOUR, replace(word, hardware=True), "alice") == (
        "the evidence is Slurm's own"
    )
    two = replace(FOUR, user_blames=(("bob", "node3"), ("carol", "node3"), ("dan", "node1")))
    assert drain_at_once(CHECKING, two, word, "alice") == "jobs of bob, carol blamed it too"


def test_the_storm_brake_and_the_hourly_share_still_hold_before_any_check():
    storm = replace(FOUR, recent_blames=(("node1", "7"), ("node2", "8")))
    crash, *_ = run(alice(), rank_exit(sig=KILL), policy=CHECKING, cluster=storm)
    assert CheckNode not in kinds(crash) and DrainNode not in kinds(crash)
    assert "storm brake holds" in crash.explanation


def check_row(**changes: object) -> NodeCheckRow:
    row = NodeCheckRow(
        check_id=1, node="node3", job_id="42", attempt=2, cause="rank_signal",
        evidence="rank 2 on node3 died by SIGKILL at step 150", raised_s=NOW - 60,
        slurm_job_id=77, submitted_s=NOW - 50, ended_s=None, result=None, detail="",
        action_id="42/2/check/node3", slurm_user="alice",
    )  # fmt: skip
    return replace(row, **changes)  # type: ignore[arg-type]


def test_a_failed_check_drains_the_node_with_the_checks_output_as_evidence():
    (drain,) = after_check(check_row(), CheckResult.FAILED, "FAIL nhc: disk", CHECKING, FOUR)
    assert isinstance(drain, DrainNode)
    assert (drain.node, drain.job_id, drain.attempt, drain.user) == ("node3", "42", 2, "alice")
    assert drain.reason == (
        "rank 2 on node3 died by SIGKILL at step 150; failed the supervisor's check: FAIL nhc: disk"
    )
    assert "user=alice" in drain.slurm_reason


def test_a_drain_after_a_check_keeps_the_blames_rule_and_quote_within_slurms_reason():
    blame = "rank 5 on node3: hardware, rule site-gpu-fault: 'GPU 0000:3b:00.0 fell off the bus'"
    long_check = "FAIL /usr/sbin/nhc: " + "check_hw_eth eth0 missing; " * 20
    row = check_row(evidence=blame, cause="hardware")
    (drain,) = after_check(row, CheckResult.FAILED, long_check, CHECKING, FOUR)
    reason = drain.slurm_reason
    assert "site-gpu-fault" in reason and "fell off the bus" in reason
    assert "failed the supervisor's check: FAIL /usr/sbin/nhc" in reason


def test_a_ticket_after_a_check_keeps_a_long_blame_whole():
    blame = "rank 5 on node3: hardware, rule site-gpu-fault: '" + "x" * 150 + " end of quote'"
    row = check_row(evidence=blame, cause="hardware")
    (ticket,) = after_check(row, CheckResult.FAILED, "FAIL", CHECKING,
                            replace(FOUR, may_drain=False))  # fmt: skip
    assert isinstance(ticket, DrainTicket)
    assert ticket.evidence == f"{blame}; failed the supervisor's check: FAIL"


def test_a_passed_or_expired_check_drains_nothing():
    for result in (CheckResult.PASSED, CheckResult.EXPIRED):
        assert after_check(check_row(), result, "ok", CHECKING, FOUR) == ()


def test_a_failed_check_past_the_hourly_share_alerts_and_without_rights_tickets():
    (alert,) = after_check(
        check_row(), CheckResult.FAILED, "FAIL", CHECKING, replace(FOUR, drains_last_hour=1)
    )
    assert isinstance(alert, Alert) and "was not drained" in alert.message
    (ticket,) = after_check(
        check_row(), CheckResult.FAILED, "FAIL", CHECKING, replace(FOUR, may_drain=False)
    )
    assert isinstance(ticket, DrainTicket) and ticket.evidence.endswith(
        "failed the supervisor's check: FAIL"
    )
