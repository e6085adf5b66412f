"""The daemon's wiring with a fake Slurm: registration, stale reports and commands, probation.

The live behaviour (real Slurm, real torchrun) is tests/integration/test_recovery_live.py;
these pin the bookkeeping that decides what the core hears and what agents receive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import pytest

from agent.wire import protocol
from agent.wire.protocol import CommandKind, EventKind
from supervisor.core import hang_hold
from supervisor.core.intents import ValidationLevel
from supervisor.core.model import JobState
from supervisor.core.observations import RelaunchFinished
from supervisor.daemon import Supervisor
from supervisor.errors import SlurmUnavailable
from supervisor.jobs import write_job_dir
from supervisor.jobtable import TrackedJob
from supervisor.slurm.parse import NodeFlag, NodeState
from supervisor.store import Actor, Store
from supervisor.store.core import BACKGROUND_FALLBACK_PAGES
from tests.fakes.slurm import JOB, NODES
from tests.fakes.slurm import DaemonFakeSlurm as Slurm
from tests.fakes.slurm import node as slurm_node
from tests.unit.daemon_world import (
    NOW,
    event,
    killed,
    registered_and_running,
    run,
    spec,
    started,
)


def _node3_killed(supervisor: Supervisor, digit: str) -> dict[str, str]:
    """Every node's agent of attempt 1 started, then rank 2 on node3 SIGKILLed; the
    agents' incarnations by node."""
    agents = {node: f"00000000000000{digit}{i}" for i, node in enumerate(NODES)}
    for node, incarnation in agents.items():
        supervisor.intake.accept_events(JOB, [started(node, incarnation, 1)])
    supervisor.intake.accept_events(JOB, [killed("node3", agents["node3"], 2)])
    return agents


def test_a_submitted_job_is_registered_and_followed_into_starting(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        assert supervisor.intake.allocation(JOB) == frozenset(NODES)
        row = supervisor.store.get_job(JOB)
        assert row is not None and row.name == "toy" and row.min_nodes == 2
        assert supervisor.store.attempts_for(JOB)[0].nodes == NODES

    run(body, tmp_path)


def test_what_the_policy_permits_is_logged_at_start_and_again_when_the_cluster_size_changes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("policy ")]

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await supervisor.polling.poll()
        await supervisor.polling.poll()
        assert said() == [
            "policy on 4 nodes: up to 1 drain per hour (min_drains_per_hour 1; the share 0.1 "
            "alone allows 0); a node is drained when blamed with confidence >= 0.6; stragglers "
            "are reported, never drained; a job stops after 3 restarts without progress; a "
            "node blamed 2 times within 7 d stays out"
        ]
        slurm.nodes_by_name.update({f"node{i}": slurm_node(f"node{i}") for i in range(5, 21)})
        await supervisor.polling.poll()
        assert len(said()) == 2
        assert said()[1].startswith("policy on 20 nodes: up to 2 drains per hour")

    with caplog.at_level(logging.INFO, logger="resurgo.supervisor"):
        run(body, tmp_path, max_drain_share_per_hour=0.1)


