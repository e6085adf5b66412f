"""Which processes are this node's ranks, and how each one ended (psutil).

Under torchrun the tree is ``agent -> torchrun -> rankexec shim -> rank``. A
rank is identified by the shim's ``RANK``/``LOCAL_RANK`` environment (set by
torchrun), and its exit status is read from the file the shim writes
(:mod:`agent.node.rankexec`), because only a parent learns a child's exit status.
The per-rank shape (``srun python train.py``) runs under torchrun in the same
way. A wrapper (``bash run.sh``) is searched for shims too, since a torchrun it
starts is fitted with them (:mod:`agent.node.torchrunshim`); a rank that beats
without one (a ``python -m torch.distributed.run`` in the wrapper) is adopted
by its pid (:meth:`RankWatcher.adopt`), its exit status unknown; and a wrapper
under which no rank was ever found is the node's single rank, whose status the
agent learns directly as its parent.

Each rank's ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` are read with it, so the
agent can tell when the ranks formed a world that is not the job's; and its
memory cgroup's out-of-memory kill count (:mod:`agent.node.kernlog`), so that
its exit can say whether the kernel killed something there while it ran.
"""

from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from agent.node import kernlog
from agent.node.launch import Shape
from agent.node.rankexec import worker_file
from agent.wire import raised
from agent.wire.environ import ENV_EXIT_DIR

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
    # torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE of the rank (None: not set).
    world_size: int | None = None
    local_world_size: int | None = None
    # The file of its memory cgroup's oom_kill count, and the count when it was found.
    oom_counter: Path | None = None
    oom_kills_at_start: int | None = None


