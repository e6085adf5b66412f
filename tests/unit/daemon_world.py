"""The daemon tests' world: one life of a supervisor over the fake Slurm, and its agents' events.

Shared by ``test_daemon.py`` and the modules that drive the daemon the same
way (crash recovery, drain budget, ingest).
"""

from __future__ import annotations

import asyncio
import os
import pwd
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.config import SupervisorConfig
from supervisor.core.policy import Policy
from supervisor.daemon import Supervisor
from supervisor.jobs import JobSpec, write_job_dir
from tests.fakes.slurm import JOB
from tests.fakes.slurm import DaemonFakeSlurm as Slurm

NOW = 1_760_000_000.0


def spec() -> JobSpec:
    """The job every daemon test submits: 4 nodes, at least 2."""
    return JobSpec(
        name="toy", nodes=4, command=("torchrun", "t.py"), ckpt_root="/nonexistent/ckpt",
        min_nodes=2, supervisor_url="http://x",
    )  # fmt: skip


def me() -> str:
    """This process's user name: the fake's job belongs to it unless a test says otherwise."""
    return pwd.getpwuid(os.getuid()).pw_name


def run(body: Callable[[Supervisor, Slurm, list[float]], Awaitable[None]], tmp_path: Path,
        user: str | None = None, start_s: float = NOW, observe_only: bool = False,
        **policy: Any) -> None:  # fmt: skip
    """One life of a supervisor on ``tmp_path``'s state, its clock starting at ``start_s``;
    the store is closed at the end as a SIGKILL leaves it (nothing flushed beyond it)."""

    async def scenario() -> None:
        clock = [start_s]
        slurm = Slurm(user or me())
        config = SupervisorConfig(state_dir=str(tmp_path / "state"), observe_only=observe_only)
        supervisor = Supervisor(
            config,
            Policy(
                **{
                    "max_drain_share_per_hour": 0.5,
                    "exit_evidence_window_s": 0,
                    "corroborate_drains": False,
                    **policy,
                }
            ),
            slurm=slurm,  # type: ignore[arg-type]
            clock=lambda: clock[0],
        )
        try:
            await body(supervisor, slurm, clock)
        finally:
            supervisor.store.close()

    asyncio.run(scenario())


def event(kind: EventKind, node: str, incarnation: str, seq: int, payload: dict[str, Any]):  # type: ignore[no-untyped-def]
    """An event of the fake's job from agent ``incarnation`` on ``node``, sent at NOW."""
    return protocol.make_event(kind, JOB, node, incarnation, seq, NOW, payload)


def started(node: str, incarnation: str, attempt: int):  # type: ignore[no-untyped-def]
    """``agent_started`` of an agent of ``attempt`` on ``node``."""
    payload = {"agent_version": "1", "pid": 10, "argv": ["x"], "nnodes": 4, "node_rank": 0,
               "attempt": attempt}  # fmt: skip
    return event(EventKind.AGENT_STARTED, node, incarnation, 1, payload)


def killed(node: str, incarnation: str, rank: int):  # type: ignore[no-untyped-def]
    """``rank_exited``: rank ``rank`` on ``node`` SIGKILLed at step 8."""
    payload = {"global_rank": rank, "local_rank": 0, "pid": 99, "exit_code": None, "signal": 9,
               "signal_name": "SIGKILL", "last_step": 8, "phase": "train"}  # fmt: skip
    return event(EventKind.RANK_EXITED, node, incarnation, 2, payload)


async def registered_and_running(supervisor: Supervisor) -> None:
    """The fake's job submitted, polled and settled: the supervisor follows it, starting."""
    write_job_dir(supervisor.config.jobs_path, JOB, spec())
    await supervisor.polling.poll()
    await supervisor.deciding.settle()
    assert supervisor.jobs[JOB].record.state.value == "starting"