def test_a_job_directory_owned_by_someone_else_than_the_jobs_user_is_refused(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        write_job_dir(supervisor.config.jobs_path, JOB, spec())
        await supervisor.polling.poll()
        assert JOB not in supervisor.jobs
        assert supervisor.store.get_job(JOB) is None

    run(body, tmp_path, user="mallory")


def test_no_job_is_registered_while_slurm_cannot_say_whose_it_is(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        write_job_dir(supervisor.config.jobs_path, JOB, spec())
        real_jobs = slurm.jobs

        async def unavailable() -> dict[int, Any]:
            raise SlurmUnavailable("squeue: slurmctld is down")

        slurm.jobs = unavailable  # type: ignore[method-assign]
        await supervisor.polling.poll()
        assert JOB not in supervisor.jobs  # the owner cannot be checked: wait
        slurm.jobs = real_jobs  # type: ignore[method-assign]
        await supervisor.polling.poll()
        assert JOB not in supervisor.jobs  # Slurm runs it for mallory: refused

    run(body, tmp_path, user="mallory")


def test_reports_of_an_earlier_attempts_agents_are_kept_but_not_decided_on(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        old = "00000000000000a1"
        supervisor.intake.accept_events(JOB, [started("node3", old, 1), killed("node3", old, 2)])
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert record.attempt == 2 and record.state.value == "recovering"
        assert slurm.calls[0][:2] == ("drain", "node3")
        # node2's agent of attempt 1 reports the same kind of death late: evidence only.
        late = "00000000000000b2"
        supervisor.intake.accept_events(JOB, [started("node2", late, 1), killed("node2", late, 1)])
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.attempt == 2
        assert [call[0] for call in slurm.calls].count("drain") == 1
        assert len(supervisor.store.events_for(JOB, kinds=[EventKind.RANK_EXITED])) == 2

    run(body, tmp_path)


def test_an_exit_window_closes_when_every_launcher_ended_not_when_the_clock_says(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        agents = _node3_killed(supervisor, "c")
        ended = {"exit_code": 1, "signal": None, "signal_name": None, "pid": 10}
        for node in NODES[:-1]:
            launcher = event(EventKind.LAUNCHER_EXITED, node, agents[node], 3, ended)
            supervisor.intake.accept_events(JOB, [launcher])
            await supervisor.deciding.settle()
            assert supervisor.jobs[JOB].record.attempt == 1  # still collecting exits
        last = NODES[-1]
        supervisor.intake.accept_events(
            JOB, [event(EventKind.LAUNCHER_EXITED, last, agents[last], 3, ended)]
        )
        await supervisor.deciding.settle()
        assert clock == [NOW]  # no time passed: the launchers' ends closed the window
        assert supervisor.jobs[JOB].record.attempt == 2
        assert slurm.calls[0][:2] == ("drain", "node3")

    run(body, tmp_path, exit_evidence_window_s=60)


def trace_commits(store: Store) -> list[str]:
    """Each COMMIT of ``store`` from now on, under the synchronous mode set last: FULL
    fsyncs, NORMAL does not (``set_trace_callback(None)`` ends the trace)."""
    commits: list[str] = []
    mode = [store._synchronous or "FULL"]

    def trace(statement: str) -> None:
        if statement.startswith("PRAGMA synchronous = "):
            mode[0] = statement.rsplit(" ", 1)[1]
        elif statement == "COMMIT":
            commits.append(mode[0])

    store._db.set_trace_callback(trace)
    return commits


def test_a_rank_that_computes_slower_than_the_others_is_reported_while_it_lasts(
    tmp_path: Path,
) -> None:
    def report(node: str, rank: int, compute_s: float) -> protocol.HeartbeatReport:
        status = protocol.RankStatus(
            rank, 0, 100 + rank, 12, "train", NOW, 1.0, 1.1, 1.0, 12, compute_s, 12
        )
        return protocol.HeartbeatReport(JOB, node, NOW, (status,), f"00000000000000d{rank}", 1)

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        for rank, node in enumerate(NODES):
            supervisor.intake.accept_heartbeat(JOB, report(node, rank, 0.9 if rank == 2 else 0.2))
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"
        commits = trace_commits(supervisor.store)
        await supervisor.timers.check_stragglers()
        await supervisor.deciding.settle()
        await supervisor.timers.check_stragglers()  # still slow: reported again, counted
        await supervisor.deciding.settle()
        supervisor.store._db.set_trace_callback(None)
        # A straggler's reports and its alert move nothing: none of their commits is fsynced.
        assert commits and set(commits) == {"NORMAL"}
        seen = supervisor.store.events_for(JOB, kinds=[EventKind.STRAGGLER])
        assert [(e.node, e.payload["global_rank"], e.payload["ratio"]) for e in seen] == [
            ("node3", 2, 4.5),
            ("node3", 2, 4.5),
        ]
        record = supervisor.jobs[JOB].record
        assert record.straggler_reports == (("node3", 2),)
        assert record.state.value == "running" and slurm.calls == []  # no drain by default
        alerts = supervisor.store.events_for(JOB, kinds=["alert"])
        assert len(alerts) == 1 and "straggler on node3" in alerts[0].payload["message"]

    run(body, tmp_path)


def test_only_records_that_move_the_job_are_fsynced_and_the_wal_is_left_to_a_thread(
    tmp_path: Path,
) -> None:
    def committed(seq: int, step: int):  # type: ignore[no-untyped-def]
        payload = {"step": step, "path": f"/nowhere/step_{step:08d}"}
        return event(EventKind.CHECKPOINT_COMMITTED, "node1", "00000000000000a1", seq, payload)

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        commits = trace_commits(supervisor.store)
        supervisor.intake.accept_events(JOB, [committed(1, 10)])  # starting -> running
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running" and "FULL" in commits
        commits.clear()
        supervisor.intake.accept_events(JOB, [committed(2, 20)])  # news only: no fsync
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.last_step == 20
        assert commits and set(commits) == {"NORMAL"}
        supervisor.store._db.set_trace_callback(None)
        assert supervisor.store.get_job(JOB).record["last_step"] == 20  # type: ignore[union-attr]
        fallback = supervisor.store._db.execute("PRAGMA wal_autocheckpoint").fetchall()
        assert fallback == [(BACKGROUND_FALLBACK_PAGES,)]
        await supervisor.timers.checkpoint_wal()
        pages, copied = supervisor.store.checkpoint_wal()
        assert pages == copied

    run(body, tmp_path)


def test_a_supervisor_held_up_gives_leases_the_time_back(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        status = protocol.RankStatus(0, 0, 100, 5, "train", NOW, 1.0, 1.1, 1.0, 5)
        report = protocol.HeartbeatReport(JOB, "node2", NOW, (status,), "00000000000000e1", 1)
        supervisor.intake.accept_heartbeat(JOB, report)
        await supervisor.timers.tick()
        # The loop was held up 20 s (an overload): the lease (30 s) gets them back.
        supervisor.timers.last_tick_mono = time.monotonic() - 20.0
        clock[0] = NOW + 40.0
        await supervisor.timers.tick()
        assert [lease.node for lease in supervisor.store.leases_for(JOB)] == ["node2"]
        clock[0] = NOW + 55.0  # 30 s + the 19 s held up are over: the node is lost
        await supervisor.timers.tick()
        assert supervisor.store.leases_for(JOB) == []

    run(body, tmp_path)


def test_a_relaunch_whose_agents_never_call_in_falls_back_to_requeue(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        first = "00000000000000f1"
        supervisor.intake.accept_events(
            JOB, [started("node3", first, 1), killed("node3", first, 2)]
        )
        await supervisor.deciding.settle()
        clock[0] += 11.0  # past the backoff
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert (record.attempt, record.state.value) == (2, "relaunching")
        # The driver confirms the new step, but Slurm keeps its nodes busy: no agent starts.
        await supervisor.deciding.apply(JOB, RelaunchFinished(2, True))
        assert supervisor.jobs[JOB].record.state.value == "starting"
        clock[0] += 59.0
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "starting"  # not yet
        clock[0] += 2.0
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "requeued"
        assert slurm.calls[-1][0] == "requeue_smaller", slurm.calls  # without node3

    run(body, tmp_path, relaunch_start_timeout_s=60.0)


def test_a_stop_for_the_old_launch_never_reaches_the_relaunched_agents(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        old, new = "00000000000000a1", "00000000000000c3"
        supervisor.intake.accept_events(JOB, [started("node1", old, 1)])
        supervisor.intake.accept_events(JOB, [started("node3", "00000000000000a3", 1),
                                       killed("node3", "00000000000000a3", 2)])  # fmt: skip
        await supervisor.deciding.settle()
        supervisor.intake.accept_events(JOB, [started("node1", new, 2)])
        assert supervisor.intake.commands_for(JOB, "node1", new) == []
        stops = supervisor.intake.commands_for(JOB, "node1", old)  # the old agent still calls in
        assert [command.kind for command in stops] == [CommandKind.STOP_RANKS]
        assert supervisor.intake.commands_for(JOB, "node1", old) == []  # once
        # An agent that named no attempt (started without the driver) gets every command.
        stops = supervisor.intake.commands_for(JOB, "node2", "00000000000000a2")
        assert [command.kind for command in stops] == [CommandKind.STOP_RANKS]
        # A relaunched agent known only from its heartbeat (its events still on the way).
        beat = protocol.HeartbeatReport(JOB, "node2", NOW, (), "00000000000000c2", attempt=2)
        supervisor.intake.accept_heartbeat(JOB, beat)
        assert supervisor.intake.commands_for(JOB, "node2", "00000000000000c2") == []
        supervisor.intake.accept_events(JOB, [started("node4", "00000000000000a4", 1)])
        stops = supervisor.intake.commands_for(JOB, "node4", "00000000000000a4")
        assert [command.kind for command in stops] == [CommandKind.STOP_RANKS]

    run(body, tmp_path)


def test_a_node_drained_once_returns_after_probation_when_healthy(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        supervisor.intake.accept_events(JOB, [started("node3", "00000000000000a3", 1),
                                       killed("node3", "00000000000000a3", 2)])  # fmt: skip
        await supervisor.deciding.settle()
        assert slurm.nodes_by_name["node3"].drained
        await supervisor.timers.probation()
        await supervisor.deciding.settle()
        assert slurm.nodes_by_name["node3"].drained  # probation not over
        clock[0] += 601
        await supervisor.timers.probation()
        await supervisor.deciding.settle()
        assert not slurm.nodes_by_name["node3"].drained
        (drain,) = supervisor.store.blame_history("node3")
        assert drain.undrained_by is Actor.SUPERVISOR

    run(body, tmp_path, probation_s=600.0)


def _beat(supervisor: Supervisor, node: str, at_s: float) -> None:
    status = protocol.RankStatus(0, 0, 100, 5, "train", at_s, 1.0, 1.1, 1.0, 5)
    incarnation = f"00000000000000{NODES.index(node) + 1:02x}"
    supervisor.intake.accept_heartbeat(
        JOB, protocol.HeartbeatReport(JOB, node, at_s, (status,), incarnation, 1)
    )


def _observed(supervisor: Supervisor) -> list[object]:
    seen: list[object] = []
    enqueue = supervisor.deciding.enqueue

    def record(job_id: str, observation: Any, *rest: Any) -> None:
        seen.append(observation)
        enqueue(job_id, observation, *rest)

    supervisor.deciding.enqueue = record  # type: ignore[method-assign]
    return seen


def test_every_agent_of_a_job_silent_at_once_blames_no_node_and_asks_slurm_again(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        clock[0] = NOW  # long after the supervisor's start: no restart grace
        for node in NODES:
            _beat(supervisor, node, NOW + NODES.index(node))
        seen = _observed(supervisor)
        clock[0] = NOW + 34.0  # node1's lease (30 s) expired, the others' nearly
        await supervisor.timers.tick()
        assert [type(o).__name__ for o in seen] == ["SilenceShared"]
        assert seen[0].nodes == tuple(NODES)  # type: ignore[attr-defined]
        # The leases count again from now; the next poll reports the job's Slurm state.
        assert [lease.last_seen_s for lease in supervisor.store.leases_for(JOB)] == [NOW + 34] * 4
        assert supervisor.jobs[JOB].last_seen is None
        await supervisor.deciding.settle()
        assert supervisor.store.drains_since(0) == []

    run(body, tmp_path, start_s=NOW - 60)


def test_one_agent_silent_while_its_peers_report_is_a_node_fault(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        clock[0] = NOW  # long after the supervisor's start: no restart grace
        for node in NODES:
            _beat(supervisor, node, NOW)
        seen = _observed(supervisor)
        clock[0] = NOW + 31.0
        for node in NODES[1:]:
            _beat(supervisor, node, NOW + 30.0)
        await supervisor.timers.tick()
        assert [type(o).__name__ for o in seen] == ["LeaseExpired"]
        assert seen[0].node == NODES[0]  # type: ignore[attr-defined]
        assert [lease.node for lease in supervisor.store.leases_for(JOB)] == list(NODES[1:])

    run(body, tmp_path, start_s=NOW - 60)


def _step_ended(supervisor: Supervisor, exit_code: int | None) -> Any:
    attempt = supervisor.jobs[JOB].record.attempt
    request = protocol.DriverRequest(
        JOB, protocol.DriverPhase.ENDED, attempt=attempt, exit_code=exit_code
    )
    return supervisor.intake.driver(JOB, request)


def test_the_drivers_failed_step_is_decided_on_when_no_agent_reports_for_a_lease(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        for node in NODES:
            _beat(supervisor, node, NOW)
        seen = _observed(supervisor)
        clock[0] = NOW + 1.0
        await _step_ended(supervisor, 1)  # the agents' reports may still be on their way
        clock[0] = NOW + 20.0
        await _step_ended(supervisor, None)  # an older driver says the code once only
        assert seen == []
        clock[0] = NOW + 32.0  # a lease since the driver first said so, no agent since
        await _step_ended(supervisor, None)
        assert [type(o).__name__ for o in seen] == ["StepEnded"]
        assert seen[0].exit_code == 1  # type: ignore[attr-defined]
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "recovering"
        assert supervisor.store.drains_since(0) == []

    run(body, tmp_path)


def test_the_drivers_failed_step_waits_while_the_agents_still_report(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        seen = _observed(supervisor)
        await _step_ended(supervisor, 137)
        clock[0] = NOW + 5.0
        _beat(supervisor, NODES[0], NOW + 5.0)  # theirs is the word: they name the culprit
        clock[0] = NOW + 40.0
        await _step_ended(supervisor, 137)
        await _step_ended(supervisor, 0)
        assert not [o for o in seen if type(o).__name__ == "StepEnded"]
        assert supervisor.jobs[JOB].record.state.value == "starting"

    run(body, tmp_path)


def _waiting(node: str, incarnation: str, rank: int, step: int, timeout_s: float = 8.0):  # type: ignore[no-untyped-def]
    payload = {
        "hung": [{"global_rank": rank, "local_rank": 0, "pid": 50 + rank, "last_step": step,
                  "phase": "train", "seconds_since_progress": 9.0, "timeout_s": timeout_s,
                  "detector": "heartbeat"}],
        "stacks": {str(rank): "Thread 1 (idle)\n  barrier"},
        "culprits": [{"global_rank": rank, "last_step": step, "in_collective": True,
                      "reason": "0 step(s) behind"}],
    }  # fmt: skip
    return event(EventKind.HANG, node, incarnation, 2, payload)


def _report(node: str, incarnation: str, rank: int, step: int, phase: str):  # type: ignore[no-untyped-def]
    status = protocol.RankStatus(rank, 0, 50 + rank, step, phase, NOW, 0.2, 0.3, 0.2, 10)
    return protocol.HeartbeatReport(JOB, node, NOW, (status,), incarnation, 1)


async def _training_then_rank_0_saving(supervisor: Supervisor) -> dict[str, str]:
    """Four agents (one rank each) training at step 10, then rank 0 on the first node
    saving; returns each node's agent incarnation."""
    await registered_and_running(supervisor)
    agents = {node: f"00000000000000a{i}" for i, node in enumerate(NODES)}
    for rank, node in enumerate(NODES):
        supervisor.intake.accept_events(JOB, [started(node, agents[node], 1)])
        supervisor.intake.accept_heartbeat(JOB, _report(node, agents[node], rank, 10, "train"))
    await supervisor.deciding.settle()
    saver = NODES[0]
    supervisor.intake.accept_heartbeat(JOB, _report(saver, agents[saver], 0, 10, "checkpoint"))
    return agents


def test_hang_reports_while_a_rank_elsewhere_saves_are_held_then_dropped_as_training_goes_on(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents = await _training_then_rank_0_saving(supervisor)
        for rank, node in enumerate(NODES[1:], start=1):
            supervisor.intake.accept_events(JOB, [_waiting(node, agents[node], rank, 10)])
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"
        assert len(supervisor.jobs[JOB].held_hangs) == 3
        for rank, node in enumerate(NODES):
            supervisor.intake.accept_heartbeat(JOB, _report(node, agents[node], rank, 11, "train"))
        clock[0] += 60.0
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].held_hangs == []
        assert supervisor.jobs[JOB].record.state.value == "running"
        assert supervisor.store.drains_since(0) == []
        assert any(
            "were waits" in row.detail["explanation"] for row in supervisor.store.decisions_for(JOB)
        )

    async def restarted(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        # The reports were named in a decision: a restart does not decide on them again.
        supervisor.load_jobs()
        await supervisor.polling.poll()
        await supervisor.deciding.replay_undecided()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"

    run(body, tmp_path)
    run(restarted, tmp_path, start_s=NOW + 120)


def test_held_hang_reports_are_decided_once_the_save_ended_without_progress(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents = await _training_then_rank_0_saving(supervisor)
        saver = NODES[0]
        supervisor.intake.accept_events(JOB, [_waiting(NODES[1], agents[NODES[1]], 1, 10)])
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"
        # The save ended, and nobody steps on: a lease later the report is decided on.
        supervisor.intake.accept_heartbeat(JOB, _report(saver, agents[saver], 0, 10, "train"))
        clock[0] += supervisor.config.lease_s + 1
        supervisor.intake.accept_heartbeat(JOB, _report(saver, agents[saver], 0, 10, "train"))
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].held_hangs == []
        assert supervisor.jobs[JOB].record.state.value != "running"

    run(body, tmp_path)


def test_held_hang_reports_wait_as_long_as_the_agents_hang_timeout_once_the_save_ended(
    tmp_path: Path,
) -> None:
    """The peers were reported after 90 s without progress: after the save they get 90 s
    again to step on, not just a lease (a loaded machine's first step is slow)."""

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents = await _training_then_rank_0_saving(supervisor)
        saver = NODES[0]
        supervisor.intake.accept_events(JOB, [_waiting(NODES[1], agents[NODES[1]], 1, 10, 90.0)])
        await supervisor.deciding.settle()
        supervisor.intake.accept_heartbeat(JOB, _report(saver, agents[saver], 0, 10, "train"))
        clock[0] += supervisor.config.lease_s + 1
        supervisor.intake.accept_heartbeat(JOB, _report(saver, agents[saver], 0, 10, "train"))
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"  # still patient
        clock[0] += 90.0 - supervisor.config.lease_s
        supervisor.intake.accept_heartbeat(JOB, _report(saver, agents[saver], 0, 10, "train"))
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].held_hangs == []
        assert supervisor.jobs[JOB].record.state.value != "running"

    run(body, tmp_path)


async def _training(supervisor: Supervisor) -> dict[str, str]:
    """Four agents (one rank each) training at step 10, each heard from once."""
    await registered_and_running(supervisor)
    agents = {node: f"00000000000000a{i}" for i, node in enumerate(NODES)}
    for rank, node in enumerate(NODES):
        supervisor.intake.accept_events(JOB, [started(node, agents[node], 1)])
        supervisor.intake.accept_heartbeat(JOB, _report(node, agents[node], rank, 10, "train"))
    await supervisor.deciding.settle()
    return agents


def test_hang_reports_that_come_before_the_savers_heartbeat_are_held_once_it_comes(
    tmp_path: Path,
) -> None:
    """On a loaded machine rank 0's heartbeat saying it saves may come after its peers'
    hang reports: they wait for a heartbeat from every other node, and are held."""

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents = await _training(supervisor)
        clock[0] += 9.0
        for rank, node in enumerate(NODES[1:], start=1):
            supervisor.intake.accept_events(JOB, [_waiting(node, agents[node], rank, 10)])
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"
        saver = NODES[0]
        supervisor.intake.accept_heartbeat(JOB, _report(saver, agents[saver], 0, 10, "checkpoint"))
        for rank, node in enumerate(NODES[1:], start=1):
            supervisor.intake.accept_heartbeat(JOB, _report(node, agents[node], rank, 10, "train"))
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"
        assert len(supervisor.jobs[JOB].held_hangs) == 3
        assert supervisor.jobs[JOB].unconfirmed == []

    run(body, tmp_path)


def test_hang_reports_are_decided_once_every_other_node_beat_and_nobody_is_busy(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents = await _training(supervisor)
        clock[0] += 9.0
        supervisor.intake.accept_events(JOB, [_waiting(NODES[1], agents[NODES[1]], 1, 10)])
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"
        for rank, node in enumerate(NODES):
            if node != NODES[1]:
                supervisor.intake.accept_heartbeat(
                    JOB, _report(node, agents[node], rank, 10, "train")
                )
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].unconfirmed == []
        assert supervisor.jobs[JOB].record.state.value == "recovering"

    run(body, tmp_path)


def test_a_hang_report_waits_a_lease_at_most_for_heartbeats(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents = await _training(supervisor)
        clock[0] += 9.0
        supervisor.intake.accept_events(JOB, [_waiting(NODES[1], agents[NODES[1]], 1, 10)])
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state.value == "running"
        clock[0] += supervisor.config.lease_s + 1
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].unconfirmed == []
        assert supervisor.jobs[JOB].record.state.value == "recovering"

    run(body, tmp_path)


def test_a_hang_report_does_not_wait_for_nodes_silent_past_their_heartbeat_period(
    tmp_path: Path,
) -> None:
    """Nodes that beat every second and were last heard 9 s ago are not waited for:
    their silence may be the hang itself."""

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents = await _training(supervisor)
        clock[0] += 1.0
        for rank, node in enumerate(NODES):
            supervisor.intake.accept_heartbeat(JOB, _report(node, agents[node], rank, 10, "train"))
        clock[0] += 9.0
        supervisor.intake.accept_events(JOB, [_waiting(NODES[1], agents[NODES[1]], 1, 10)])
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].unconfirmed == []
        assert supervisor.jobs[JOB].record.state.value == "recovering"

    run(body, tmp_path)


async def _with_a_spare(supervisor: Supervisor) -> TrackedJob:
    """Job JOB registered as a 3+1 job: three nodes of world, one spare."""
    write_job_dir(supervisor.config.jobs_path, JOB, replace(spec(), nodes=3, spares=1))
    await supervisor.polling.poll()
    await supervisor.deciding.settle()
    return supervisor.jobs[JOB]


def test_a_job_with_spares_launches_its_world_only_once_slurm_showed_the_allocation(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        job = await _with_a_spare(supervisor)
        seen = job.record
        assert (seen.nodes, seen.spare_nodes) == (NODES[:3], NODES[3:])
        assert supervisor.store.attempts_for(JOB)[0].nodes == NODES[:3]
        start = protocol.DriverRequest(JOB, protocol.DriverPhase.START)
        # Registered while Slurm had not shown the allocation yet: no split, so wait.
        job.record = replace(seen, state=JobState.SUBMITTED, nodes=(), spare_nodes=())
        early = await supervisor.intake.driver(JOB, start)
        assert early.action is protocol.DriverAction.WAIT
        assert early.reason == "waiting for Slurm's allocation"
        job.record = seen
        answer = await supervisor.intake.driver(JOB, start)
        assert answer.action is protocol.DriverAction.LAUNCH
        assert answer.nodes == NODES[:3]
        assert "1 spare(s) kept ready" in answer.reason

    run(body, tmp_path)


def test_the_idle_spares_are_checked_at_once_then_each_interval_and_a_failed_one_is_released(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        job = await _with_a_spare(supervisor)
        spare = NODES[3]
        running = protocol.DriverRequest(JOB, protocol.DriverPhase.RUNNING, attempt=1)
        # Not while the job starts: a check beside ranks still loading waits for them.
        assert (await supervisor.intake.driver(JOB, running)).check_spares == ()
        job.record = replace(job.record, state=JobState.RUNNING)
        assert (await supervisor.intake.driver(JOB, running)).check_spares == (spare,)
        assert (await supervisor.intake.driver(JOB, running)).check_spares == ()  # asked already
        clock[0] += supervisor.policy.spare_check_interval_s
        stale = protocol.DriverRequest(JOB, protocol.DriverPhase.RUNNING, attempt=2)
        assert (await supervisor.intake.driver(JOB, stale)).check_spares == ()  # not this attempt's
        assert (await supervisor.intake.driver(JOB, running)).check_spares == (spare,)
        report = protocol.DriverRequest(
            JOB, protocol.DriverPhase.SPARE_CHECK, attempt=1, checked=(spare,),
            unhealthy=((spare, "FAIL builtin:ckpt_root (0.01 s): not writable"),),
        )  # fmt: skip
        answer = await supervisor.intake.driver(JOB, report)
        assert answer.action is protocol.DriverAction.WAIT
        await supervisor.deciding.settle()
        assert job.record.spare_nodes == () and job.record.nodes == NODES[:3]
        assert job.record.blamed_nodes == (spare,)
        (decided,) = [
            d for d in supervisor.store.decisions_for(JOB)
            if "health check failed on idle spare" in d.detail.get("explanation", "")
        ]  # fmt: skip
        assert "not writable" in decided.detail["explanation"]
        clock[0] += supervisor.policy.spare_check_interval_s
        assert (await supervisor.intake.driver(JOB, running)).check_spares == ()  # none left

    run(body, tmp_path)


def _not_responding(name: str, *, down: bool = False) -> Any:
    flags = {NodeFlag.NOT_RESPONDING}
    return replace(
        slurm_node(name),
        state=NodeState.DOWN if down else NodeState.ALLOCATED,
        flags=frozenset(flags),
        flags_raw=tuple(flag.value for flag in flags),
    )


def test_a_not_responding_flag_is_no_lost_node_while_its_agent_still_calls_in(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        nodes = supervisor.jobs[JOB].record.nodes
        assert nodes, "the job's nodes are known"
        clock[0] = NOW
        for name in NODES:
            _beat(supervisor, name, NOW)
        seen = _observed(supervisor)
        flaky, gone = nodes[0], nodes[1]
        slurm.nodes_by_name[flaky] = _not_responding(flaky)
        await supervisor.polling.poll()
        assert [type(o).__name__ for o in seen] == []  # a missed ping: the agent calls in
        # Slurm marks it DOWN: lost, whatever its agent said last.
        slurm.nodes_by_name[flaky] = _not_responding(flaky, down=True)
        await supervisor.polling.poll()
        assert [(type(o).__name__, o.node) for o in seen] == [("SlurmNodeSeen", flaky)]  # type: ignore[attr-defined]
        # NOT_RESPONDING on a node whose agent has not called in for a lease: lost.
        clock[0] = NOW + supervisor.config.lease_s + 1
        for name in NODES:
            if name != gone:
                _beat(supervisor, name, clock[0])
        await supervisor.timers.tick()  # the daemon expires the silent agent's lease
        slurm.nodes_by_name[gone] = _not_responding(gone)
        await supervisor.polling.poll()
        assert [(type(o).__name__, o.node) for o in seen][1:] == [  # type: ignore[attr-defined]
            ("LeaseExpired", gone),
            ("SlurmNodeSeen", gone),
        ]

    run(body, tmp_path, start_s=NOW - 60)


def test_an_exit_window_is_closed_at_its_end_not_at_the_next_periodic_tick(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        _node3_killed(supervisor, "d")
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert record.state is JobState.RECOVERING and record.attempt == 1  # collecting
        clock[0] = record.recovery.evidence_until_s  # type: ignore[union-attr]
        await asyncio.sleep(0.5)  # the window's own timer; tick() is never called here
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.attempt == 2
        assert slurm.calls[0][:2] == ("drain", "node3")

    run(body, tmp_path, exit_evidence_window_s=0.3)


def test_the_driver_asks_again_soon_while_a_recovery_prepares_its_relaunch(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        assert (await _step_ended(supervisor, None)).retry_after_s == 2.0  # nothing to wait for
        _node3_killed(supervisor, "e")
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert record.state is JobState.RECOVERING and record.not_before_s is not None
        # Asked again right after the backoff (1.5 s), not 2 s later; then at once.
        answer = await _step_ended(supervisor, 1)
        assert answer.action is protocol.DriverAction.WAIT
        assert answer.retry_after_s == pytest.approx(min(2.0, record.not_before_s - NOW + 0.05))
        clock[0] = record.not_before_s
        assert (await _step_ended(supervisor, 1)).retry_after_s == pytest.approx(0.2)

    run(body, tmp_path, backoff_base_s=1.5)


def test_a_relaunch_names_the_rejected_newer_checkpoints_and_their_quarantine_becomes_events(
    tmp_path: Path,
) -> None:
    from tests.fakes.checkpoints import cut, hf_checkpoint

    root = tmp_path / "out"
    hf_checkpoint(root, 20)
    broken = hf_checkpoint(root, 40)
    cut(broken / "model.safetensors")

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        write_job_dir(supervisor.config.jobs_path, JOB, replace(spec(), ckpt_root=str(root)))
        await supervisor.polling.poll()
        await supervisor.deciding.settle()
        first = "00000000000000c1"
        supervisor.intake.accept_events(
            JOB, [started("node3", first, 1), killed("node3", first, 2)]
        )
        await supervisor.deciding.settle()
        clock[0] += 11.0  # past the backoff
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state is JobState.RELAUNCHING
        ended = protocol.DriverRequest(JOB, protocol.DriverPhase.ENDED, attempt=1, exit_code=1)
        answer = await supervisor.intake.driver(JOB, ended)
        assert answer.action is protocol.DriverAction.RELAUNCH
        assert answer.resume_from == str(root / "checkpoint-20")
        [(path, why)] = answer.quarantine
        assert path == str(broken) and "model.safetensors" in why and "truncated" in why
        moved = (("checkpoint-40", ".resurgo-quarantine/checkpoint-40.1760000011"),)
        confirm = protocol.DriverRequest(
            JOB, protocol.DriverPhase.RELAUNCHED, attempt=2, action_id=answer.action_id, ok=True,
            quarantined=moved,
        )  # fmt: skip
        await supervisor.intake.driver(JOB, confirm)
        await supervisor.intake.driver(JOB, confirm)  # a retried report is one event
        [event] = supervisor.store.events_for(JOB, kinds=["checkpoint_quarantined"])
        assert event.payload == {
            "checkpoint": "checkpoint-40", "moved_to": moved[0][1], "attempt": 2,
            "reason": why, "past_rollback": False,
        }  # fmt: skip

    run(body, tmp_path)


def test_a_rollback_moves_aside_the_valid_checkpoints_past_its_point(tmp_path: Path) -> None:
    """A NaN at step 45 in a script that imports nothing: the rollback resumes from
    checkpoint-20 (onset 45 less the margin of 20: at or before step 24), and the
    driver is told to move checkpoint-40 and checkpoint-60 aside, valid as they are;
    else the framework's own "latest" would resume past the anomaly."""
    from tests.fakes.checkpoints import hf_checkpoint

    root = tmp_path / "out"
    for step in (20, 40, 60):
        hf_checkpoint(root, step)

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        write_job_dir(supervisor.config.jobs_path, JOB, replace(spec(), ckpt_root=str(root)))
        await supervisor.polling.poll()
        await supervisor.deciding.settle()
        agents = {node: f"00000000000000d{i}" for i, node in enumerate(NODES)}
        for rank, (node, incarnation) in enumerate(agents.items()):
            steps = [
                {"step": step, "loss": None if step >= 45 else 2.0, "cursor": None,
                 **({"non_finite": "nan"} if step >= 45 else {})}
                for step in range(30, 50)
            ]  # fmt: skip
            supervisor.intake.accept_events(JOB, [
                started(node, incarnation, 1),
                event(EventKind.STEP_LOSSES, node, incarnation, 2,
                      {"global_rank": rank, "steps": steps}),
            ])  # fmt: skip
        await supervisor.deciding.settle()
        clock[0] += 30.0
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert record.rollbacks == 1 and record.state is JobState.RELAUNCHING, record
        ended = protocol.DriverRequest(JOB, protocol.DriverPhase.ENDED, attempt=1, exit_code=1)
        answer = await supervisor.intake.driver(JOB, ended)
        assert answer.action is protocol.DriverAction.RELAUNCH
        assert answer.resume_from == str(root / "checkpoint-20")
        assert answer.aside_after_step == 20  # and what the stopped run saves meanwhile
        aside = dict(answer.quarantine)
        assert sorted(aside) == [str(root / "checkpoint-40"), str(root / "checkpoint-60")]
        assert "step 60 lies past the rollback to step 20" in aside[str(root / "checkpoint-60")]
        assert "anomaly at step 45 (non_finite)" in aside[str(root / "checkpoint-60")], aside
        moved = (("checkpoint-60", ".resurgo-quarantine/checkpoint-60.1760000030"),)
        confirm = protocol.DriverRequest(
            JOB, protocol.DriverPhase.RELAUNCHED, attempt=2, action_id=answer.action_id, ok=True,
            quarantined=moved,
        )  # fmt: skip
        await supervisor.intake.driver(JOB, confirm)
        [seen] = supervisor.store.events_for(JOB, kinds=["checkpoint_quarantined"])
        assert seen.payload["past_rollback"] is True
        assert seen.payload["reason"] == aside[str(root / "checkpoint-60")]

    run(body, tmp_path)


def test_the_ranks_a_job_may_report_about_grow_with_what_its_heartbeats_list(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        assert supervisor.intake.ranks(JOB) == (4, 1)  # 4 nodes, 1 rank each as submitted
        # A wrapper script hid torchrun's --nproc-per-node 2 from `resurgo submit`.
        ranks = tuple(
            protocol.RankStatus(rank, rank % 2, 100 + rank, 5, "train", NOW, 1.0, 1.1, 1.0, 5)
            for rank in (2, 3)
        )
        report = protocol.HeartbeatReport(JOB, "node2", NOW, ranks, "00000000000000e1", 1)
        supervisor.intake.accept_heartbeat(JOB, report)
        assert supervisor.intake.ranks(JOB) == (8, 2)
        assert supervisor.intake.ranks("999") is None

    run(body, tmp_path)


def test_observe_only_decides_and_records_what_it_would_do_and_does_nothing(
    tmp_path: Path,
) -> None:
    """A SIGKILLed rank in observe-only mode: the same decisions as when acting, each
    action recorded as what it would have done; Slurm, the agents and the driver see
    nothing of it, and the job ends when its step does, as it would without Resurgo."""

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        _node3_killed(supervisor, "f")
        await supervisor.deciding.settle()
        clock[0] += 30.0
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        store = supervisor.store
        assert slurm.calls == []  # no drain, no requeue, no cancel
        done = store.list_actions(JOB)
        kinds = {row.kind for row in done}
        assert {"drain", "stop_ranks"} <= kinds, kinds
        acted = [row for row in done if row.kind != "validate"]
        assert all(row.result and row.result["observe_only"] for row in acted), acted
        drain = next(row for row in done if row.kind == "drain")
        assert drain.result["would"].startswith("drain node3 (rank_signal)")  # type: ignore[index]
        assert store.pending_commands(JOB, "node1") == []  # the agents were told nothing
        assert store.open_drains() == []
        (blame,) = store.blames_since(0)
        assert (blame.node, blame.outcome.value) == ("node3", "would_drain")
        would = store.events_for(JOB, kinds=["would_act"])
        assert any("drain node3" in row.payload["would"] for row in would), would
        # Whatever the core decided, the running step goes on: no stop, no relaunch, no
        # spare check; even a job the core stopped for good (a crash loop, say).
        running = protocol.DriverRequest(JOB, protocol.DriverPhase.RUNNING, attempt=1)
        job = supervisor.jobs[JOB]
        decided = job.record
        job.record = replace(decided, state=JobState.FAILED)
        for record in (decided, job.record):
            job.record = record
            answer = await supervisor.intake.driver(JOB, running)
            assert answer.action is protocol.DriverAction.WAIT and not answer.check_spares
        start = await supervisor.intake.driver(
            JOB, protocol.DriverRequest(JOB, protocol.DriverPhase.START)
        )
        assert start.action is protocol.DriverAction.LAUNCH
        assert start.resume_from is None and start.quarantine == ()
        job.record = decided
        # The step failed: the job ends, as without Resurgo (the driver exits 93).
        answer = await _step_ended(supervisor, 137)
        assert answer.action is protocol.DriverAction.STOP
        assert "observe-only" in answer.reason and "exit code 137" in answer.reason
        assert supervisor.polling.public_facts()["observe_only"] is True

    run(body, tmp_path, observe_only=True)


def test_a_commit_has_its_checkpoint_validated_ahead_of_any_fault(tmp_path: Path) -> None:
    """The decision that takes a newer checkpoint in hands it to the background
    validation, at the policy's level, and the verdict is kept for a recovery."""
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(b"x" * 100)
    read: list[tuple[str, str]] = []

    async def check(path: str, level: str) -> tuple[bool, str]:
        read.append((path, level))
        return True, ""

    def committed(seq: int):  # type: ignore[no-untyped-def]
        payload = {"step": 10, "path": str(ckpt)}
        return event(EventKind.CHECKPOINT_COMMITTED, "node1", "00000000000000a1", seq, payload)

    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        ahead = supervisor.executor.ahead
        assert ahead is not None
        ahead._check = check
        runner = asyncio.create_task(ahead.run())
        try:
            await registered_and_running(supervisor)
            supervisor.intake.accept_events(JOB, [committed(1)])
            await supervisor.deciding.settle()
            for _ in range(200):
                if ahead.validated:
                    break
                await asyncio.sleep(0.01)
            assert read == [(str(ckpt), "load")]
            assert await ahead.verdict(str(ckpt), "load") == (True, "")
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    run(body, tmp_path, validation_level=ValidationLevel.LOAD)


async def _four_agents_training(
    supervisor: Supervisor,
) -> tuple[dict[str, str], list[protocol.HeartbeatReport]]:
    """Four agents started (one rank each); each node's report of its rank at step 10."""
    await registered_and_running(supervisor)
    agents = {node: f"00000000000000a{i}" for i, node in enumerate(NODES)}
    for node in NODES:
        supervisor.intake.accept_events(JOB, [started(node, agents[node], 1)])
    await supervisor.deciding.settle()
    whole = [_report(node, agents[node], rank, 10, "train") for rank, node in enumerate(NODES)]
    return agents, whole


def test_a_jobs_heartbeats_from_its_aggregator_renew_every_lease_and_move_the_progress(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        agents, whole = await _four_agents_training(supervisor)
        beats = [protocol.beat_of(report) for report in whole]
        clock[0] += 5
        supervisor.intake.accept_job_heartbeats(
            JOB, protocol.JobHeartbeats(JOB, NOW, tuple(beats), tuple(whole))
        )
        leases = {lease.node: lease.last_seen_s for lease in supervisor.store.leases_for(JOB)}
        assert leases == {node: clock[0] for node in NODES}
        assert [row.step for row in supervisor.store.progress_for(JOB)][-1] == 10
        job = supervisor.jobs[JOB]
        assert job.local_ranks_seen == 1 and job.busy == {}
        # Beats alone (steps moved) and one node's whole report: its rank saving.
        clock[0] += 5
        saving = _report(NODES[0], agents[NODES[0]], 0, 11, "checkpoint")
        moved = [msgspec.structs.replace(beat, step=11) for beat in beats]
        moved[2] = msgspec.structs.replace(moved[2], step=12)
        supervisor.intake.accept_job_heartbeats(
            JOB, protocol.JobHeartbeats(JOB, NOW, tuple(moved), (saving,))
        )
        leases = {lease.node: lease.last_seen_s for lease in supervisor.store.leases_for(JOB)}
        assert leases == {node: clock[0] for node in NODES}
        assert [row.step for row in supervisor.store.progress_for(JOB)][-1] == 11  # the slowest
        assert set(job.busy) == {NODES[0]}
        # Beats alone for longer than a lease: the saving rank is still busy (an
        # aggregator sends a node's whole report again when its phase changes).
        lease_s = supervisor.config.lease_s
        for _ in range(int(lease_s // 5) + 2):
            clock[0] += 5
            supervisor.intake.accept_job_heartbeats(
                JOB, protocol.JobHeartbeats(JOB, NOW, tuple(moved))
            )
        busy = hang_hold.busy_now(job.busy, job.record, clock[0], lease_s)
        assert set(busy) == {NODES[0]}
        # A node whose ranks are all loading again: its lease renewed, no progress from it.
        clock[0] += 5
        loading = msgspec.structs.replace(moved[1], step=None)
        supervisor.intake.accept_job_heartbeats(JOB, protocol.JobHeartbeats(JOB, NOW, (loading,)))
        leases = {lease.node: lease.last_seen_s for lease in supervisor.store.leases_for(JOB)}
        assert leases[NODES[1]] == clock[0] and leases[NODES[0]] == clock[0] - 5
        assert [row.step for row in supervisor.store.progress_for(JOB)][-1] == 11

    run(body, tmp_path)


def test_a_node_reporting_directly_after_its_jobs_aggregator_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        _, whole = await _four_agents_training(supervisor)
        batch = protocol.JobHeartbeats(JOB, NOW, tuple(map(protocol.beat_of, whole)))
        with caplog.at_level(logging.INFO, logger="resurgo.supervisor"):
            supervisor.intake.accept_job_heartbeats(JOB, batch)
            for _ in range(2):
                supervisor.intake.accept_heartbeat(JOB, whole[1])
            supervisor.intake.accept_job_heartbeats(JOB, batch)  # the aggregator is back
            supervisor.intake.accept_heartbeat(JOB, whole[1])
        lines = [r.getMessage() for r in caplog.records if JOB in r.getMessage()]
        through = f"job {JOB}: heartbeats arrive through the job's aggregator (4 node(s))"
        direct = f"job {JOB}: node {NODES[1]}'s agent reports straight to the supervisor"
        assert [line for line in lines if line.startswith(through)] == [through]
        assert sum(line.startswith(direct) for line in lines) == 2

    run(body, tmp_path)
