"""Which processes are this node's ranks, and how each one ended (psutil).

Under torchrun the tree is ``agent -> torchrun -> rankexec shim -> rank``. A
rank is identified by the shim's ``RANK``/``LOCAL_RANK`` environment (set by
torchrun), and its exit status is read from the file the shim writes
(:mod:`agent.rankexec`), because only a parent learns a child's exit status.
Any other command is a single rank: the launched process itself, whose status
the agent learns directly as its parent.
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

log = logging.getLogger(__name__)

# After a rank vanished, how long to wait for its shim's exit record before
# reporting the exit as unknown (the shim died too, e.g. SIGKILL of the group).
EXIT_RECORD_WAIT_S = 1.0


@dataclass(frozen=True)
class RankProcess:
    """One rank on this node."""

    global_rank: int
    local_rank: int
    pid: int
    shim_pid: int | None = None


@dataclass(frozen=True)
class RankExit:
    """How a rank ended: exit code or signal (both None when unknown), and when."""

    rank: RankProcess
    exit_code: int | None
    signal: int | None
    time_unix_s: float

    @property
    def signal_name(self) -> str | None:
        """``SIGKILL`` etc., or None."""
        if self.signal is None:
            return None
        try:
            return signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class RankWatcher:
    """Discovers the ranks under the launcher and reports each rank's exit once."""

    def __init__(
        self,
        launcher_pid: int,
        *,
        torchrun: bool,
        exit_dir: Path,
        node_rank: int,
        expected: int | None = None,
    ):
        self._launcher_pid = launcher_pid
        # Once every expected rank is known, discovery stops walking the
        # process tree (the agent's biggest recurring cost otherwise).
        self._expected = expected
        self._torchrun = torchrun
        self._exit_dir = exit_dir
        self._node_rank = node_rank
        self._ranks: dict[int, RankProcess] = {}
        self._reported: set[int] = set()
        self._vanished_at: dict[int, float] = {}

    @property
    def ranks(self) -> dict[int, RankProcess]:
        """Global rank -> process, of every rank seen so far."""
        return dict(self._ranks)

    @property
    def live_ranks(self) -> list[RankProcess]:
        """Ranks not yet reported as exited."""
        return [rank for key, rank in self._ranks.items() if key not in self._reported]

    def discover(self) -> list[RankProcess]:
        """Find ranks not seen before; return them."""
        found: list[RankProcess] = []
        if self._expected is not None and len(self._ranks) >= self._expected:
            return found
        if not self._torchrun:
            if not self._ranks and pid_alive(self._launcher_pid):
                rank = RankProcess(self._node_rank, 0, self._launcher_pid)
                self._ranks[rank.global_rank] = rank
                found.append(rank)
            return found
        try:
            descendants = psutil.Process(self._launcher_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return found
        for shim in descendants:
            discovered = self._rank_of_shim(shim)
            if discovered is not None and discovered.global_rank not in self._ranks:
                self._ranks[discovered.global_rank] = discovered
                found.append(discovered)
        return found

    def poll_exits(self, now_unix_s: float) -> list[RankExit]:
        """Exits of torchrun ranks seen since the last call, each reported once.

        (A non-torchrun command's exit is the launcher's, which the agent
        learns as its parent: see :meth:`launcher_exit`.)
        """
        exits = []
        for key, rank in self._ranks.items():
            if key in self._reported or not self._torchrun or pid_alive(rank.pid):
                continue
            record = self._read_record(key)
            if record is None:
                first_seen = self._vanished_at.setdefault(key, now_unix_s)
                shim_alive = rank.shim_pid is not None and pid_alive(rank.shim_pid)
                if shim_alive or now_unix_s - first_seen < EXIT_RECORD_WAIT_S:
                    continue
                exits.append(RankExit(rank, None, None, now_unix_s))
            else:
                ended = record.get("time_unix_s")
                exits.append(
                    RankExit(
                        rank,
                        record.get("exit_code"),
                        record.get("signal"),
                        float(ended) if ended is not None else now_unix_s,
                    )
                )
            self._reported.add(key)
        # Ranks that ended within one poll are reported in the order they ended:
        # the first is usually the cause, the rest torchrun's tear-down.
        return sorted(exits, key=lambda rank_exit: rank_exit.time_unix_s)

    def launcher_exit(self, returncode: int, now_unix_s: float) -> list[RankExit]:
        """For a non-torchrun command, its exit is its single rank's exit."""
        if self._torchrun:
            return []
        exits = []
        for key, rank in self._ranks.items():
            if key not in self._reported:
                self._reported.add(key)
                exits.append(
                    RankExit(
                        rank,
                        returncode if returncode >= 0 else None,
                        -returncode if returncode < 0 else None,
                        now_unix_s,
                    )
                )
        return exits

    def _rank_of_shim(self, process: psutil.Process) -> RankProcess | None:
        try:
            cmdline = process.cmdline()
            if "agent.rankexec" not in cmdline:
                return None
            environ = process.environ()
            children = process.children()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        if not children or "RANK" not in environ:
            return None  # the worker is not started yet; found on a later pass
        return RankProcess(
            global_rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            pid=children[0].pid,
            shim_pid=process.pid,
        )

    def _read_record(self, global_rank: int) -> dict[str, Any] | None:
        path = self._exit_dir / f"rank-{global_rank}.json"
        try:
            record: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            log.warning("unreadable exit record %s: %s", path, error)
            return None
        return record
