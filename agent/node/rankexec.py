"""The parent of one rank: runs it, records how it ended, ends the same way.

torchrun starts each worker as ``python -m agent.node.rankexec TARGET ARGS...``
(:mod:`agent.node.launch` arranges this). torchrun, not the node agent, reaps its
workers, and the exit status of a process is only ever told to its parent; so
this shim is the worker's parent and writes ``rank-<RANK>.json`` (exit code or
signal, pid, time) into ``RESURGO_EXIT_DIR`` the moment the worker ends. Then
it ends exactly as the worker did (same code, or the same signal), so torchrun
sees what it would have seen without it.

In a per-rank launch (``srun python train.py`` given to ``resurgo submit``,
:mod:`agent.node.launch`), the worker also gets the Slurm task variables of its
rank (``SLURM_PROCID`` = ``RANK``, ...), as srun would have set them.

Signals torchrun or Slurm send to the worker (SIGTERM, SIGINT, ...) are
forwarded. TARGET is a script run with this interpreter, ``--module NAME``, or
``--no-python EXECUTABLE``.

The worker's standard error passes through this shim: every byte is written on
to the shim's own standard error as it comes, and the last lines are kept, so
that the exit record carries the worker's last words (``stderr_tail``: a Python
traceback, NCCL's or gloo's complaint, a C++ ``terminate called``) however it
died, a SIGKILL included. Should the shim itself die, torchrun ends the
worker's whole group anyway (its child, the shim, failed), so the pipe adds no
way for a worker to die that it did not have.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import IO, Protocol

from agent.node.launch import ENV_SLURM_TASKS, ENV_WARM_SOCKET, slurm_task_env
from agent.node.warmpool import MAX_MESSAGE, Forked, die_with_parent, exit_status, fork_from_pool

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip


# The worker's last words kept for its exit record: at most this many lines and characters.
TAIL_LINES = 20
TAIL_CHARS = 2000
# After the worker ended, how long what it wrote last may still be taken from the pipe
# (it is there already; the wait is for the copying thread). The pipe's end is not
# awaited: a process the worker started (a data loader worker) may hold it open.
DRAIN_S = 0.2


class Worker(Protocol):
    """The worker as the shim sees it: a subprocess it started, or a warm pool's child."""

    pid: int
    stderr: IO[bytes] | None

    def send_signal(self, signum: int) -> None: ...

    def wait(self) -> int: ...


class WarmWorker:
    """A worker the node's warm pool forked (:mod:`agent.node.warmpool`): signalled by its
    pid, its exit status told by the pool over the connection."""

    def __init__(self, forked: Forked, stderr: IO[bytes]) -> None:
        self._conn = forked.conn
        self.pid = forked.pid
        self.stderr: IO[bytes] | None = stderr

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def wait(self) -> int:
        try:
            code = exit_status(self._conn.recv(MAX_MESSAGE))
        except OSError:
            code = None
        self._conn.close()
        if code is not None:
            return code
        # The pool died: its children die with it (PR_SET_PDEATHSIG, SIGKILL).
        print("resurgo rankexec: the warm pool ended before the rank did", file=sys.stderr)
        return -signal.SIGKILL


def start_warm(args: list[str], env: dict[str, str]) -> WarmWorker | None:
    """The worker forked by the node's warm pool; None when there is none, or it refused
    (said on standard error) or did not answer: the worker is then started cold."""
    path = env.get(ENV_WARM_SOCKET)
    if not path or not args or args[0] == "--no-python":
        return None
    argv = ["-m", *args[1:]] if args[0] == "--module" else list(args)
    # The worker is the pool's child, outside the step Slurm ends and outside torchrun's
    # tree: tied to this shim (the pool kills it when this end closes), and this shim to
    # its torchrun, which starts it in a session of its own and, killed, would leave it.
    die_with_parent()
    read_end, write_end = os.pipe()
    try:
        forked = fork_from_pool(path, argv, env, [0, 1, write_end])
    finally:
        os.close(write_end)
    if isinstance(forked, str):
        if forked:
            print(f"resurgo rankexec: started cold: {forked}", file=sys.stderr)
        os.close(read_end)
        return None
    return WarmWorker(forked, os.fdopen(read_end, "rb"))


def worker_file(exit_dir: Path, rank: str | int) -> Path:
    """Where a warm worker's pid is written for the agent (a cold one is the shim's child)."""
    return exit_dir / f"rank-{rank}.worker"


