"""What a supervisor restarted after a SIGKILL must get right: one test per bug that
tests/integration/test_crash_consistency.py found by killing the real daemon.

A restart is modelled as the real thing leaves it: the store closed where the
previous process stopped (or a :class:`Crash` raised out of the fake Slurm
right after it applied a change), and a new :class:`Supervisor` on the same
state directory whose clock starts later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agent.wire import protocol
from supervisor.act.executor import Executor
from supervisor.config import SupervisorConfig
from supervisor.core.model import JobState
from supervisor.core.observations import LeaseExpired
from supervisor.core.policy import Policy
from supervisor.daemon import Supervisor
from supervisor.slurm.parse import JobState as SlurmState
from supervisor.store import ActionState, Store
from tests.fakes.slurm import JOB, Crash, FakeSlurm, job
from tests.fakes.slurm import DaemonFakeSlurm as Slurm
from tests.unit.daemon_world import killed, me, registered_and_running, run, started
from tests.unit.executor_world import NOW, REQUEUE

Body = Callable[[Supervisor, Slurm, list[float]], Awaitable[None]]


def life(tmp_path: Path, start_s: float, body: Body, **policy: Any) -> None:
    """One run of the supervisor on ``tmp_path``'s state, its clock starting at ``start_s``."""
    run(body, tmp_path, start_s=start_s, **policy)


