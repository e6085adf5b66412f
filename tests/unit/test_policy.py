"""Table tests of the decision core: every cause, with a fixed NOW and no OS."""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.wire.errors import ConfigError
from agent.wire.protocol import EventKind
from supervisor.core.blame import EXIT_TIE_TOLERANCE_S
from supervisor.core.intents import (
    Alert,
    DrainNode,
    DrainTicket,
    RelaunchStep,
    RequeueSmaller,
    ShrinkAllocation,
    StopJob,
    StopRanks,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import (
    MAX_EXITS,
    TRANSITIONS,
    Cause,
    ClusterView,
    JobRecord,
    JobState,
    new_record,
    record_from_json,
    record_to_json,
)
from supervisor.core.observations import (
    AgentEvent,
    CancelRequested,
    CheckpointValidated,
    Culprit,
    LeaseExpired,
    Observation,
    RelaunchFinished,
    SlurmJobSeen,
    SlurmNodeSeen,
    StepProgress,
    Tick,
)
from supervisor.core.policy import Decision, Policy, decide, permits
from supervisor.core.recovery import drain_limit

NOW = 1_000_000.0
NODES = ("node1", "node2", "node3", "node4")
CLUSTER = ClusterView(usable=frozenset(f"node{i}" for i in range(1, 21)))
# Evidence windows closed: every fault is decided on the observation that reports it.
POLICY = Policy(
    backoff_base_s=0.0,
    backoff_max_s=0.0,
    hang_evidence_window_s=0.0,
    exit_evidence_window_s=0.0,
)
CKPT = "/ckpt/step-100"


def running(**changes: object) -> JobRecord:
    record = replace(
        new_record("42", 4, NOW - 3600, min_nodes=2),
        state=JobState.RUNNING,
        nodes=NODES,
        last_step=100,
        last_checkpoint_path=CKPT,
    )
    return replace(record, **changes)  # type: ignore[arg-type]


def rank_exit(
    node: str = "node3",
    *,
    sig: int | None = None,
    code: int | None = None,
    step: int = 150,
    digest: str | None = None,
    at: float = NOW - 1,
    exit_time: float | None = None,
) -> AgentEvent:
    return AgentEvent(
        EventKind.RANK_EXITED,
        node,
        f"42/{node}/abcdef01/1",
        at,
        global_rank=int(node[-1]) - 1,
        exit_code=code,
        signal=sig,
        step=step,
        error_digest=digest,
        exit_time_s=exit_time,
    )


def run(
    record: JobRecord,
    *observations: Observation,
    policy: Policy = POLICY,
    cluster: ClusterView = CLUSTER,
    now: float = NOW,
) -> list[Decision]:
    """Feed observations in order, checking each transition against TRANSITIONS."""
    decisions = []
    for observation in observations:
        decision = decide(record, observation, now, policy, cluster)
        after = decision.record.state
        assert after is record.state or after in TRANSITIONS[record.state]
        record = decision.record
        decisions.append(decision)
    return decisions


def kinds(decision: Decision) -> list[type]:
    return [type(intent) for intent in decision.intents]


def test_rank_killed_by_sigkill_drains_its_node_and_relaunches_three_nodes_from_the_newest_valid():
    crash, validated = run(
        running(), rank_exit(sig=signal.SIGKILL.value), CheckpointValidated(100, CKPT, True)
    )
    assert crash.record.state is JobState.RECOVERING
    assert crash.cause is Cause.RANK_SIGNAL
    assert kinds(crash) == [DrainNode, StopRanks, ValidateCheckpoints]
    drain = crash.intents[0]
    assert isinstance(drain, DrainNode) and drain.node == "node3"
    assert drain.slurm_reason.startswith("resurgo: rank_signal job=42")
    assert drain.action_id == "42/2/drain/node3"
    assert validated.record.state is JobState.RELAUNCHING
    assert validated.intents == (
        ShrinkAllocation("42", 2, ("node1", "node2", "node4")),
        RelaunchStep("42", 2, ("node1", "node2", "node4"), CKPT),
    )


def test_world_size_is_the_largest_healthy_multiple_of_the_unit():
    record = running(nodes=("n1", "n2", "n3", "n4", "n5", "n6"), original_nodes=6, unit=2)
    _crash, validated = run(
        record, rank_exit("n3", sig=signal.SIGSEGV.value), CheckpointValidated(100, CKPT, True)
    )
    (_shrink, relaunch) = validated.intents
    assert isinstance(relaunch, RelaunchStep)
    assert relaunch.nodes == ("n1", "n2", "n4", "n5")


@pytest.mark.parametrize(
    ("available", "original", "minimum", "unit", "expected"),
    [
        (3, 4, 2, 1, 3),
        (3, 4, 2, 2, 2),
        (7, 4, 1, 1, 4),
        (1, 4, 2, 1, None),
        (5, 8, 4, 4, 4),
        (3, 8, 4, 4, None),
    ],
)
def test_world_size_table(available, original, minimum, unit, expected):
    from supervisor.core.recovery import world_size

    record = running(original_nodes=original, min_nodes=minimum, unit=unit)
    assert world_size(available, record) == expected


def test_same_exception_at_same_step_twice_stops_the_job_as_a_crash_loop_without_drain():
    policy = replace(POLICY, user_exception_retries=5)
    first, chosen, _relaunched, _started, second = run(
        running(),
        rank_exit(code=1, digest="ValueError:abc"),
        CheckpointValidated(100, CKPT, True),
        RelaunchFinished(2, True),
        StepProgress(101),
        rank_exit(code=1, digest="ValueError:abc"),
        policy=policy,
    )
    assert first.cause is Cause.USER_EXCEPTION
    assert DrainNode not in kinds(first)
    assert chosen.intents == (RelaunchStep("42", 2, NODES, CKPT),)
    assert second.record.state is JobState.FAILED
    assert second.cause is Cause.CRASH_LOOP
    assert kinds(second) == [StopJob]
    assert "crash loop: ValueError:abc at step 150" in second.record.final_reason


def test_python_exception_gets_one_retry_then_a_different_one_without_progress_stops():
    first, _, _, second = run(
        running(),
        rank_exit(code=1, step=150, digest="a"),
        CheckpointValidated(100, CKPT, True),
        RelaunchFinished(2, True),
        rank_exit(code=1, step=120, digest="b"),
    )
    assert first.record.state is JobState.RECOVERING
    assert second.record.state is JobState.FAILED and second.cause is Cause.USER_EXCEPTION


def test_exception_retries_again_after_a_newer_checkpoint():
    _, _, _, commit, second = run(
        running(),
        rank_exit(code=1, step=150, digest="a"),
        CheckpointValidated(100, CKPT, True),
        RelaunchFinished(2, True),
        AgentEvent(EventKind.CHECKPOINT_COMMITTED, "node1", "e", NOW, step=200, path="/c/200"),
        rank_exit(code=1, step=250, digest="b"),
    )
    assert commit.record.state is JobState.RUNNING
    assert second.record.state is JobState.RECOVERING


def test_drain_beyond_the_hourly_share_alerts_instead():
    cluster = replace(CLUSTER, drains_last_hour=2)  # 10% of 20 nodes: 2 per hour
    (crash,) = run(running(), rank_exit(sig=signal.SIGBUS.value), cluster=cluster)
    assert DrainNode not in kinds(crash)
    assert kinds(crash)[0] is Alert
    assert crash.record.recovery is not None and "node3" in crash.record.recovery.exclude


FOUR = ClusterView(usable=frozenset(NODES))


def test_on_four_nodes_the_default_policy_drains_a_sigkilled_ranks_node():
    # 0.1 of 4 nodes rounds down to no drain; the floor of one drain per hour acts.
    defaults = replace(Policy(), exit_evidence_window_s=0.0)
    (crash,) = run(running(), rank_exit(sig=signal.SIGKILL.value), policy=defaults, cluster=FOUR)
    assert kinds(crash)[0] is DrainNode
    assert "drain node3" in crash.explanation


def test_a_drain_beyond_the_floor_alerts_naming_the_settings_to_change():
    defaults = replace(Policy(), exit_evidence_window_s=0.0)
    cluster = replace(FOUR, drains_last_hour=1)
    (crash,) = run(running(), rank_exit(sig=signal.SIGKILL.value), policy=defaults, cluster=cluster)
    assert DrainNode not in kinds(crash)
    alert = crash.intents[0]
    assert isinstance(alert, Alert)
    assert "node3 was not drained" in alert.message
    assert "the 1 the policy allows on 4 nodes" in alert.message
    assert "min_drains_per_hour 1" in alert.message
    assert "max_drain_share_per_hour 0.1" in alert.message
    assert "The job goes on without node3" in alert.message


def test_without_operator_rights_a_blamed_node_is_ticketed_and_excluded_never_drained():
    user = replace(FOUR, may_drain=False)
    crash, validated = run(
        running(),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(100, CKPT, True),
        cluster=user,
    )
    assert kinds(crash) == [DrainTicket, StopRanks, ValidateCheckpoints]
    ticket = crash.intents[0]
    assert isinstance(ticket, DrainTicket) and ticket.node == "node3"
    assert ticket.cause is Cause.RANK_SIGNAL and "SIGKILL" in ticket.evidence
    assert ticket.action_id == "42/2/ticket/node3"
    assert "drain ticket raised (no Slurm operator rights" in crash.explanation
    assert crash.record.blamed_nodes == ("node3",)
    # The job goes on without the node, on the three others.
    assert validated.intents == (
        ShrinkAllocation("42", 2, ("node1", "node2", "node4")),
        RelaunchStep("42", 2, ("node1", "node2", "node4"), CKPT),
    )


def test_without_operator_rights_no_drain_share_is_spent_or_alerted():
    # Drains of the last hour do not matter: a ticket is not a drain.
    user = replace(FOUR, may_drain=False, drains_last_hour=5)
    (crash,) = run(running(), rank_exit(sig=9), cluster=user)
    assert kinds(crash)[0] is DrainTicket
    assert not any(isinstance(i, Alert | DrainNode) for i in crash.intents)


def test_a_node_slurm_already_took_out_gets_no_ticket():
    user = replace(FOUR, may_drain=False, drained=frozenset({"node3"}))
    (crash,) = run(running(), rank_exit(sig=9), cluster=user)
    assert DrainTicket not in kinds(crash) and DrainNode not in kinds(crash)


def test_the_share_still_limits_a_large_cluster():
    forty = ClusterView(usable=frozenset(f"node{i}" for i in range(1, 41)))
    (fourth,) = run(running(), rank_exit(sig=9), cluster=replace(forty, drains_last_hour=3))
    assert kinds(fourth)[0] is DrainNode
    (fifth,) = run(running(), rank_exit(sig=9), cluster=replace(forty, drains_last_hour=4))
    assert kinds(fifth)[0] is Alert


@pytest.mark.parametrize(
    ("nodes", "share", "floor", "expected"),
    [
        (4, 0.1, 1, 1),  # the share alone: 0
        (9, 0.1, 1, 1),
        (10, 0.1, 1, 1),
        (40, 0.1, 1, 4),  # the share wins above the floor
        (100, 0.05, 2, 5),
        (10, 0.0, 3, 3),
        (4, 0.1, 0, 0),  # no floor: the share alone, as before
        (0, 0.1, 1, 1),
    ],
)
def test_drains_per_hour_are_the_share_rounded_down_but_never_below_the_floor(
    nodes, share, floor, expected
):
    policy = Policy(max_drain_share_per_hour=share, min_drains_per_hour=floor)
    assert drain_limit(policy, nodes) == expected


def test_what_the_policy_permits_is_said_in_words_for_the_cluster_size():
    small = permits(Policy(), 4)
    assert small.startswith(
        "on 4 nodes: up to 1 drain per hour (min_drains_per_hour 1; the share 0.1 alone allows 0)"
    )
    assert "confidence >= 0.6" in small and "stragglers are reported, never drained" in small
    assert "stops after 3 restarts without progress" in small
    assert "blamed 2 times within 7 d stays out" in small
    assert permits(Policy(), 40).startswith(
        "on 40 nodes: up to 4 drains per hour (max_drain_share_per_hour 0.1)"
    )
    never = permits(Policy(min_drains_per_hour=0), 4)
    assert never.startswith("on 4 nodes: no drain at all")
    assert "raise either setting to drain" in never


def test_sigterm_of_a_rank_is_a_stop_not_a_fault():
    (seen,) = run(running(), rank_exit(sig=signal.SIGTERM.value))
    assert seen.record.state is JobState.RUNNING and seen.intents == ()


def test_sigabrt_is_too_weak_to_drain_but_still_restarts():
    (crash,) = run(running(), rank_exit(sig=signal.SIGABRT.value))
    assert crash.record.state is JobState.RECOVERING
    assert DrainNode not in kinds(crash)


# ---------------------------------------------------------------------------
# The exit evidence window: peers of a dead rank fail moments later, reported in any order.

WINDOW = replace(POLICY, exit_evidence_window_s=3.0, max_drain_share_per_hour=0.5)
FOUR = ClusterView(usable=frozenset(NODES))  # 50% of 4 nodes: two drains an hour
KILL = signal.SIGKILL.value


def test_a_sigkill_reported_after_its_peers_failures_is_the_root_cause_and_its_node_drained():
    peer1 = rank_exit("node1", code=1, digest="gloo", at=NOW - 2.0, exit_time=NOW - 2.7)
    peer2 = rank_exit("node2", code=1, digest="gloo", at=NOW - 1.9, exit_time=NOW - 2.6)
    killed = rank_exit("node3", sig=KILL, at=NOW - 0.5, exit_time=NOW - 3.0)
    first, _, third, again, early = run(
        running(), peer1, peer2, killed, killed, Tick(), policy=WINDOW, cluster=FOUR
    )
    assert first.record.state is JobState.RECOVERING and first.intents == ()
    assert first.cause is Cause.USER_EXCEPTION and third.cause is Cause.RANK_SIGNAL
    assert again.record == third.record  # the same exit reported twice is one exit
    assert early.intents == () and early.record == third.record  # the window is open at NOW
    assert (third.record.attempt, third.record.restarts) == (1, ())
    (decided,) = run(third.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert decided.cause is Cause.RANK_SIGNAL
    assert kinds(decided) == [DrainNode, StopRanks, ValidateCheckpoints]
    drain = decided.intents[0]
    assert isinstance(drain, DrainNode) and drain.node == "node3"
    assert drain.reason == (
        "rank 2 on node3 died by SIGKILL at step 150, first of 3 failed ranks; "
        "the others failed 0.3-0.4s later"
    )
    assert decided.record.attempt == 2 and decided.record.restarts == ((Cause.RANK_SIGNAL, 1),)
    assert decided.record.recovery is not None
    assert decided.record.recovery.evidence_until_s is None and decided.record.recovery.exits == ()
    (chosen,) = run(
        decided.record, CheckpointValidated(100, CKPT, True), policy=WINDOW, now=NOW + 3
    )
    assert chosen.intents[-1] == RelaunchStep("42", 2, ("node1", "node2", "node4"), CKPT)


def _user_failure(now: float) -> tuple[AgentEvent, ...]:
    """Rank 0 raises; torchrun stops node2's rank, node3's rank fails in gloo (reported first)."""
    return (
        rank_exit("node3", code=1, digest="gloo", at=now - 1.8, exit_time=now - 1.7),
        rank_exit("node2", sig=signal.SIGTERM.value, at=now - 1.5, exit_time=now - 1.6),
        rank_exit("node1", code=1, digest="ValueError:abc", at=now - 1.0, exit_time=now - 2.0),
    )


def test_a_user_exception_before_its_peers_failures_is_retried_without_drain_then_a_crash_loop():
    policy = replace(WINDOW, user_exception_retries=5)
    collecting = run(running(), *_user_failure(NOW), policy=policy, cluster=FOUR)
    assert all(d.intents == () for d in collecting)
    (first,) = run(collecting[-1].record, Tick(), policy=policy, cluster=FOUR, now=NOW + 3)
    assert first.cause is Cause.USER_EXCEPTION
    assert kinds(first) == [StopRanks, ValidateCheckpoints]
    assert first.record.signatures[-1].digest == "ValueError:abc"
    relaunched = run(
        first.record,
        CheckpointValidated(100, CKPT, True),
        RelaunchFinished(2, True),
        StepProgress(101),
        policy=policy,
        cluster=FOUR,
        now=NOW + 4,
    )
    assert relaunched[0].intents == (RelaunchStep("42", 2, NODES, CKPT),)
    later = NOW + 100
    again = run(
        relaunched[-1].record, *_user_failure(later), policy=policy, cluster=FOUR, now=later
    )
    (second,) = run(again[-1].record, Tick(), policy=policy, cluster=FOUR, now=later + 3)
    assert second.record.state is JobState.FAILED and second.cause is Cause.CRASH_LOOP
    assert kinds(second) == [StopJob]
    assert "ValueError:abc at step 150 again (rank 0 on node1)" in second.record.final_reason


def test_without_an_exit_window_the_first_exit_reported_decides_as_before():
    peer = rank_exit("node1", code=1, exit_time=NOW - 2.0)
    killed = rank_exit("node3", sig=KILL, exit_time=NOW - 3.0)
    first, late = run(running(), peer, killed, cluster=FOUR)
    assert first.cause is Cause.USER_EXCEPTION and first.record.attempt == 2
    assert kinds(first) == [StopRanks, ValidateCheckpoints]
    assert first.record.recovery is not None and first.record.recovery.exits == ()
    assert late.intents == () and late.record == first.record


@pytest.mark.parametrize(
    ("kill_after_s", "cause", "drained"),
    [
        (-0.5, Cause.RANK_SIGNAL, True),  # killed first
        (EXIT_TIE_TOLERANCE_S - 0.01, Cause.RANK_SIGNAL, True),  # a tie: the node signal wins
        (EXIT_TIE_TOLERANCE_S + 0.01, Cause.USER_EXCEPTION, False),  # plainly after the raise
        (0.5, Cause.USER_EXCEPTION, False),
    ],
)
def test_the_earliest_death_is_the_root_cause_and_a_node_signal_wins_a_tie(
    kill_after_s, cause, drained
):
    raised = rank_exit("node1", code=1, exit_time=NOW - 2.0)
    killed = rank_exit("node3", sig=KILL, exit_time=NOW - 2.0 + kill_after_s)
    opened, collected = run(running(), raised, killed, policy=WINDOW, cluster=FOUR)
    (decided,) = run(collected.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert opened.cause is Cause.USER_EXCEPTION
    assert decided.cause is cause
    assert (DrainNode in kinds(decided)) is drained


def test_exits_without_an_exit_time_are_ordered_by_when_they_were_reported():
    raised = rank_exit("node1", code=1, at=NOW - 4.0)
    killed = rank_exit("node3", sig=KILL, at=NOW - 5.0)
    _, collected = run(running(), raised, killed, policy=WINDOW, cluster=FOUR)
    (decided,) = run(collected.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert decided.cause is Cause.RANK_SIGNAL
    assert isinstance(decided.intents[0], DrainNode) and decided.intents[0].node == "node3"


def test_a_stop_signal_or_a_clean_exit_alone_opens_no_window():
    stopped, finished = run(
        running(),
        rank_exit(sig=signal.SIGTERM.value, exit_time=NOW - 3.0),
        rank_exit("node2", code=0, exit_time=NOW - 3.0),
        policy=WINDOW,
    )
    assert stopped.record == running() and stopped.intents == ()
    assert finished.record == running() and finished.intents == ()


def test_the_exit_window_counts_one_restart_when_it_closes_and_ignores_what_comes_too_late():
    record = running(step_at_last_restart=100, restarts_without_progress=1)
    opened, stale = run(
        record,
        rank_exit("node3", sig=KILL, exit_time=NOW - 1.0),
        CheckpointValidated(100, CKPT, True),
        policy=WINDOW,
        cluster=FOUR,
    )
    assert stale.record == opened.record and stale.intents == ()  # no validation was asked for
    assert opened.record.attempt == 1 and opened.record.restarts_without_progress == 1
    (decided,) = run(opened.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert decided.record.attempt == 2 and decided.record.restarts_without_progress == 2
    earlier = rank_exit("node4", sig=KILL, exit_time=NOW - 9.0)
    (late,) = run(decided.record, earlier, policy=WINDOW, cluster=FOUR, now=NOW + 4)
    assert late.record == decided.record and late.intents == ()


def test_the_exit_window_keeps_only_the_earliest_exits():
    exits = [rank_exit(f"node{1 + i % 4}", code=1, exit_time=NOW - i) for i in range(MAX_EXITS + 6)]
    *_, collected = run(running(), *exits, policy=WINDOW)
    assert collected.record.recovery is not None
    kept = [seen.died_at_s for seen in collected.record.recovery.exits]
    assert kept == [NOW - i for i in range(MAX_EXITS + 5, 5, -1)]


def launcher_ended(node: str, kind: EventKind = EventKind.LAUNCHER_EXITED) -> AgentEvent:
    return AgentEvent(kind, node, f"42/{node}/abcdef01/9", NOW - 0.5)


def test_the_exit_window_closes_once_every_nodes_launcher_ended():
    """The killed rank's report comes last; the window waits for it, not for the clock."""
    peers = [rank_exit(n, code=1, digest="gloo", exit_time=NOW - 2.0) for n in ("node1", "node2")]
    observations = [
        *peers,
        launcher_ended("node1"),
        launcher_ended("node1", EventKind.AGENT_STOPPED),  # the same node: still waiting
        launcher_ended("node2"),
        launcher_ended("node4"),  # its rank never failed: a clean launcher end settles it too
        rank_exit("node3", sig=KILL, exit_time=NOW - 3.0),
    ]
    *collecting, last_exit = run(running(), *observations, policy=WINDOW, cluster=FOUR)
    assert all(d.intents == () for d in collecting) and last_exit.intents == ()
    assert last_exit.record.recovery is not None
    assert last_exit.record.recovery.settled == ("node1", "node2", "node4")
    assert "exits still due from ['node3']" in collecting[-1].explanation
    (decided,) = run(last_exit.record, launcher_ended("node3"), policy=WINDOW, cluster=FOUR)
    assert decided.cause is Cause.RANK_SIGNAL  # at NOW: well before the window's end
    assert kinds(decided) == [DrainNode, StopRanks, ValidateCheckpoints]
    assert isinstance(decided.intents[0], DrainNode) and decided.intents[0].node == "node3"
    (after,) = run(decided.record, launcher_ended("node3"), policy=WINDOW, cluster=FOUR)
    assert after.record == decided.record and after.intents == ()


def test_a_launcher_end_outside_an_exit_window_changes_nothing():
    (ended,) = run(running(), launcher_ended("node2"), policy=WINDOW, cluster=FOUR)
    assert ended.record == running() and ended.intents == ()
    opened, stranger = run(
        running(),
        rank_exit("node3", sig=KILL, exit_time=NOW - 1.0),
        launcher_ended("node9"),  # not one of the job's nodes
        policy=WINDOW,
        cluster=FOUR,
    )
    assert stranger.record == opened.record


def test_a_settled_node_survives_the_record_round_trip():
    _, settled = run(
        running(),
        rank_exit("node3", sig=KILL, exit_time=NOW - 1.0),
        launcher_ended("node3"),
        policy=WINDOW,
        cluster=FOUR,
    )
    assert settled.record.recovery is not None and settled.record.recovery.settled == ("node3",)
    assert record_from_json(record_to_json(settled.record)) == settled.record


def test_a_hang_report_during_the_exit_window_is_evidence_only():
    opened, hung = run(
        running(),
        rank_exit(sig=KILL, exit_time=NOW - 1.0),
        hang("node1", 0, 500, True, 100.0),
        policy=WINDOW,
        cluster=FOUR,
    )
    assert hung.record == opened.record and hung.intents == ()
    (decided,) = run(hung.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert decided.cause is Cause.RANK_SIGNAL and DrainNode in kinds(decided)


def test_ranks_exiting_during_the_hang_window_leave_the_hang_to_be_blamed():
    policy = replace(WINDOW, hang_evidence_window_s=30.0)
    _, second, raised, killed = run(
        running(),
        hang("node1", 0, 500, True, 100.0),
        hang("node4", 3, 499, True, 120.0),
        rank_exit("node2", code=1, exit_time=NOW - 1.0),
        rank_exit("node3", sig=KILL, exit_time=NOW - 1.0),
        policy=policy,
        cluster=FOUR,
    )
    assert raised.record == second.record and killed.record == second.record
    (late,) = run(killed.record, Tick(), policy=policy, cluster=FOUR, now=NOW + 31)
    assert late.cause is Cause.HANG
    assert isinstance(late.intents[0], DrainNode) and late.intents[0].node == "node4"


def hang(node: str, rank: int, step: int, in_collective: bool, since: float) -> AgentEvent:
    culprit = Culprit(rank, step, in_collective, since, "behind")
    return AgentEvent(EventKind.HANG, node, f"42/{node}/abcdef01/7", NOW, culprits=(culprit,))


def test_hang_blames_the_rank_behind_across_nodes_after_the_evidence_window():
    policy = replace(POLICY, hang_evidence_window_s=30.0)
    first, second, early = run(
        running(),
        hang("node1", 0, 500, True, 100.0),
        hang("node4", 3, 499, True, 120.0),
        Tick(),
        policy=policy,
    )
    assert first.record.state is JobState.RECOVERING and first.intents == ()
    assert early.intents == ()  # the window is still open at NOW
    (late,) = run(second.record, Tick(), policy=policy, now=NOW + 31)
    assert kinds(late) == [DrainNode, StopRanks, ValidateCheckpoints]
    drain = late.intents[0]
    assert isinstance(drain, DrainNode) and drain.node == "node4" and drain.cause is Cause.HANG


def test_hang_without_a_standout_rank_restarts_without_drain():
    (decision,) = run(running(), hang("node1", 0, 500, True, 100.0))
    assert decision.record.state is JobState.RECOVERING
    assert kinds(decision) == [StopRanks, ValidateCheckpoints]


def test_lease_expiry_drains_the_node_and_relaunches_without_it():
    crash, chosen = run(running(), LeaseExpired("node2"), CheckpointValidated(100, CKPT, True))
    assert crash.cause is Cause.NODE_LOST
    assert isinstance(crash.intents[0], DrainNode) and crash.intents[0].node == "node2"
    relaunch = chosen.intents[-1]
    assert isinstance(relaunch, RelaunchStep) and relaunch.nodes == ("node1", "node3", "node4")


def test_slurm_down_node_is_excluded_without_a_drain_and_batch_host_loss_requeues():
    crash, chosen = run(
        running(), SlurmNodeSeen("node1", down=True), CheckpointValidated(100, CKPT, True)
    )
    assert DrainNode not in kinds(crash) and StopRanks not in kinds(crash)
    (requeue,) = chosen.intents
    assert isinstance(requeue, RequeueSmaller)
    assert requeue.exclude == ("node1",) and requeue.n_nodes == 4 and requeue.resume_from == CKPT
    assert chosen.record.state is JobState.REQUEUED


def test_health_check_failure_drains_and_relaunches_without_the_node():
    event = AgentEvent(EventKind.HEALTH_CHECK_FAILED, "node4", "e", NOW, detail="ECC errors")
    crash, chosen = run(running(), event, CheckpointValidated(100, CKPT, True))
    assert crash.cause is Cause.HEALTH_CHECK and isinstance(crash.intents[0], DrainNode)
    assert chosen.intents == (
        ShrinkAllocation("42", 2, ("node1", "node2", "node3")),
        RelaunchStep("42", 2, ("node1", "node2", "node3"), CKPT),
    )


def straggler(node: str = "node2") -> AgentEvent:
    return AgentEvent(EventKind.STRAGGLER, node, "e", NOW, global_rank=1, detail="2x median")


def test_straggler_is_reported_and_never_drained_by_default():
    decisions = run(running(), *[straggler()] * 5, straggler("node3"))
    # One alert per node: a straggler that lasts is counted, not alerted again.
    assert [kinds(d) for d in decisions] == [[Alert], [], [], [], [], [Alert]]
    assert all(d.cause is Cause.STRAGGLER for d in decisions)
    assert "reported (5x), not drained: 2x median" in decisions[4].explanation
    assert decisions[-1].record.straggler_reports == (("node2", 5), ("node3", 1))
    assert decisions[-1].record.state is JobState.RUNNING


def test_persistent_straggler_is_drained_when_configured():
    policy = replace(POLICY, straggler_drain=True, straggler_reports_to_drain=3)
    decisions = run(running(), *[straggler()] * 3, policy=policy)
    assert decisions[1].record.state is JobState.RUNNING
    assert kinds(decisions[2])[:2] == [Alert, DrainNode]
    drain = decisions[2].intents[1]
    assert isinstance(drain, DrainNode) and drain.node == "node2"
    assert drain.cause is Cause.STRAGGLER and "2x median" in drain.reason


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


def test_restart_without_progress_consumes_budget_and_exhaustion_stops_the_job():
    policy = replace(POLICY, max_restarts_without_progress=2)
    record = running(step_at_last_restart=100, restarts_without_progress=1)
    (crash,) = run(record, rank_exit(sig=signal.SIGKILL.value), policy=policy)
    assert crash.record.restarts_without_progress == 2
    exhausted = replace(crash.record, state=JobState.RUNNING, recovery=None)
    (stop,) = run(exhausted, rank_exit("node2", sig=signal.SIGKILL.value), policy=policy)
    assert stop.record.state is JobState.FAILED and stop.cause is Cause.BUDGET_EXHAUSTED
    assert kinds(stop) == [StopJob]


def test_restart_after_progress_resets_the_budget():
    record = running(step_at_last_restart=50, restarts_without_progress=3)
    (crash,) = run(record, rank_exit(sig=signal.SIGKILL.value))
    assert crash.record.restarts_without_progress == 0
    assert crash.record.step_at_last_restart == 100


def test_backoff_holds_the_relaunch_until_a_tick_after_not_before():
    policy = replace(POLICY, backoff_base_s=10.0, backoff_max_s=100.0)
    _crash, chosen = run(
        running(),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(100, CKPT, True),
        policy=policy,
    )
    assert chosen.intents == () and chosen.record.not_before_s == NOW + 10.0
    (early,) = run(chosen.record, Tick(), policy=policy, now=NOW + 5)
    (late,) = run(chosen.record, Tick(), policy=policy, now=NOW + 10)
    assert early.intents == ()
    assert RelaunchStep in kinds(late) and late.record.not_before_s is None


def test_invalid_newest_checkpoint_falls_back_to_the_previous_one():
    _crash, bad, good = run(
        running(last_step=200, last_checkpoint_path="/c/200"),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(200, "/c/200", False, "checksum mismatch"),
        CheckpointValidated(100, "/c/100", True),
    )
    assert bad.intents == (ValidateCheckpoints("42", 2, ValidationLevel.FULL, ("/c/200",)),)
    assert isinstance(good.intents[-1], RelaunchStep) and good.intents[-1].resume_from == "/c/100"


def test_no_valid_checkpoint_stops_the_job():
    _, none_left = run(
        running(), rank_exit(sig=signal.SIGKILL.value), CheckpointValidated(None, None, False)
    )
    assert none_left.record.state is JobState.FAILED and none_left.cause is Cause.NO_CHECKPOINT


def test_a_job_that_never_committed_restarts_from_scratch():
    _, chosen = run(
        running(last_step=None, last_checkpoint_path=None),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(None, None, False),
    )
    assert isinstance(chosen.intents[-1], RelaunchStep) and chosen.intents[-1].resume_from is None


def test_below_min_nodes_fails_the_job():
    record = running(min_nodes=4)
    cluster = ClusterView(usable=frozenset(NODES))
    _, chosen = run(
        record,
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(100, CKPT, True),
        cluster=cluster,
    )
    assert chosen.record.state is JobState.FAILED and chosen.cause is Cause.BELOW_MIN_NODES


def test_failed_fast_path_falls_back_to_requeue():
    _, _, failed = run(
        running(),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(100, CKPT, True),
        RelaunchFinished(2, False, "srun"),
    )
    assert failed.record.state is JobState.REQUEUED and kinds(failed) == [RequeueSmaller]


def test_a_relaunched_step_that_never_started_falls_back_to_requeue_once():
    _, _, started, never, again = run(
        running(),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(100, CKPT, True),
        RelaunchFinished(2, True),
        RelaunchFinished(2, False, "no agent of attempt 2 called in"),
        RelaunchFinished(2, False, "no agent of attempt 2 called in"),
    )
    assert started.record.state is JobState.STARTING
    assert never.record.state is JobState.REQUEUED and kinds(never) == [RequeueSmaller]
    assert never.cause is Cause.RELAUNCH_FAILED
    assert again.record == never.record and again.intents == ()  # reported twice: once


def test_lemons_are_never_used_again():
    cluster = replace(CLUSTER, lemons=frozenset({"node2"}))
    _, chosen = run(
        running(),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(100, CKPT, True),
        cluster=cluster,
    )
    assert chosen.intents[-1] == RelaunchStep("42", 2, ("node1", "node4"), CKPT)


# ---------------------------------------------------------------------------
# Back to the original size when free nodes exist: idle nodes turn a shrink into a requeue,
# and a job running below its original size grows back after a checkpoint commit.


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


def commit(step: int) -> AgentEvent:
    return AgentEvent(
        EventKind.CHECKPOINT_COMMITTED, "node1", f"c{step}", NOW, step=step, path=f"/c/{step}"
    )


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


def test_cancel_request_stops_the_job():
    (seen,) = run(running(), CancelRequested("user asked"))
    assert seen.record.state is JobState.CANCELLED and kinds(seen) == [StopJob]


def test_a_terminal_job_ignores_everything():
    record = running(state=JobState.FAILED)
    assert decide(record, rank_exit(sig=9), NOW, POLICY, CLUSTER).intents == ()


def test_submitted_job_starts_then_runs():
    record = new_record("42", 4, NOW)
    started, ran = run(record, SlurmJobSeen("RUNNING", NODES, 0), StepProgress(1))
    assert started.record.state is JobState.STARTING and ran.record.state is JobState.RUNNING


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_drain_share_per_hour", 1.5),
        ("min_drains_per_hour", -1),
        ("backoff_base_s", -1.0),
        ("straggler_drain", 1),
        ("drain_confidence", float("nan")),
        ("validation_level", "full"),
        ("grow_back", 1),
        ("straggler_factor", 1.0),
        ("straggler_min_steps", 0),
    ],
)
def test_bad_policy_is_a_config_error_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=field):
        Policy(**{field: value})


# ---------------------------------------------------------------------------
# Properties: any observation sequence keeps to TRANSITIONS and to the drain share.

_nodes = st.sampled_from((*NODES, "node9"))
_observations = st.one_of(
    st.builds(
        rank_exit,
        _nodes,
        sig=st.sampled_from([None, 6, 9, 11, 15]),
        code=st.sampled_from([None, 0, 1]),
        step=st.integers(100, 103),
        digest=st.sampled_from([None, "x"]),
        exit_time=st.one_of(st.none(), st.floats(NOW - 10, NOW)),
    ),
    st.builds(LeaseExpired, _nodes),
    st.builds(SlurmNodeSeen, _nodes, down=st.booleans()),
    st.builds(
        SlurmJobSeen,
        st.sampled_from(
            ["RUNNING", "PENDING", "PREEMPTED", "TIMEOUT", "NODE_FAIL", "COMPLETED", "FAILED"]
        ),
        st.just(NODES),
        st.integers(0, 3),
        st.sampled_from(["", "Preempted"]),
    ),
    st.builds(
        CheckpointValidated,
        st.sampled_from([None, 100]),
        st.sampled_from([None, CKPT, "/c/old"]),
        st.booleans(),
    ),
    st.builds(RelaunchFinished, st.integers(1, 4), st.booleans()),
    st.builds(StepProgress, st.integers(0, 500)),
    st.builds(
        hang, _nodes, st.integers(0, 3), st.integers(90, 110), st.booleans(), st.floats(0, 100)
    ),
    st.just(straggler()),
    st.just(AgentEvent(EventKind.HEALTH_CHECK_FAILED, "node2", "e", NOW)),
    st.builds(
        lambda s: AgentEvent(
            EventKind.CHECKPOINT_COMMITTED, "node1", "e", NOW, step=s, path=f"/c/{s}"
        ),
        st.integers(90, 200),
    ),
    st.just(Tick()),
    # Replies that fit the record (resolved in the test): the executor's usual answers.
    *[st.sampled_from(["relaunch_ok", "relaunch_failed", "valid", "running_again"])] * 4,
)


def _answer(token: Observation | str, record: JobRecord) -> Observation:
    if not isinstance(token, str):
        return token
    if token == "valid":
        return CheckpointValidated(100, CKPT, True)
    if token == "running_again":
        return SlurmJobSeen("RUNNING", NODES[:3], record.slurm_restart_count)
    return RelaunchFinished(record.attempt, token == "relaunch_ok")


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.tuples(_observations, st.floats(0, 120)), max_size=25),
    st.integers(4, 40),
    st.sampled_from([0.0, 0.1, 0.25]),
    st.sampled_from([0.0, 3.0]),
    st.integers(0, 4),
    st.integers(0, 2),
)
def test_random_observations_never_break_transitions_or_the_drain_share(
    steps, size, share, exit_window, idle, floor
):
    policy = replace(
        POLICY,
        max_drain_share_per_hour=share,
        min_drains_per_hour=floor,
        straggler_drain=True,
        backoff_base_s=5.0,
        backoff_max_s=60.0,
        hang_evidence_window_s=10.0,
        exit_evidence_window_s=exit_window,
    )
    cluster = ClusterView(
        usable=frozenset(f"node{i}" for i in range(1, size + 1)),
        # The job's own nodes are allocated, never idle; node9 is one of its own at times.
        idle=frozenset(f"node{i}" for i in range(max(10, size - idle + 1), size + 1)),
    )
    record, now, drained = running(nodes=NODES[:3]), NOW, 0
    for token, elapsed in steps:
        now += elapsed
        observation = _answer(token, record)
        decision = decide(
            record, observation, now, policy, replace(cluster, drains_last_hour=drained)
        )
        after = decision.record.state
        assert after is record.state or after in TRANSITIONS[record.state]
        drained += sum(isinstance(i, DrainNode) for i in decision.intents)
        assert drained <= max(int(share * size + 1e-9), floor)
        assert len({i.action_id for i in decision.intents}) == len(decision.intents)
        sizes = [i.n_nodes for i in decision.intents if isinstance(i, RequeueSmaller)]
        assert all(n <= record.original_nodes for n in sizes)
        if decision.cause is Cause.GROW:
            # A grow strictly enlarges the job, blames nothing and spends no budget.
            assert sizes and all(n > len(record.nodes) for n in sizes)
            assert DrainNode not in kinds(decision)
            assert decision.record.restarts_without_progress == record.restarts_without_progress
        pending = decision.record.recovery
        if pending is not None and pending.evidence_until_s is not None:
            # An open evidence window has counted no restart yet.
            assert decision.record.attempt == record.attempt
            assert len(pending.exits) <= MAX_EXITS
        record = decision.record


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
    assert chosen.intents == () and chosen.record.recovery.resume_from == CKPT


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


def test_a_world_that_is_not_the_jobs_stops_the_job_as_failed_at_once_without_drain():
    event = AgentEvent(
        EventKind.WORLD_MISMATCH, "node2", "42/node2/abcdef01/3", NOW,
        detail="rank 0 on node2 is in a world of 1 ranks; the job's is 3 nodes x 1 = 3",
    )  # fmt: skip
    decision = decide(running(), event, NOW, POLICY, CLUSTER)
    assert decision.record.state is JobState.FAILED
    assert decision.cause is Cause.WORLD_MISMATCH
    assert kinds(decision) == [StopJob]
    assert decision.record.final_reason.startswith(
        "rank 0 on node2 is in a world of 1 ranks; the job's is 3 nodes x 1 = 3: the launch "
        "command set its own node count"
    )


def test_a_world_mismatch_event_reads_as_what_the_rank_saw_against_the_job() -> None:
    from agent.wire import protocol
    from supervisor.core.observations import from_event

    payload = {"global_rank": 0, "pid": 77, "world_size": 1, "local_world_size": 2, "nnodes": 4}
    event = protocol.make_event(
        EventKind.WORLD_MISMATCH, "42", "node2", "abcdef0123456789", 3, NOW, payload
    )
    assert protocol.decode_event(protocol.encode_event(event)) == event
    assert from_event(event).detail == (
        "rank 0 on node2 is in a world of 1 ranks; the job's is 4 nodes x 2 = 8"
    )
    with pytest.raises(protocol.ProtocolError, match="world_size"):
        protocol.make_event(EventKind.WORLD_MISMATCH, "42", "node2", "abcdef0123456789", 3,
                            NOW, {**payload, "world_size": 0})  # fmt: skip
