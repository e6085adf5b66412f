"""Table tests of the decision core's causes, with a fixed NOW and no OS.

Crashes and exceptions, drains and drain tickets within the hourly share, lost and
unhealthy nodes, the restart budget and backoff, checkpoint fallback, cancel and bad
settings. The exit evidence window, hangs and stragglers, Slurm's own states, growing
back, and the random-sequence properties each have a ``test_policy_*.py`` of their own.
"""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from agent.wire.errors import ConfigError
from agent.wire.protocol import EventKind
from supervisor.core.drains import drain_limit
from supervisor.core.intents import (
    Alert,
    DrainNode,
    DrainTicket,
    RelaunchStep,
    RequeueSmaller,
    Severity,
    ShrinkAllocation,
    StopJob,
    StopRanks,
    ValidateCheckpoints,
    ValidationLevel,
)
from supervisor.core.model import Cause, ClusterView, JobState
from supervisor.core.observations import (
    CancelRequested,
    CheckpointCommitted,
    CheckpointValidated,
    CheckpointWritten,
    HealthCheckFailed,
    LeaseExpired,
    RelaunchFinished,
    SlurmNodeSeen,
    StepProgress,
    Tick,
    WorldMismatched,
)
from supervisor.core.policy import Policy, decide, permits
from tests.unit.policy_world import (
    CKPT,
    CLUSTER,
    FOUR,
    NODES,
    NOW,
    POLICY,
    kinds,
    rank_exit,
    run,
    running,
)


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
        CheckpointCommitted("node1", "e", NOW, step=200, path="/c/200"),
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


def test_on_four_nodes_the_default_share_drains_a_sigkilled_ranks_node():
    # 0.1 of 4 nodes rounds down to no drain; the floor of one drain per hour acts.
    defaults = replace(Policy(), exit_evidence_window_s=0.0, corroborate_drains=False)
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


def test_blames_of_three_nodes_from_two_jobs_in_the_window_are_a_storm_drained_by_none():
    # Job 42 blames node3; node1 (job 7) and node2 (job 42, earlier) were blamed before.
    earlier = (("node1", "7"), ("node2", "42"))
    (crash,) = run(running(), rank_exit(sig=9), cluster=replace(CLUSTER, recent_blames=earlier))
    assert DrainNode not in kinds(crash) and DrainTicket not in kinds(crash)
    alert = crash.intents[0]
    assert isinstance(alert, Alert) and alert.severity is Severity.CRITICAL
    assert alert.message.startswith("drain storm: 3 nodes blamed by 2 jobs within 600 s")
    assert "the storm brake holds" in crash.explanation
    assert crash.record.recovery is not None and "node3" in crash.record.recovery.exclude


def test_a_storm_alerts_once_the_blames_after_its_start_are_only_excluded():
    earlier = (("node1", "7"), ("node2", "8"), ("node4", "9"))
    (crash,) = run(running(), rank_exit(sig=9), cluster=replace(CLUSTER, recent_blames=earlier))
    assert not any(isinstance(i, Alert | DrainNode | DrainTicket) for i in crash.intents)
    assert "the storm brake holds (4 nodes blamed by 4 jobs" in crash.explanation


def test_one_jobs_blames_alone_are_no_storm():
    earlier = (("node1", "42"), ("node2", "42"))
    (crash,) = run(running(), rank_exit(sig=9), cluster=replace(CLUSTER, recent_blames=earlier))
    assert kinds(crash)[0] is DrainNode


def test_storm_nodes_zero_turns_the_brake_off_and_one_is_refused():
    earlier = (("node1", "7"), ("node2", "8"))
    off = replace(POLICY, storm_nodes=0)
    cluster = replace(CLUSTER, recent_blames=earlier)
    (crash,) = run(running(), rank_exit(sig=9), policy=off, cluster=cluster)
    assert kinds(crash)[0] is DrainNode
    with pytest.raises(ConfigError, match="storm_nodes 1 would call every blame a storm"):
        Policy(storm_nodes=1)