async def first_life(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
    await registered_and_running(supervisor)


def test_leases_count_from_the_restart_not_from_before_the_supervisor_went_down(
    tmp_path: Path,
) -> None:
    agent = "00000000000000a2"

    async def before(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        supervisor.intake.accept_events(JOB, [started("node2", agent, 1)])
        supervisor.intake.accept_heartbeat(
            JOB, protocol.HeartbeatReport(JOB, "node2", NOW, (), agent, 1)
        )

    async def after(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        supervisor.load_jobs()
        lease_s = supervisor.config.lease_s
        # Down for 300 s: no agent could call in, so no lease says anything yet.
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state is JobState.STARTING
        # Still inside the grace the restart gives: a lease, and the longest an
        # agent retrying through the outage waits between two tries.
        clock[0] += lease_s + protocol.RETRY_MAX_S
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.state is JobState.STARTING
        clock[0] += 1  # node2's agent stayed silent that long after the restart: lost
        await supervisor.timers.tick()
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert record.state is JobState.RECOVERING and "node2" in record.blamed_nodes

    life(tmp_path, NOW, before)
    life(tmp_path, NOW + 300, after)


def test_after_a_restart_nothing_is_decided_before_slurm_was_read_once(tmp_path: Path) -> None:
    agent = "00000000000000a3"

    async def after(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        supervisor.load_jobs()
        supervisor.intake.accept_events(
            JOB, [started("node3", agent, 1), killed("node3", agent, 2)]
        )
        deciding = asyncio.create_task(supervisor.deciding.loop())
        try:
            await asyncio.sleep(0.05)
            # Decided now, on an empty cluster view, the drain share of 0 nodes
            # would forbid draining node3 (an alert instead).
            assert supervisor.jobs[JOB].record.state is JobState.STARTING
            await supervisor.polling.poll()
            for _ in range(600):
                if supervisor.jobs[JOB].record.attempt == 2 and supervisor.deciding.queue.empty():
                    break
                await asyncio.sleep(0.01)
        finally:
            deciding.cancel()
        assert supervisor.jobs[JOB].record.state is JobState.RECOVERING
        assert slurm.calls[0][:2] == ("drain", "node3")

    life(tmp_path, NOW, first_life)
    life(tmp_path, NOW + 5, after)


def test_an_event_acknowledged_but_not_decided_on_before_a_kill_is_decided_after_restart(
    tmp_path: Path,
) -> None:
    agent = "00000000000000a4"

    async def before(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        # The API stored and acknowledged these; the decision task never took them up.
        supervisor.intake.accept_events(
            JOB, [started("node3", agent, 1), killed("node3", agent, 2)]
        )

    async def after(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        supervisor.load_jobs()
        await supervisor.polling.poll()
        await supervisor.deciding.reconcile()
        await supervisor.deciding.resume_recoveries()
        await supervisor.deciding.replay_undecided()
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert record.state is JobState.RECOVERING and record.attempt == 2
        assert slurm.calls[0][:2] == ("drain", "node3")
        # Once decided, a later restart does not decide on it again.
        await supervisor.deciding.replay_undecided()
        await supervisor.deciding.settle()
        assert supervisor.jobs[JOB].record.attempt == 2
        assert [call[0] for call in slurm.calls].count("drain") == 1

    life(tmp_path, NOW, before)
    life(tmp_path, NOW + 5, after)


def test_a_slurm_sighting_read_before_our_requeue_finished_is_not_taken_for_its_start(
    tmp_path: Path,
) -> None:
    elsewhere = ("node2", "node3", "node4")

    async def after(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        supervisor.load_jobs()
        await (
            supervisor.polling.poll()
        )  # the first poll of a restart reports the job RUNNING on NODES
        clock[0] += 1
        # Meanwhile the recovery goes on: node1, the batch host, is lost -> requeue.
        await supervisor.deciding.apply(JOB, LeaseExpired("node1"))
        assert supervisor.jobs[JOB].record.state is JobState.REQUEUED
        assert slurm.the_job is not None and slurm.the_job.state is SlurmState.PENDING
        await supervisor.deciding.settle()  # the RUNNING sighting from before the requeue
        assert supervisor.jobs[JOB].record.state is JobState.REQUEUED
        clock[0] += 1
        slurm.the_job = replace(job(elsewhere), restart_count=1)
        await supervisor.polling.poll()
        await supervisor.deciding.settle()
        record = supervisor.jobs[JOB].record
        assert record.state is JobState.STARTING and record.nodes == elsewhere
        assert supervisor.store.attempts_for(JOB)[-1].nodes == elsewhere

    life(tmp_path, NOW, first_life)
    life(tmp_path, NOW + 5, after, backoff_base_s=0.0)


class HoldsLikeSlurm(FakeSlurm):
    """``requeue_smaller`` as slurmctld 22.05 runs it: requeuehold leaves the job COMPLETING
    (restart count already incremented) before it is PENDING; the supervisor is killed
    right after the hold, once."""

    def __init__(self) -> None:
        super().__init__()
        self.holds = 0
        self.crash_after_hold = True

    async def requeue_smaller(
        self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
    ) -> None:
        self.calls.append(("requeue_smaller", job_id, n_nodes, n_tasks, tuple(exclude_nodes)))
        assert self.the_job is not None
        if self.the_job.state is SlurmState.RUNNING:  # the adapter holds a running job only
            self.holds += 1
            self.the_job = replace(
                self.the_job,
                state=SlurmState.COMPLETING,
                state_raw="COMPLETING",
                state_reason="JobHeldUser",
                restart_count=self.the_job.restart_count + 1,
            )
            if self.crash_after_hold:
                self.crash_after_hold = False
                raise Crash("killed right after requeuehold")
        self.the_job = replace(
            self.the_job,
            state=SlurmState.PENDING,
            state_raw="PENDING",
            state_reason="None",
            nodes=(),
            node_count=n_nodes,
        )


def test_a_requeue_killed_right_after_requeuehold_is_finished_not_taken_for_done(
    tmp_path: Path,
) -> None:
    store = Store.open(tmp_path / "store.db")
    store.upsert_job(
        JOB, state="running", record={}, now_s=NOW, name="toy", original_nodes=4, min_nodes=2
    )
    slurm = HoldsLikeSlurm()

    def executor() -> Executor:
        return Executor(store, slurm, checkpoint_root_of=lambda job_id: None, clock=lambda: NOW)

    with pytest.raises(Crash):
        asyncio.run(executor().execute(JOB, [REQUEUE], NOW))
    row = store.get_action(REQUEUE.action_id)
    assert row is not None and row.state is ActionState.STARTED
    assert slurm.the_job is not None and slurm.the_job.state is SlurmState.COMPLETING

    asyncio.run(executor().reconcile(NOW + 5))  # the restarted supervisor
    row = store.get_action(REQUEUE.action_id)
    assert row is not None and row.state is ActionState.DONE
    assert slurm.holds == 1  # requeued once, then resized and released
    assert slurm.the_job.state is SlurmState.PENDING and not slurm.the_job.held
    assert slurm.the_job.node_count == REQUEUE.n_nodes
    store.close()


def test_a_restart_whose_first_reconcile_fails_still_decides_on_what_waits(
    tmp_path: Path,
) -> None:
    agent = "00000000000000a5"

    async def before(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        await registered_and_running(supervisor)
        # Stored and acknowledged; the decision task never took them up.
        supervisor.intake.accept_events(
            JOB, [started("node3", agent, 1), killed("node3", agent, 2)]
        )

    async def after(supervisor: Supervisor, slurm: Slurm, clock: list[float]) -> None:
        supervisor.load_jobs()
        reconcile = supervisor.executor.reconcile
        failures = []

        async def fails_once(now_s: float) -> Any:
            if not failures:
                failures.append(now_s)
                raise RuntimeError("validator import failed")
            return await reconcile(now_s)

        supervisor.executor.reconcile = fails_once  # type: ignore[method-assign]
        deciding = asyncio.create_task(supervisor.deciding.loop())
        try:
            await supervisor.polling.poll()
            for _ in range(600):
                if supervisor.jobs[JOB].record.attempt == 2 and supervisor.deciding.queue.empty():
                    break
                await asyncio.sleep(0.01)
            assert not deciding.done(), "the decision task died with its start-up step"
        finally:
            deciding.cancel()
        assert failures
        record = supervisor.jobs[JOB].record
        assert record.state is JobState.RECOVERING and record.attempt == 2
        assert slurm.calls[0][:2] == ("drain", "node3")

    life(tmp_path, NOW, before)
    life(tmp_path, NOW + 5, after)


def test_a_supervisor_whose_decision_task_dies_stops_with_an_error_for_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        config = SupervisorConfig(state_dir=str(tmp_path / "state"), listen_host="127.0.0.1",
                                  listen_port=0)  # fmt: skip
        supervisor = Supervisor(config, Policy(), slurm=Slurm(me()))  # type: ignore[arg-type]

        async def dies() -> None:
            raise RuntimeError("a bug in the decision task")

        supervisor.deciding.loop = dies  # type: ignore[method-assign]
        await asyncio.wait_for(supervisor.run(), timeout=30)
        assert supervisor.failed is not None and "decide" in supervisor.failed
        assert "a bug in the decision task" in supervisor.failed

    asyncio.run(scenario())
    assert "supervisor stopping with an error" in caplog.text
