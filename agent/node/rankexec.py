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
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent.node.launch import ENV_SLURM_TASKS, slurm_task_env

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)  # fmt: skip


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


def record_exit(exit_dir: Path, rank: str, local_rank: str, pid: int, returncode: int) -> None:
    """Write ``rank-<rank>.json`` atomically: the agent may read it at any moment."""
    document = {
        "global_rank": int(rank),
        "local_rank": int(local_rank),
        "pid": pid,
        "exit_code": returncode if returncode >= 0 else None,
        "signal": -returncode if returncode < 0 else None,
        "time_unix_s": time.time(),
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
    child = subprocess.Popen(argv, env=env)

    def forward(signum: int, _frame: object) -> None:
        # The worker decides what a SIGTERM means (e.g. a last checkpoint).
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    returncode = child.wait()
    exit_dir = os.environ.get("RESURGO_EXIT_DIR")
    if exit_dir:
        try:
            record_exit(
                Path(exit_dir),
                os.environ.get("RANK", "0"),
                os.environ.get("LOCAL_RANK", "0"),
                child.pid,
                returncode,
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