def test_a_user_whose_jobs_blamed_five_nodes_in_the_window_is_flagged_and_drains_no_more():
    alices = replace(running(), slurm_user="alice")
    earlier = (*(("alice", f"node{i}") for i in (1, 2, 4, 5)), ("bob", "node6"))
    cluster = replace(CLUSTER, user_blames=earlier)
    (crash,) = run(alices, rank_exit(sig=9), cluster=cluster)
    assert DrainNode not in kinds(crash) and DrainTicket not in kinds(crash)
    alert = crash.intents[0]
    assert isinstance(alert, Alert) and alert.severity is Severity.CRITICAL
    assert alert.message.startswith("user flagged: jobs of alice blamed 5 nodes within 7 d")
    assert "excluded, not drained" in crash.explanation
    assert crash.record.recovery is not None and "node3" in crash.record.recovery.exclude
    # Once flagged, a further blame is only excluded, with no new alert.
    more = replace(cluster, user_blames=(*earlier, ("alice", "node3")))
    (again,) = run(replace(alices, job_id="43"), rank_exit(sig=9), cluster=more)
    assert not any(isinstance(i, Alert | DrainNode) for i in again.intents)
    # Bob's blame, and alice's below the bar, drain as before.
    (bobs,) = run(replace(running(), slurm_user="bob"), rank_exit(sig=9), cluster=cluster)
    assert kinds(bobs)[0] is DrainNode
    fewer = replace(CLUSTER, user_blames=earlier[:3])
    assert kinds(run(alices, rank_exit(sig=9), cluster=fewer)[0])[0] is DrainNode


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
    event = HealthCheckFailed("node4", "e", NOW, detail="ECC errors")
    crash, chosen = run(running(), event, CheckpointValidated(100, CKPT, True))
    assert crash.cause is Cause.HEALTH_CHECK and isinstance(crash.intents[0], DrainNode)
    assert chosen.intents == (
        ShrinkAllocation("42", 2, ("node1", "node2", "node3")),
        RelaunchStep("42", 2, ("node1", "node2", "node3"), CKPT),
    )


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


def test_a_first_fault_after_progress_relaunches_without_a_backoff():
    policy = replace(POLICY, backoff_base_s=10.0, backoff_max_s=100.0)
    _crash, chosen = run(
        running(step_at_last_restart=50),
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(100, CKPT, True),
        policy=policy,
    )
    assert chosen.record.not_before_s is None and RelaunchStep in kinds(chosen)


def test_a_checkpoint_the_script_wrote_itself_is_progress_for_the_budget_and_the_backoff():
    # An unchanged script or a framework saves its own checkpoints (checkpoint_written):
    # without them counted, its first fault waited the backoff and every restart
    # spent the budget however far it had trained.
    policy = replace(POLICY, backoff_base_s=10.0, backoff_max_s=100.0)
    first = running(last_step=None, last_checkpoint_path=None, step_at_last_restart=None)
    written = CheckpointWritten("node1", "w", NOW, step=40, path="/ckpt/out/ckpt.pt")
    (noted,) = run(first, written, policy=policy)
    assert noted.intents == () and noted.record.last_step == 40
    assert noted.record.last_checkpoint_path == "/ckpt/out/ckpt.pt"
    (older,) = run(noted.record, replace(written, step=30), policy=policy)
    assert older.record.last_step == 40
    _crash, chosen = run(
        noted.record,
        rank_exit(sig=signal.SIGKILL.value),
        CheckpointValidated(40, "/ckpt/out/ckpt.pt", True),
        policy=policy,
    )
    assert chosen.record.restarts_without_progress == 0
    assert chosen.record.not_before_s is None and RelaunchStep in kinds(chosen)


def test_backoff_holds_the_relaunch_until_a_tick_after_not_before():
    # A second fault with no newer checkpoint than the last restart's: a crash loop's start.
    policy = replace(POLICY, backoff_base_s=10.0, backoff_max_s=100.0)
    _crash, chosen = run(
        running(step_at_last_restart=100),
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


def test_cancel_request_stops_the_job():
    (seen,) = run(running(), CancelRequested("user asked"))
    assert seen.record.state is JobState.CANCELLED and kinds(seen) == [StopJob]


def test_a_terminal_job_ignores_everything():
    record = running(state=JobState.FAILED)
    assert decide(record, rank_exit(sig=9), NOW, POLICY, CLUSTER).intents == ()


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


def test_a_world_that_is_not_the_jobs_stops_the_job_as_failed_at_once_without_drain():
    event = WorldMismatched(
        "node2", "42/node2/abcdef01/3", NOW,
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


def test_an_observation_of_no_known_type_is_a_bug_not_a_tick() -> None:
    with pytest.raises(AssertionError):
        decide(running(), object(), NOW, POLICY, CLUSTER)  # type: ignore[arg-type]


def test_an_agent_event_the_core_takes_no_decision_on_is_refused_by_from_event() -> None:
    from agent.wire import protocol
    from supervisor.core.observations import from_event

    event = protocol.Event(EventKind.AGENT_STARTED, "42", "node2", "42/node2/ab/1", 1, NOW, {})
    with pytest.raises(ValueError, match="agent_started"):
        from_event(event)


def test_the_first_steps_of_a_job_read_as_a_start_and_after_a_relaunch_as_a_return() -> None:
    from supervisor.core.observations import StepProgress

    (first,) = run(running(state=JobState.STARTING, attempt=1), StepProgress(1))
    assert (first.record.state, first.explanation) == (JobState.RUNNING, "training started")
    (back,) = run(running(state=JobState.RELAUNCHING, attempt=2), StepProgress(101))
    assert back.explanation == "training steps again"