@dataclass(frozen=True)
class RankExit:
    """How a rank ended: exit code or signal (both None when unknown), and when."""

    rank: RankProcess
    exit_code: int | None
    signal: int | None
    time_unix_s: float
    # The rank's uncaught exception if it raised one (agent.wire.raised).
    raised: raised.Note | None = None
    # Whether its script ran to its end before it exited (agent.wire.raised).
    script_ended: bool = False
    # The last lines it wrote to standard error (agent.node.rankexec; "": none known).
    stderr_tail: str = ""
    # Whether the node's warm pool forked it (agent.node.warmpool), not a fresh interpreter.
    warm: bool = False

    @property
    def oom_kills_while_running(self) -> int | None:
        """How many processes the kernel killed for memory in the rank's cgroup while it
        ran (None: unknown)."""
        after = kernlog.oom_kills(self.rank.oom_counter)
        before = self.rank.oom_kills_at_start
        return None if after is None or before is None else max(after - before, 0)

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
        shape: Shape,
        exit_dir: Path,
        node_rank: int,
        expected: int | None = None,
    ):
        self._launcher_pid = launcher_pid
        # Once every expected rank is known, discovery stops walking the
        # process tree (the agent's biggest recurring cost otherwise). A
        # wrapper's count is learnt from its first rank's LOCAL_WORLD_SIZE.
        self._expected = expected
        self._wrapper = shape is Shape.WRAPPER
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

    def ranks_left(self) -> int | None:
        """Ranks not yet reported as exited, once every expected rank was seen; else None."""
        if self._expected is None or len(self._ranks) < self._expected:
            return None
        return len(self._ranks) - len(self._reported)

    def discover(self) -> list[RankProcess]:
        """Find ranks not seen before; return them."""
        found: list[RankProcess] = []
        if self._expected is not None and len(self._ranks) >= self._expected:
            return found
        try:
            descendants = psutil.Process(self._launcher_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return found
        ranks = [self._rank_of_shim(process) for process in descendants]
        if self._wrapper:
            ranks += _bare_workers(descendants)
        for discovered in ranks:
            if discovered is not None and discovered.global_rank not in self._ranks:
                discovered = _with_oom_counter(discovered)
                self._ranks[discovered.global_rank] = discovered
                found.append(discovered)
                if self._expected is None and discovered.local_world_size:
                    self._expected = discovered.local_world_size
        return found

    def adopt(self, global_rank: int, local_rank: int, pid: int) -> RankProcess | None:
        """A wrapper's rank found by its heartbeat (no shim above it); None when it is
        known already, not below the launcher, or the command is not a wrapper."""
        if not self._wrapper or global_rank in self._ranks or pid == self._launcher_pid:
            return None
        try:
            process = psutil.Process(pid)
            if self._launcher_pid not in {parent.pid for parent in process.parents()}:
                return None
            environ = process.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        rank = RankProcess(
            global_rank,
            local_rank,
            pid,
            world_size=_int_or_none(environ.get("WORLD_SIZE")),
            local_world_size=_int_or_none(environ.get("LOCAL_WORLD_SIZE")),
        )
        rank = _with_oom_counter(rank)
        self._ranks[global_rank] = rank
        return rank

    def poll_exits(self, now_unix_s: float) -> list[RankExit]:
        """Exits of torchrun ranks seen since the last call, each reported once.

        (A non-torchrun command's exit is the launcher's, which the agent
        learns as its parent: see :meth:`launcher_exit`.)
        """
        exits = []
        for key, rank in self._ranks.items():
            if key in self._reported or rank.shim_pid is None or pid_alive(rank.pid):
                continue  # a rank with no shim ends with its launcher (launcher_exit)
            record = self._read_record(key)
            if record is None:
                first_seen = self._vanished_at.setdefault(key, now_unix_s)
                if pid_alive(rank.shim_pid) or now_unix_s - first_seen < EXIT_RECORD_WAIT_S:
                    continue
                exits.append(RankExit(rank, None, None, now_unix_s))
            else:
                exits.append(self._exit_of(rank, record, now_unix_s))
            self._reported.add(key)
        exits += self._exits_never_seen(now_unix_s)
        # Ranks that ended within one poll are reported in the order they ended:
        # the first is usually the cause, the rest torchrun's tear-down.
        return sorted(exits, key=lambda rank_exit: rank_exit.time_unix_s)

    def _exits_never_seen(self, now_unix_s: float) -> list[RankExit]:
        """Exits of ranks that died before discovery found them (a script failing at its
        import, on a loaded node, can end before the first walk of the process tree): their
        shim recorded them all the same. Looked for only while ranks are missing."""
        if self._expected is not None and len(self._ranks) >= self._expected:
            return []
        exits = []
        for path in sorted(self._exit_dir.glob("rank-*.json")):
            key = path.stem.removeprefix("rank-")
            if not key.isdigit() or int(key) in self._ranks:
                continue
            record = self._read_record(int(key))
            if record is None:
                continue
            local, pid = record.get("local_rank"), record.get("pid")
            rank = RankProcess(
                int(key),
                local if isinstance(local, int) else 0,
                pid if isinstance(pid, int) and pid > 0 else 1,
            )
            self._ranks[rank.global_rank] = rank
            self._reported.add(rank.global_rank)
            exits.append(self._exit_of(rank, record, now_unix_s))
        return exits

    def _exit_of(self, rank: RankProcess, record: dict[str, Any], now_unix_s: float) -> RankExit:
        """The rank's exit from its shim's record and the notes beside it."""
        ended, tail = record.get("time_unix_s"), record.get("stderr_tail")
        return RankExit(
            rank,
            record.get("exit_code"),
            record.get("signal"),
            float(ended) if ended is not None else now_unix_s,
            raised.read_note(self._exit_dir, rank.global_rank),
            raised.ended(self._exit_dir, rank.global_rank),
            tail if isinstance(tail, str) else "",
            record.get("warm") is True,
        )

    def launcher_exit(self, returncode: int, now_unix_s: float) -> list[RankExit]:
        """The exits only the launcher's tells: of each rank with no shim to record its
        own (it ended as its torchrun did: a clean end is 0, a dead rank fails it), or of
        the wrapper itself when no rank was ever found below it (the node's one rank)."""
        if not self._wrapper:
            return []
        if not self._ranks:
            rank = RankProcess(self._node_rank, 0, self._launcher_pid)
            self._ranks[rank.global_rank] = rank
        code, signum = (returncode, None) if returncode >= 0 else (None, -returncode)
        exits = []
        for key, rank in self._ranks.items():
            if key not in self._reported and rank.shim_pid is None:
                self._reported.add(key)
                exits.append(RankExit(rank, code, signum, now_unix_s))
        return exits

    def _rank_of_shim(self, process: psutil.Process) -> RankProcess | None:
        try:
            cmdline = process.cmdline()
            if "agent.node.rankexec" not in cmdline:
                return None
            environ = process.environ()
            children = process.children()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        pid = _worker_pid(children, environ, self._exit_dir)
        if pid is None or "RANK" not in environ:
            return None  # the worker is not started yet; found on a later pass
        return RankProcess(
            global_rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            pid=pid,
            shim_pid=process.pid,
            world_size=_int_or_none(environ.get("WORLD_SIZE")),
            local_world_size=_int_or_none(environ.get("LOCAL_WORLD_SIZE")),
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


def shim_worker(shim: psutil.Process) -> int | None:
    """The pid of the worker under rank shim ``shim`` (None: not started, or gone): its
    child, or the warm pool's child it recorded. Raises psutil's errors."""
    environ = shim.environ()
    exit_dir = environ.get(ENV_EXIT_DIR)
    return _worker_pid(shim.children(), environ, Path(exit_dir) if exit_dir else None)


def _worker_pid(
    children: list[psutil.Process], environ: dict[str, str], exit_dir: Path | None
) -> int | None:
    if children:
        return children[0].pid
    if exit_dir is None or "RANK" not in environ:
        return None
    return warm_worker(exit_dir, environ["RANK"])


def warm_worker(exit_dir: Path, rank: str) -> int | None:
    """The pid of the rank's worker when the warm pool forked it (its shim's record:
    :mod:`agent.node.rankexec`); None when there is none."""
    try:
        text = worker_file(exit_dir, rank).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _with_oom_counter(rank: RankProcess) -> RankProcess:
    """``rank`` with its memory cgroup's oom_kill count as it is now."""
    counter = kernlog.memory_cgroup(rank.pid)
    return replace(rank, oom_counter=counter, oom_kills_at_start=kernlog.oom_kills(counter))


def _int_or_none(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() else None


def _bare_workers(descendants: list[psutil.Process]) -> list[RankProcess | None]:
    """torchrun workers with no rank shim above them (a torchrun the agent could not
    fit): the topmost processes with torchrun's worker environment that are not shims
    or a shim's worker (a worker's own children, data loaders, inherit it too)."""
    environs: dict[int, dict[str, str]] = {}
    parents: dict[int, int] = {}
    shims: set[int] = set()
    for process in descendants:
        try:
            environ = process.environ()
            if "TORCHELASTIC_RUN_ID" not in environ or "RANK" not in environ:
                continue
            environs[process.pid] = environ
            parents[process.pid] = process.ppid()
            if "agent.node.rankexec" in process.cmdline():
                shims.add(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [
        RankProcess(
            global_rank=int(environ["RANK"]),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            pid=pid,
            world_size=_int_or_none(environ.get("WORLD_SIZE")),
            local_world_size=_int_or_none(environ.get("LOCAL_WORLD_SIZE")),
        )
        for pid, environ in environs.items()
        if pid not in shims and parents[pid] not in environs and environ["RANK"].isdigit()
    ]
