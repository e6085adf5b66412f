"""What the node agent runs: the user's command, fitted to the CURRENT allocation.

Pure: argv and environment in, argv and environment out. The user's command
is kept as written except for what a relaunch must change:

- torchrun (``torchrun ...`` or ``python -m torch.distributed.run ...``): the
  node count, rendezvous (c10d on the first node, a fresh id per launch) and
  ``--max-restarts=0`` (restarts are the supervisor's decision, not torchrun's:
  an in-place restart would hide the fault from Resurgo) are set from the
  allocation; every other torchrun option and the script's arguments pass
  through unchanged. Each worker runs under :mod:`agent.rankexec`, a tiny
  parent that records the worker's exit code or signal for the agent, since
  torchrun, not the agent, is the worker's parent and reaps it.
- any other command runs as it is, as the node's single "rank".

Both get the ``RESURGO_*`` environment the in-rank library reads, and
:data:`BOOTSTRAP_DIR` first on ``PYTHONPATH`` (automatic progress for
scripts that import nothing: :mod:`agent.train.autohooks`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePath

from agent.errors import ConfigError

ENV_JOB_ID = "RESURGO_JOB_ID"
ENV_NODE = "RESURGO_NODE"
ENV_AGENT_SOCKET = "RESURGO_AGENT_SOCKET"
ENV_EXIT_DIR = "RESURGO_EXIT_DIR"
ENV_RESTART_COUNT = "RESURGO_RESTART_COUNT"
ENV_RESUME_FROM = "RESURGO_RESUME_FROM"
ENV_CKPT_ROOT = "RESURGO_CKPT_ROOT"
ENV_CKPT_INTERVAL_S = "RESURGO_CKPT_INTERVAL_S"
ENV_CKPT_INTERVAL_FILE = "RESURGO_CKPT_INTERVAL_FILE"
ENV_SAVE_REQUEST_FILE = "RESURGO_SAVE_REQUEST_FILE"
# First on every rank's PYTHONPATH: its sitecustomize arms automatic progress
# for scripts that import nothing (agent.train.autohooks; opt out with
# RESURGO_AUTO_PROGRESS=0).
BOOTSTRAP_DIR = str(PurePath(__file__).parent / "bootstrap")
_PATHSEP = ":"

# torchrun options the agent sets itself; the user's values are dropped.
_CONTROLLED = {
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--rdzv-backend",
    "--rdzv_backend",
    "--rdzv-endpoint",
    "--rdzv_endpoint",
    "--rdzv-id",
    "--rdzv_id",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
    "--standalone",
    "--max-restarts",
    "--max_restarts",
    "--no-python",
    "--no_python",
    "--module",
    "-m",
    "--run-path",
    "--run_path",
}


@dataclass(frozen=True)
class Allocation:
    """This launch's place in the job: where the rendezvous is and how many nodes meet."""

    job_id: str
    node: str
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    # Distinguishes launches within one restart count (a fast-path relaunch).
    launch_nonce: str = "0"

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise ConfigError(f"nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"master port {self.master_port} is not a TCP port")

    @property
    def rdzv_id(self) -> str:
        """Fresh per launch: a stale rank of an earlier launch can never join this one."""
        return f"resurgo-{self.job_id}-{self.restart_count}-{self.launch_nonce}"


@dataclass(frozen=True)
class LaunchSettings:
    """What the in-rank library is told through the environment."""

    agent_socket: str
    exit_dir: str
    resume_from: str | None = None
    ckpt_root: str | None = None
    ckpt_interval_s: float | None = None
    ckpt_interval_file: str | None = None
    save_request_file: str | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """The process to start: argv, environment, and how many ranks it will run here."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)
    is_torchrun: bool
    local_ranks: int


def is_torchrun(command: Sequence[str]) -> bool:
    """True for ``torchrun ...`` and ``python -m torch.distributed.run ...``."""
    if not command:
        return False
    if PurePath(command[0]).name == "torchrun":
        return True
    return (
        len(command) >= 3
        and PurePath(command[0]).name.startswith("python")
        and command[1] == "-m"
        and command[2] == "torch.distributed.run"
    )


def plan_launch(
    command: Sequence[str],
    allocation: Allocation,
    settings: LaunchSettings,
    environ: Mapping[str, str],
    python: str,
    torchrun_parser: argparse.ArgumentParser | None = None,
) -> LaunchPlan:
    """The argv and environment for this node's share of the job.

    ``python`` is the interpreter that runs torchrun and the rank shim (the
    agent's own, so Resurgo is importable in the ranks). ``torchrun_parser``
    is torch's own (``torch.distributed.run.get_args_parser()``), passed in so
    this module stays cheap to import; required for torchrun commands.
    """
    if not command:
        raise ConfigError("no command to launch: give it after `--`, e.g. -- torchrun train.py")
    env = dict(environ)
    env.update(_resurgo_env(allocation, settings))
    env["PYTHONPATH"] = with_bootstrap(environ.get("PYTHONPATH"))
    if not is_torchrun(command):
        return LaunchPlan(tuple(command), env, is_torchrun=False, local_ranks=1)
    if torchrun_parser is None:
        raise ValueError("plan_launch needs torch's torchrun parser for a torchrun command")
    options = list(command[1:]) if PurePath(command[0]).name == "torchrun" else list(command[3:])
    parsed, kept = _split_torchrun(options, torchrun_parser)
    nproc = _nproc(parsed.nproc_per_node)
    target: list[str]
    if parsed.no_python:
        target = ["--no-python", parsed.training_script]
    elif parsed.module:
        target = ["--module", parsed.training_script]
    else:
        target = [parsed.training_script]
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        *kept,
        f"--nnodes={allocation.nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={allocation.master_addr}:{allocation.master_port}",
        f"--rdzv-id={allocation.rdzv_id}",
        "--max-restarts=0",
        "--no-python",
        python,
        "-m",
        "agent.rankexec",
        *target,
        *parsed.training_script_args,
    ]
    return LaunchPlan(tuple(argv), env, is_torchrun=True, local_ranks=nproc)


def with_bootstrap(pythonpath: str | None) -> str:
    """``PYTHONPATH`` with :data:`BOOTSTRAP_DIR` first (once), the rest kept in order."""
    rest = [entry for entry in (pythonpath or "").split(_PATHSEP) if entry != BOOTSTRAP_DIR]
    return _PATHSEP.join([BOOTSTRAP_DIR, *(entry for entry in rest if entry)])


def _resurgo_env(allocation: Allocation, settings: LaunchSettings) -> dict[str, str]:
    env = {
        ENV_JOB_ID: allocation.job_id,
        ENV_NODE: allocation.node,
        ENV_AGENT_SOCKET: settings.agent_socket,
        ENV_EXIT_DIR: settings.exit_dir,
        ENV_RESTART_COUNT: str(allocation.restart_count),
    }
    optional = {
        ENV_RESUME_FROM: settings.resume_from,
        ENV_CKPT_ROOT: settings.ckpt_root,
        ENV_CKPT_INTERVAL_S: None
        if settings.ckpt_interval_s is None
        else repr(settings.ckpt_interval_s),
        ENV_CKPT_INTERVAL_FILE: settings.ckpt_interval_file,
        ENV_SAVE_REQUEST_FILE: settings.save_request_file,
    }
    env.update({name: value for name, value in optional.items() if value is not None})
    return env


def _split_torchrun(
    options: list[str], parser: argparse.ArgumentParser
) -> tuple[argparse.Namespace, list[str]]:
    """Parse torchrun's arguments with torch's parser; keep the option tokens we do not own."""
    try:
        parsed = parser.parse_args(options)
    except SystemExit as error:
        raise ConfigError(
            f"torchrun arguments {options!r} do not parse: run `torchrun --help` to check them"
        ) from error
    script_at = _script_index(options, parsed)
    takes_value = {
        string: action.nargs != 0 for action in parser._actions for string in action.option_strings
    }
    kept: list[str] = []
    index = 0
    head = options[:script_at]
    while index < len(head):
        token = head[index]
        name = token.split("=", 1)[0]
        consumes_next = "=" not in token and takes_value.get(name, False)
        if name not in _CONTROLLED:
            kept.append(token)
            if consumes_next and index + 1 < len(head):
                kept.append(head[index + 1])
        index += 2 if consumes_next else 1
    return parsed, kept


def _script_index(options: list[str], parsed: argparse.Namespace) -> int:
    """Index of the training script in ``options`` (its arguments follow it verbatim)."""
    tail = list(parsed.training_script_args)
    for index in range(len(options) - len(tail) - 1, -1, -1):
        if options[index] == parsed.training_script and options[index + 1 :] == tail:
            return index
    raise ConfigError(f"cannot find the training script in torchrun arguments {options!r}")


def _nproc(value: str) -> int:
    try:
        count = int(value)
    except ValueError as error:
        raise ConfigError(
            f"--nproc-per-node={value!r}: Resurgo needs an explicit number of ranks per node "
            "(e.g. --nproc-per-node=8) to know when every rank has started"
        ) from error
    if count < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {count}")
    return count
