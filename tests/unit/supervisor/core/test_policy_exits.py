"""The decision core's exit evidence window: peers of a dead rank fail moments later.

Exits are collected, in any report order, until the window closes or every node's
exits are in (its launcher ended, or its last rank's exit said none was left); the
earliest death is then the root cause (a node signal wins a tie), and one restart is
counted. Hang reports inside the window are evidence only.
"""

from __future__ import annotations

import signal
from dataclasses import replace

import pytest

from supervisor.core.blame import EXIT_TIE_TOLERANCE_S
from supervisor.core.intents import DrainNode, RelaunchStep, StopJob, StopRanks, ValidateCheckpoints
from supervisor.core.model import MAX_EXITS, Cause, JobState, record_from_json, record_to_json
from supervisor.core.observations import (
    AgentStopped,
    CheckpointValidated,
    LauncherExited,
    RankExited,
    RelaunchFinished,
    StepProgress,
    Tick,
)
from supervisor.core.policy import NODE_SIGNAL_EVIDENCE_S
from tests.unit.policy_world import (
    CKPT,
    FOUR,
    KILL,
    NODES,
    NOW,
    POLICY,
    hang,
    kinds,
    rank_exit,
    run,
    running,
)

# ---------------------------------------------------------------------------
# The exit evidence window: peers of a dead rank fail moments later, reported in any order.

WINDOW = replace(POLICY, exit_evidence_window_s=3.0, max_drain_share_per_hour=0.5)


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


def test_a_death_by_a_node_signal_closes_the_window_shortly_after_it_is_in():
    """Only a death before it could still be the root cause: the window waits
    NODE_SIGNAL_EVIDENCE_S for such a report, not for the peers' teardown."""
    peer = rank_exit("node1", code=1, digest="gloo", exit_time=NOW - 2.0)
    killed = rank_exit("node3", sig=KILL, exit_time=NOW - 2.2)
    opened, shortened = run(running(), peer, killed, policy=WINDOW, cluster=FOUR)
    assert opened.record.recovery is not None and shortened.record.recovery is not None
    assert opened.record.recovery.evidence_until_s == NOW + 3.0  # an exception: the window
    assert shortened.record.recovery.evidence_until_s == NOW + NODE_SIGNAL_EVIDENCE_S
    assert shortened.intents == ()
    # Opened by the death itself: the same.
    (alone,) = run(running(), killed, policy=WINDOW, cluster=FOUR)
    assert alone.record.recovery is not None
    assert alone.record.recovery.evidence_until_s == NOW + NODE_SIGNAL_EVIDENCE_S
    assert "for 0.5s" in alone.explanation
    # An earlier death reported within it is still the root cause.
    earlier = rank_exit("node2", sig=signal.SIGSEGV.value, exit_time=NOW - 2.5)
    (collected,) = run(alone.record, earlier, policy=WINDOW, cluster=FOUR, now=NOW + 0.3)
    assert collected.intents == ()
    (decided,) = run(
        collected.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + NODE_SIGNAL_EVIDENCE_S
    )
    assert kinds(decided) == [DrainNode, StopRanks, ValidateCheckpoints]
    assert isinstance(decided.intents[0], DrainNode) and decided.intents[0].node == "node2"
    # A window shorter already stays as short.
    short = replace(WINDOW, exit_evidence_window_s=0.2)
    (brief,) = run(running(), killed, policy=short, cluster=FOUR)
    assert brief.record.recovery is not None
    assert brief.record.recovery.evidence_until_s == NOW + 0.2


def _user_failure(now: float) -> tuple[RankExited, ...]:
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