class Tail:
    """Copies a stream on as it comes and keeps its last bytes (a thread of its own)."""

    def __init__(self, source: IO[bytes], sink: IO[bytes]) -> None:
        self._source = source
        self._sink = sink
        self._chunks: deque[bytes] = deque()
        self._kept = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, name="resurgo-stderr", daemon=True)
        self._thread.start()

    def _copy(self) -> None:
        while chunk := self._read():
            with contextlib.suppress(OSError, ValueError):
                self._sink.write(chunk)
                self._sink.flush()
            with self._lock:
                self._chunks.append(chunk)
                self._kept += len(chunk)
                while self._kept - len(self._chunks[0]) >= TAIL_CHARS * 4:
                    self._kept -= len(self._chunks.popleft())

    def _read(self) -> bytes:
        try:
            return os.read(self._source.fileno(), 65536)
        except OSError:
            return b""

    def text(self, wait_s: float = DRAIN_S) -> str:
        """The last lines read (within :data:`TAIL_LINES` and :data:`TAIL_CHARS`), after
        waiting up to ``wait_s`` for the stream's end."""
        self._thread.join(wait_s)
        with self._lock:
            kept = b"".join(self._chunks)
        return last_lines(kept.decode(errors="replace"))


def last_lines(text: str) -> str:
    """The last :data:`TAIL_LINES` non-empty lines of ``text``, at most :data:`TAIL_CHARS`
    characters (cut at the front)."""
    lines = [line.rstrip() for line in text.replace("\r", "\n").split("\n") if line.strip()]
    return "\n".join(lines[-TAIL_LINES:])[-TAIL_CHARS:]


def child_argv(args: list[str]) -> list[str]:
    """The worker's argv from the shim's arguments."""
    if not args:
        raise SystemExit(
            "usage: python -m agent.node.rankexec [--module|--no-python] TARGET [ARGS...]"
        )
    if args[0] == "--module":
        return [sys.executable, "-m", *args[1:]]
    if args[0] == "--no-python":
        return args[1:]
    return [sys.executable, *args]


def record_exit(
    exit_dir: Path,
    rank: str,
    local_rank: str,
    pid: int,
    returncode: int,
    stderr_tail: str = "",
    warm: bool = False,
) -> None:
    """Write ``rank-<rank>.json`` atomically: the agent may read it at any moment."""
    document = {
        "global_rank": int(rank),
        "local_rank": int(local_rank),
        "pid": pid,
        "exit_code": returncode if returncode >= 0 else None,
        "signal": -returncode if returncode < 0 else None,
        "time_unix_s": time.time(),
        "stderr_tail": stderr_tail,
        "warm": warm,
    }
    exit_dir.mkdir(parents=True, exist_ok=True)
    temporary = exit_dir / f".rank-{rank}.json.tmp"
    temporary.write_text(json.dumps(document))
    os.replace(temporary, exit_dir / f"rank-{rank}.json")


def main(args: list[str]) -> None:
    argv = child_argv(args)
    env = dict(os.environ)
    if env.get(ENV_SLURM_TASKS):
        env.update(slurm_task_env(env))
    exit_dir = os.environ.get("RESURGO_EXIT_DIR")
    child: Worker | None = start_warm(args, env)
    if child is not None and exit_dir:
        with contextlib.suppress(OSError):
            path = worker_file(Path(exit_dir), os.environ.get("RANK", "0"))
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(str(child.pid))
            os.replace(path.with_suffix(".tmp"), path)
    if child is None:
        child = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)
    assert child.stderr is not None
    tail = Tail(child.stderr, sys.stderr.buffer)

    def forward(signum: int, _frame: object) -> None:
        # The worker decides what a SIGTERM means (e.g. a last checkpoint).
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    returncode = child.wait()
    if exit_dir:
        try:
            record_exit(
                Path(exit_dir),
                os.environ.get("RANK", "0"),
                os.environ.get("LOCAL_RANK", "0"),
                child.pid,
                returncode,
                tail.text(),
                warm=isinstance(child, WarmWorker),
            )
        except OSError as error:
            print(f"resurgo rankexec: could not record the exit: {error}", file=sys.stderr)
    if returncode < 0:
        for forwarded in FORWARDED:
            signal.signal(forwarded, signal.SIG_DFL)
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    sys.exit(returncode)


if __name__ == "__main__":
    main(sys.argv[1:])
