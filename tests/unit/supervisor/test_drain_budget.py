"""The hourly drain share and the storm brake under simultaneous faults of several jobs.

The daemon with a fake Slurm that runs several jobs and a real store: every
fault arrives before the decision task runs, as a burst does between two
Slurm polls. The core's own rules are pinned in ``tests/unit/supervisor/core/test_policy.py``;
this pins that the daemon decides each fault on what the ones before it
planned (the store, not the last poll's view).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.cli.nodes import render
from supervisor.config import SupervisorConfig
from supervisor.core.policy import Policy
from supervisor.daemon import Supervisor
from supervisor.jobs import write_job_dir
from supervisor.slurm.parse import JobState as SlurmState
from supervisor.slurm.parse import SlurmJob
from supervisor.store import BlameOutcome
from supervisor.views import documents as views
from tests.fakes.slurm import FakeSlurm, job, node
from tests.unit.daemon_world import NOW, me, spec

# Three jobs of one user, two nodes each; in each a rank is SIGKILLed on its second node.
JOBS = {"101": ("node1", "node2"), "102": ("node3", "node4"), "103": ("node5", "node6")}
KILLED = {"101": "node2", "102": "node4", "103": "node6"}


class Cluster(FakeSlurm):
    """The executor's fake Slurm, with one job per entry of ``jobs``."""

    def __init__(self, jobs: dict[str, tuple[str, ...]]) -> None:
        super().__init__()
        self.nodes_by_name = {name: node(name) for nodes in jobs.values() for name in nodes}
        self.by_id = {
            int(job_id): replace(job(nodes), job_id=int(job_id), user_name=me())
            for job_id, nodes in jobs.items()
        }
        self.the_job = None

    async def jobs(self) -> dict[int, SlurmJob]:
        return dict(self.by_id)

    async def job(self, job_id: int) -> SlurmJob | None:
        self._enter("job", job_id)
        return self.by_id.get(job_id)

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        self._enter("shrink", job_id, tuple(keep_nodes))
        self.by_id[job_id] = replace(
            self.by_id[job_id], nodes=tuple(keep_nodes), node_count=len(keep_nodes)
        )

    async def requeue_smaller(
        self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
    ) -> None:
        self._enter("requeue_smaller", job_id, n_nodes, n_tasks, tuple(exclude_nodes))
        seen = self.by_id[job_id]
        self.by_id[job_id] = replace(
            seen, state=SlurmState.PENDING, state_raw="PENDING", nodes=(),
            restart_count=seen.restart_count + 1,
        )  # fmt: skip


def run(body: Callable[[Supervisor, Cluster], Awaitable[None]], tmp_path: Path,
        **policy: Any) -> None:  # fmt: skip
    async def scenario() -> None:
        cluster = Cluster(JOBS)
        supervisor = Supervisor(
            SupervisorConfig(state_dir=str(tmp_path / "state")),
            Policy(**{"exit_evidence_window_s": 0, "corroborate_drains": False, **policy}),
            slurm=cluster,  # type: ignore[arg-type]
            clock=lambda: NOW,
        )
        try:
            await body(supervisor, cluster)
        finally:
            supervisor.store.close()

    asyncio.run(scenario())


def _event(
    job_id: str, node_name: str, kind: EventKind, seq: int, payload: dict[str, Any]
) -> protocol.Event:
    incarnation = f"{int(job_id):08x}{node_name[-1]:0>8}"  # one agent per job and node
    return protocol.make_event(kind, job_id, node_name, incarnation, seq, NOW, payload)


async def three_jobs_each_lose_a_rank_at_once(supervisor: Supervisor) -> None:
    """Register the jobs, start their agents, then SIGKILL one rank in each before the
    decision task runs: the faults are decided one after another, with no poll between."""
    for job_id in JOBS:
        write_job_dir(supervisor.config.jobs_path, job_id, replace(spec(), nodes=2, min_nodes=1))
    await supervisor.polling.poll()
    await supervisor.deciding.settle()
    for job_id, nodes in JOBS.items():
        for rank, name in enumerate(nodes):
            payload = {"agent_version": "1", "pid": 10, "argv": ["x"], "nnodes": 2,
                       "node_rank": rank, "attempt": 1}  # fmt: skip
            started = _event(job_id, name, EventKind.AGENT_STARTED, 1, payload)
            supervisor.intake.accept_events(job_id, [started])
    await supervisor.deciding.settle()
    for job_id, name in KILLED.items():
        payload = {"global_rank": 1, "local_rank": 0, "pid": 99, "exit_code": None, "signal": 9,
                   "signal_name": "SIGKILL", "last_step": 8, "phase": "train"}  # fmt: skip
        supervisor.intake.accept_events(job_id, [_event(job_id, name, EventKind.RANK_EXITED, 2,
                                                 payload)])  # fmt: skip
    await supervisor.deciding.settle()


def drains(cluster: Cluster) -> list[str]:
    return [str(call[1]) for call in cluster.calls if call[0] == "drain"]


def storm_alerts(supervisor: Supervisor) -> list[str]:
    return [
        row.args["message"]
        for row in supervisor.store.list_actions()
        if row.kind == "alert" and "drain storm" in row.args["message"]
    ]