def test_a_rank_stopped_while_it_unwound_its_exception_is_the_root_cause_not_a_peers_abort():
    """Seen with gloo: rank 1 raises; its closing connections make rank 0 abort, and
    torchrun SIGTERMs rank 1 while it still unwinds. The exits alone say a peer's
    SIGABRT came first; the rank's own note of its exception says who failed."""
    abort = signal.SIGABRT.value
    peer = rank_exit("node1", sig=abort, at=NOW - 1.9, exit_time=NOW - 2.0)
    raiser = rank_exit(
        "node2", sig=signal.SIGTERM.value, at=NOW - 1.8, exit_time=NOW - 1.92,
        raised=("RuntimeError", NOW - 2.3),
    )  # fmt: skip
    collecting = run(running(), peer, raiser, policy=WINDOW, cluster=FOUR)
    (decided,) = run(collecting[-1].record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert decided.cause is Cause.USER_EXCEPTION, decided.explanation
    assert kinds(decided) == [StopRanks, ValidateCheckpoints]  # no node blamed, none drained
    assert decided.record.signatures[-1].digest == "raised:RuntimeError"
    # Without the note the same exits blame the peer's abort, as before.
    plain = replace(raiser, raised=None, raised_time_s=None)
    before = run(running(), peer, plain, policy=WINDOW, cluster=FOUR)
    (blamed,) = run(before[-1].record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert blamed.cause is Cause.RANK_SIGNAL


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
    assert finished.intents == () and finished.record.state is JobState.RUNNING
    assert finished.record.finished_ranks == ((1, 1, 150),)  # noted for a clean end


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


def launcher_ended(
    node: str, kind: type[LauncherExited | AgentStopped] = LauncherExited
) -> LauncherExited | AgentStopped:
    return kind(node, f"42/{node}/abcdef01/9", NOW - 0.5)


def test_the_exit_window_closes_once_every_nodes_launcher_ended():
    """The killed rank's report comes last; the window waits for it, not for the clock."""
    peers = [rank_exit(n, code=1, digest="gloo", exit_time=NOW - 2.0) for n in ("node1", "node2")]
    observations = [
        *peers,
        launcher_ended("node1"),
        launcher_ended("node1", AgentStopped),  # the same node: still waiting
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


def test_the_exit_window_closes_once_every_nodes_last_rank_exited_without_their_launchers():
    """A node whose last rank's exit says none is left (``ranks_left`` 0) has reported all
    its exits: the window closes once every node has, without waiting for the launchers'
    teardown. A node with a rank still running (``ranks_left`` 1) is waited for."""
    killed = replace(rank_exit("node3", sig=KILL, exit_time=NOW - 3.0), ranks_left=0)
    peers = [
        replace(rank_exit(n, code=1, digest="gloo", exit_time=NOW - 2.0), ranks_left=0)
        for n in ("node1", "node2")
    ]
    one_left = replace(rank_exit("node4", code=1, exit_time=NOW - 2.0), ranks_left=1)
    opened, *collecting = run(running(), killed, *peers, one_left, policy=WINDOW, cluster=FOUR)
    assert opened.record.recovery is not None and opened.record.recovery.settled == ("node3",)
    assert all(d.intents == () for d in (opened, *collecting))
    last = collecting[-1].record
    assert last.recovery is not None and last.recovery.settled == ("node1", "node2", "node3")
    node4_done = replace(
        rank_exit("node4", code=1, exit_time=NOW - 1.9), global_rank=7, ranks_left=0
    )
    (decided,) = run(last, node4_done, policy=WINDOW, cluster=FOUR)
    assert decided.cause is Cause.RANK_SIGNAL  # at NOW: well before the window's end
    assert kinds(decided) == [DrainNode, StopRanks, ValidateCheckpoints]
    assert isinstance(decided.intents[0], DrainNode) and decided.intents[0].node == "node3"
    # Without the count (an agent that did not know its ranks), the launchers decide.
    unknown = [replace(exit_seen, ranks_left=None) for exit_seen in (killed, *peers)]
    *_, waiting = run(running(), *unknown, policy=WINDOW, cluster=FOUR)
    assert waiting.intents == () and waiting.record.recovery is not None
    assert waiting.record.recovery.settled == ()


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


# ---------------------------------------------------------------------------
# A clean end: one rank dies in its teardown after every rank reached the last step.

ABRT = signal.SIGABRT.value


def test_a_rank_aborting_in_teardown_after_every_peer_finished_the_last_step_completes_the_job():
    finished = [rank_exit(node, code=0, step=120, at=NOW - 2.0) for node in ("node1", "node2")]
    aborted = rank_exit("node3", sig=ABRT, step=120, at=NOW - 1.5)
    late = rank_exit("node4", code=0, step=120, at=NOW - 1.0)  # inside the window
    *_, window_open, _ = run(running(), *finished, aborted, late, policy=WINDOW, cluster=FOUR)
    assert window_open.record.state is JobState.RECOVERING
    (closed,) = run(window_open.record, late, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)[1:]
    assert closed.record.state is JobState.COMPLETED, closed.explanation
    assert kinds(closed) == [StopJob] and closed.intents[0].status is JobState.COMPLETED
    assert "every rank reached step 120" in closed.explanation
    assert closed.record.restarts == () and closed.record.attempt == 1
    # Kept across a restart of the supervisor.
    assert record_from_json(record_to_json(closed.record)) == closed.record


@pytest.mark.parametrize(
    ("aborted", "why"),
    [
        (rank_exit("node3", sig=ABRT, step=119), "it died before the last step"),
        (rank_exit("node3", code=1, step=120), "an exit code, no signal: the script failed"),
        (rank_exit("node3", sig=ABRT, step=120, raised=("RuntimeError", NOW - 2)),
         "an exception of its own (a final save that raised)"),
    ],
)  # fmt: skip
def test_a_failure_that_is_no_clean_teardown_is_recovered_from(aborted: RankExited, why: str):
    finished = [rank_exit(n, code=0, step=120, at=NOW - 2.0) for n in ("node1", "node2", "node4")]
    *_, opened = run(running(), *finished, aborted, policy=WINDOW, cluster=FOUR)
    (closed,) = run(opened.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert closed.record.state is not JobState.COMPLETED, why
    assert closed.intents and StopJob not in kinds(closed), why


def test_ranks_whose_scripts_all_ran_to_their_end_complete_the_job_however_torchrun_ended_them():
    """Rank 0's node hosted the rendezvous: its rank aborted in gloo's teardown, and the
    other nodes' torchruns, their store gone, sent SIGTERM to ranks that had finished."""
    aborted = rank_exit("node1", sig=ABRT, step=80, at=NOW - 2.0, ended=True)
    stopped = [rank_exit(n, sig=signal.SIGTERM.value, step=80, at=NOW - 1.5, ended=True)
               for n in ("node2", "node3", "node4")]  # fmt: skip
    *_, opened = run(running(), aborted, *stopped, policy=WINDOW, cluster=FOUR)
    (closed,) = run(opened.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert closed.record.state is JobState.COMPLETED, closed.explanation
    assert "every rank's script ran to its end at step 80" in closed.explanation
    assert closed.record.restarts == ()
    # One of them still training when it was stopped: a fault to recover from.
    mid_run = rank_exit("node4", sig=signal.SIGTERM.value, step=80, at=NOW - 1.5)
    *_, opened = run(running(), aborted, *stopped[:2], mid_run, policy=WINDOW, cluster=FOUR)
    (closed,) = run(opened.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert closed.record.state is JobState.RECOVERING


def test_a_teardown_death_while_a_peer_is_unaccounted_for_is_recovered_from():
    finished = [rank_exit(n, code=0, step=120, at=NOW - 2.0) for n in ("node1", "node2")]
    aborted = rank_exit("node3", sig=ABRT, step=120)
    *_, opened = run(running(), *finished, aborted, policy=WINDOW, cluster=FOUR)
    (closed,) = run(opened.record, Tick(), policy=WINDOW, cluster=FOUR, now=NOW + 3)
    assert closed.record.state is JobState.RECOVERING and closed.cause is Cause.RANK_SIGNAL
    assert kinds(closed) == [StopRanks, ValidateCheckpoints]  # a recovery, not an end
