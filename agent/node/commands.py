"""What the node agent does when told to: supervisor commands, stopping the ranks, the time limit.

:class:`~agent.node.agent.NodeAgent` owns the loop and its state; these are the
steps it takes. A supervisor command becomes an item of the agent's queue
(:func:`queued`), acted on in the loop: a new checkpoint interval is written
for the ranks (:func:`write_interval`), a stop runs :func:`terminate` and
reports :func:`ranks_stopped`. A time-limit notice that is this launch's
(:func:`notice_is_ours`) asks the ranks for a final checkpoint and waits for
it (:func:`await_final_checkpoint`) before the same stop; a script that saves
when it saves is stopped once a save it has under way has ended
(:func:`await_save_settled`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.checkpoint import files, layouts
from agent.checkpoint.catalog import newest_committed_step
from agent.node.procs import RankExit, RankProcess, pid_alive
from agent.stopfiles import held_ranks
from agent.timelimit import Notice
from agent.train.schedule import CheckpointInterval, format_override
from agent.wire import protocol

log = logging.getLogger(__name__)

# A checkpoint modified this recently is still being written: the files of one save
# (weights, optimizer, each rank's RNG state, the Trainer's state) follow each other
# within milliseconds on an idle machine and within a second on a loaded one.
SAVE_QUIET_S = 2.0


def queued(command: protocol.Command) -> tuple[str, dict[str, Any]] | None:
    """The agent-queue item for a supervisor command; None for a kind the agent ignores."""
    if command.kind is protocol.CommandKind.STOP_RANKS:
        return (
            "stop",
            {
                "reason": command.args.get("reason") or "stop command from supervisor",
                "command_id": command.command_id,
                "grace_s": float(command.args["grace_s"]),
            },
        )
    if command.kind is protocol.CommandKind.SET_CHECKPOINT_INTERVAL:
        return ("interval", dict(command.args))
    return None


def write_interval(path: Path, args: dict[str, Any]) -> None:
    """Write the supervisor's checkpoint interval to ``path``, the file the ranks follow."""
    interval = CheckpointInterval(seconds=args.get("interval_s"), steps=args.get("every_steps"))
    files.write_durably(path, format_override(interval).encode())
    log.info("checkpoint interval set to %s", interval)


async def terminate(
    ranks: Sequence[RankProcess],
    launcher_pid: int,
    grace_s: float,
    monotonic: Callable[[], float],
) -> set[int]:
    """SIGTERM the ranks and the launcher, SIGKILL what is left after ``grace_s``.

    Returns the global ranks that had to be killed. The launcher runs in its own
    process group, which is killed whole when the launcher outlives the grace.
    """
    targets = [rank.pid for rank in ranks] + [launcher_pid]
    for pid in targets:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = monotonic() + grace_s
    while monotonic() < deadline and any(pid_alive(pid) for pid in targets):
        await asyncio.sleep(0.1)
    killed = set()
    for rank in ranks:
        for maybe_pid in (rank.pid, rank.shim_pid):
            if maybe_pid is not None and pid_alive(maybe_pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(maybe_pid, signal.SIGKILL)
                killed.add(rank.global_rank)
    if pid_alive(launcher_pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher_pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    return killed


def ranks_stopped(
    reason: str,
    command_id: str | None,
    grace_s: float,
    ranks: Sequence[RankProcess],
    killed: set[int],
    statuses: Mapping[int, RankExit],
) -> dict[str, Any]:
    """The ``ranks_stopped`` payload: how each rank was stopped and how it ended."""
    return {
        "reason": reason,
        "command_id": command_id,
        "grace_s": float(grace_s),
        "ranks": [
            {
                "global_rank": rank.global_rank,
                "local_rank": rank.local_rank,
                "pid": rank.pid,
                "method": "sigkill" if rank.global_rank in killed else "sigterm",
                "exit_code": statuses[rank.global_rank].exit_code
                if rank.global_rank in statuses else None,
                "signal": statuses[rank.global_rank].signal
                if rank.global_rank in statuses else None,
            }
            for rank in ranks
        ],
    }  # fmt: skip


def notice_is_ours(notice: Notice, attempt: int, started_unix_s: float) -> bool:
    """A notice for this launch: its attempt (when the driver named one), and never
    one written before this agent started (left by an earlier run of the job)."""
    if attempt and notice.attempt != attempt:
        return False
    return notice.warned_unix_s >= started_unix_s - 1.0


async def await_final_checkpoint(
    root: str,
    before: int | None,
    save_by_unix_s: float,
    live_ranks: Callable[[], set[int]],
    save_request: Path,
    wall: Callable[[], float],
) -> str:
    """Wait until ``save_by_unix_s`` for a checkpoint newer than step ``before`` that every
    live rank holds after; the outcome, in words."""
    while wall() < save_by_unix_s:
        step = newest_committed_step(root)
        committed = step is not None and (before is None or step > before)
        # Every rank holds after the save: none is cut short in its saved step.
        if committed and live_ranks() <= held_ranks(save_request):
            return f"final checkpoint at step {step} committed"
        await asyncio.sleep(0.25)
    since = "" if before is None else f" newer than step {before}"
    return f"no checkpoint{since} committed by the deadline"


def newest_checkpoint_write(root: str) -> float | None:
    """The newest modification (Unix seconds) in any checkpoint under ``root``, of any
    layout; None when there is none, or the root cannot be listed (logged: the stop for
    the time limit must go on whatever the file system does)."""
    try:
        found = layouts.find_all(root)
    except OSError as error:
        log.warning("could not list checkpoints under %s: %s", root, error)
        return None
    return max((checkpoint.mtime_s for checkpoint in found), default=None)


async def await_save_settled(
    root: str,
    saving: Callable[[], bool],
    until_unix_s: float,
    wall: Callable[[], float],
    quiet_s: float = SAVE_QUIET_S,
) -> str | None:
    """Wait, until ``until_unix_s``, while a script that saves when it saves has a save
    under way: a local rank in its checkpoint phase (``saving``), or a checkpoint under
    ``root`` modified less than ``quiet_s`` ago. A SIGTERM then would cut the save short,
    and a run's first checkpoint cut short leaves it nothing to resume from. None when no
    save was under way; else the outcome, in words."""
    waited = False
    while wall() < until_unix_s:
        newest = await asyncio.to_thread(newest_checkpoint_write, root)
        if not saving() and (newest is None or wall() - newest >= quiet_s):
            return "the script's save under way has ended" if waited else None
        waited = True
        await asyncio.sleep(0.25)
    return "the script's save under way had not ended by the deadline" if waited else None