def test_simultaneous_faults_of_three_jobs_drain_no_more_than_the_hourly_share(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, cluster: Cluster) -> None:
        await three_jobs_each_lose_a_rank_at_once(supervisor)
        assert drains(cluster) == ["node2"]  # 0.1 of 6 nodes rounds down; at least 1 an hour
        blames = supervisor.store.blames_since(0)
        assert [(b.node, b.job_id, b.outcome) for b in blames] == [
            ("node2", "101", BlameOutcome.DRAINED),
            ("node4", "102", BlameOutcome.EXCLUDED),  # the share was used by node2's drain
            ("node6", "103", BlameOutcome.STORM),  # 3 nodes from 3 jobs within the window
        ]
        assert {b.slurm_user for b in blames} == {me()}
        (reason,) = [str(call[2]) for call in cluster.calls if call[0] == "drain"]
        assert reason.startswith(f"resurgo: rank_signal job=101 user={me()} ")
        # `resurgo nodes` names who blamed each node and what was done about it.
        document = views.nodes(supervisor.store, await cluster.nodes(), NOW, 2, 7 * 86400.0)
        text = render(document, NOW)
        blamed = [line.split() for line in text.splitlines() if line.startswith("node")]
        assert [(row[0], row[3], row[4], row[5], row[-1]) for row in blamed[-3:]] == [
            ("node2", "101", me(), "rank_signal", "drained"),
            ("node4", "102", me(), "rank_signal", "excluded"),
            ("node6", "103", me(), "rank_signal", "storm"),
        ]
        (alert,) = storm_alerts(supervisor)
        assert "3 nodes blamed by 3 jobs" in alert and "node2, node4, node6" in alert
        for job_id, name in KILLED.items():  # each job goes on without the node it blamed
            record = supervisor.jobs[job_id].record
            assert record.recovery is not None and name in record.recovery.exclude

    run(body, tmp_path)


def test_with_a_larger_share_the_storm_brake_stops_the_third_drain(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, cluster: Cluster) -> None:
        await three_jobs_each_lose_a_rank_at_once(supervisor)
        assert drains(cluster) == ["node2", "node4"]
        outcomes = [b.outcome for b in supervisor.store.blames_since(0)]
        assert outcomes == [BlameOutcome.DRAINED, BlameOutcome.DRAINED, BlameOutcome.STORM]
        assert len(storm_alerts(supervisor)) == 1

    run(body, tmp_path, max_drain_share_per_hour=1.0)


def test_without_the_storm_brake_a_large_share_drains_every_blamed_node(tmp_path: Path) -> None:
    async def body(supervisor: Supervisor, cluster: Cluster) -> None:
        await three_jobs_each_lose_a_rank_at_once(supervisor)
        assert drains(cluster) == ["node2", "node4", "node6"]
        assert storm_alerts(supervisor) == []

    run(body, tmp_path, max_drain_share_per_hour=1.0, storm_nodes=0)


def test_a_user_whose_jobs_blame_too_many_nodes_is_flagged_and_the_nodes_are_not_drained(
    tmp_path: Path,
) -> None:
    async def body(supervisor: Supervisor, cluster: Cluster) -> None:
        await three_jobs_each_lose_a_rank_at_once(supervisor)
        assert drains(cluster) == ["node2"]
        outcomes = [b.outcome for b in supervisor.store.blames_since(0)]
        assert outcomes == [BlameOutcome.DRAINED, BlameOutcome.FLAGGED, BlameOutcome.FLAGGED]
        flagged = [
            row.args["message"]
            for row in supervisor.store.list_actions()
            if row.kind == "alert" and "user flagged" in row.args["message"]
        ]
        assert len(flagged) == 1 and f"jobs of {me()} blamed 2 nodes" in flagged[0]

    run(body, tmp_path, max_drain_share_per_hour=1.0, storm_nodes=0, user_flag_min_nodes=2)


def test_one_users_jobs_take_no_more_than_their_share_of_the_hourly_drains(
    tmp_path: Path,
) -> None:
    """Six drains an hour on six nodes, a user's share 0.2 of them (one): the user's
    second and third blames exclude their nodes and warn; nothing else holds them."""

    async def body(supervisor: Supervisor, cluster: Cluster) -> None:
        await three_jobs_each_lose_a_rank_at_once(supervisor)
        assert drains(cluster) == ["node2"]
        outcomes = [b.outcome for b in supervisor.store.blames_since(0)]
        assert outcomes == [
            BlameOutcome.DRAINED, BlameOutcome.USER_SHARE, BlameOutcome.USER_SHARE
        ]  # fmt: skip
        warned = [
            row.args["message"]
            for row in supervisor.store.list_actions()
            if row.kind == "alert" and "the most one user's jobs may take" in row.args["message"]
        ]
        assert len(warned) == 2 and f"jobs of {me()} had 1 node(s)" in warned[0], warned
        for job_id, name in KILLED.items():
            record = supervisor.jobs[job_id].record
            assert record.recovery is not None and name in record.recovery.exclude

    run(body, tmp_path, max_drain_share_per_hour=1.0, storm_nodes=0, max_user_drain_share=0.2)
