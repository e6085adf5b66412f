"""A fake Slurm: the supervisor's Slurm interface, held in memory.

Stands for :class:`supervisor.slurm.client.SlurmClient` (the one implementation
of :class:`supervisor.slurm.interface.Slurm`, over the Slurm commands) in the
unit tests of the executor, the daemon and their recovery. It holds one job
(:data:`JOB`) on four nodes (:data:`NODES`), records every admin call, and
fails or "crashes" on demand. The live tier runs the real client against the
real local Slurm cluster instead (``deploy/slurm/cluster``;
tests/integration/test_executor_live.py, tests/integration/test_slurm_client.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from supervisor.errors import SlurmUnavailable
from supervisor.slurm.parse import JobState as SlurmState
from supervisor.slurm.parse import NodeFlag, NodeState, SlurmJob, SlurmNode

JOB = "4242"
NODES = ("node1", "node2", "node3", "node4")


class Crash(BaseException):
    """The supervisor was killed here (not an Exception: nothing may catch it)."""


def node(name: str, *, drained: bool = False, reason: str = "") -> SlurmNode:
    """An idle node of the fake cluster as ``scontrol show node`` parses; drained if asked."""
    return SlurmNode(
        name=name,
        state=NodeState.IDLE,
        state_raw="IDLE",
        flags=frozenset({NodeFlag.DRAIN}) if drained else frozenset(),
        flags_raw=("DRAIN",) if drained else (),
        reason=reason,
        reason_set_by=None,
        reason_changed_at=None,
        address=None,
        cpus=2,
        alloc_cpus=0,
        partitions=("debug",),
    )


def job(nodes: Sequence[str], state: SlurmState = SlurmState.RUNNING) -> SlurmJob:
    """Job :data:`JOB` on ``nodes``, as ``scontrol show job`` parses, in ``state``."""
    return SlurmJob(
        job_id=int(JOB),
        name="toy",
        state=state,
        state_raw=state.value,
        state_reason="None",
        nodes=tuple(nodes),
        node_list=",".join(nodes),
        node_count=len(nodes),
        batch_host=nodes[0] if nodes else None,
        restart_count=0,
        requeue=True,
        exit_code=None,
        exit_signal=None,
        time_limit_s=None,
        start_time=None,
        submit_time=None,
        end_time=None,
        eligible_time=None,
        excluded_nodes=(),
        comment="",
        flags=frozenset(),
        user_name="u",
        partition="debug",
    )


class FakeSlurm:
    """Holds node and job state, records every admin call, can fail or 'crash' on demand."""

    def __init__(self) -> None:
        self.nodes_by_name = {name: node(name) for name in NODES}
        self.the_job: SlurmJob | None = job(NODES)
        self.calls: list[tuple[object, ...]] = []
        self.unavailable: set[str] = set()  # method names that raise SlurmUnavailable once
        self.crash_after: set[str] = set()  # method names that apply, then raise Crash
        self.crash_before: set[str] = set()  # method names that raise Crash, applying nothing

    def _enter(self, method: str, *args: object) -> None:
        if method in self.crash_before:
            self.crash_before.discard(method)
            raise Crash(method)
        if method in self.unavailable:
            self.unavailable.discard(method)
            raise SlurmUnavailable(f"fake: {method} timed out")
        if method not in ("job", "nodes"):
            self.calls.append((method, *args))

    def _leave(self, method: str) -> None:
        if method in self.crash_after:
            self.crash_after.discard(method)
            raise Crash(method)

    async def drain(self, name: str, reason: str) -> None:
        self._enter("drain", name, reason)
        self.nodes_by_name[name] = node(name, drained=True, reason=reason)
        self._leave("drain")

    async def resume(self, name: str) -> None:
        self._enter("resume", name)
        self.nodes_by_name[name] = node(name)
        self._leave("resume")

    async def shrink(self, job_id: int, keep_nodes: Sequence[str]) -> None:
        self._enter("shrink", job_id, tuple(keep_nodes))
        assert self.the_job is not None
        self.the_job = replace(self.the_job, nodes=tuple(keep_nodes), node_count=len(keep_nodes))
        self._leave("shrink")

    async def requeue_smaller(
        self, job_id: int, n_nodes: int, n_tasks: int, exclude_nodes: Sequence[str] = ()
    ) -> None:
        self._enter("requeue_smaller", job_id, n_nodes, n_tasks, tuple(exclude_nodes))
        assert self.the_job is not None
        self.the_job = replace(
            self.the_job,
            state=SlurmState.PENDING,
            state_raw="PENDING",
            nodes=(),
            node_count=n_nodes,
            restart_count=self.the_job.restart_count + 1,
        )
        self._leave("requeue_smaller")

    async def cancel(self, job_id: int, signal: str | None = None) -> None:
        self._enter("cancel", job_id)
        assert self.the_job is not None
        self.the_job = replace(self.the_job, state=SlurmState.CANCELLED, state_raw="CANCELLED")
        self._leave("cancel")

    async def job(self, job_id: int) -> SlurmJob | None:
        self._enter("job", job_id)
        return self.the_job if self.the_job and self.the_job.job_id == job_id else None

    async def nodes(self) -> dict[str, SlurmNode]:
        self._enter("nodes")
        return dict(self.nodes_by_name)


class DaemonFakeSlurm(FakeSlurm):
    """The executor's fake plus the daemon's poll (``jobs``)."""

    def __init__(self, user: str) -> None:
        super().__init__()
        self.user = user

    async def jobs(self) -> dict[int, Any]:
        found = await self.job(int(JOB))
        if found is None:
            return {}
        return {found.job_id: replace(found, user_name=self.user)}
