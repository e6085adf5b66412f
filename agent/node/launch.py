"""What the node agent runs: the user's command, fitted to the CURRENT allocation.

Pure: argv and environment in, argv and environment out. Three launch shapes
(:func:`launch_shape`), each kept as written except for what a relaunch must
change:

- **torchrun** (``torchrun ...`` or ``python -m torch.distributed.run ...``):
  the node count, rendezvous (c10d on the first node, a fresh id per launch)
  and ``--max-restarts=0`` (restarts are the supervisor's decision, not
  torchrun's: an in-place restart would hide the fault from Resurgo) are set
  from the allocation; every other torchrun option and the script's arguments
  pass through unchanged. Each worker runs under :mod:`agent.node.rankexec`, a tiny
  parent that records the worker's exit code or signal for the agent, since
  torchrun, not the agent, is the worker's parent and reaps it.
- **per rank**: ``srun [options] COMMAND`` (one task per rank, the way
  Lightning and Megatron are launched on Slurm) or a plain ``python
  train.py``. A nested ``srun`` inside the agent's own step would wait forever
  for nodes that step holds, so the agent starts the ranks itself: the same
  fitted torchrun, ``--nproc-per-node`` ranks per node, each under the shim,
  which gives the command the ``SLURM_PROCID``/``SLURM_LOCALID``/
  ``SLURM_NTASKS``/``SLURM_NODEID`` of its rank besides torchrun's ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ... (:func:`slurm_task_env`).
- **wrapper**: anything else (``bash run.sh``, ``bash -c``, ``make``) runs as
  it is. A torchrun it starts gets the job's world all the same: ``torchrun``
  on ``PATH`` is Resurgo's (:data:`TORCHRUN_SHIM`, fitting it exactly like
  the first shape), and ``python -m torch.distributed.run`` reads the job's
  node count and rendezvous from ``PET_*`` variables (torchrun's parser takes
  every option's default from ``PET_<OPTION>``; an explicit flag still wins,
  which the agent then reports as a world that is not the job's).

:func:`refusal` names the commands Resurgo cannot supervise (other MPI-style
launchers, srun options it would silently drop), for ``resurgo submit``.

Every shape gets the ``RESURGO_*`` environment the in-rank library reads, and
:data:`BOOTSTRAP_DIR` first on ``PYTHONPATH`` (automatic progress for scripts
that import nothing: :mod:`agent.train.autohooks`).
"""

from __future__ import annotations

import argparse
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import PurePath

from agent.skips import ENV_SKIP_SAMPLES, SampleRange, format_skip_samples
from agent.wire.environ import (
    ENV_AGENT_SOCKET,
    ENV_CKPT_INTERVAL_FILE,
    ENV_CKPT_INTERVAL_S,
    ENV_CKPT_ROOT,
    ENV_EXIT_DIR,
    ENV_JOB_ID,
    ENV_NODE,
    ENV_RESTART_COUNT,
    ENV_RESUME_FROM,
    ENV_SAVE_REQUEST_FILE,
)
from agent.wire.errors import ConfigError

ENV_TORCHRUN_OPTIONS_DIR = "RESURGO_TORCHRUN_OPTIONS_DIR"
# The socket of the node's warm pool (agent.node.warmpool) in the ranks' environment.
ENV_WARM_SOCKET = "RESURGO_WARM_SOCKET"
# torchrun's --log-dir, read from the environment when the option is not given.
ENV_TORCHRUN_LOG_DIR = "PET_LOG_DIR"
# The allocation as JSON, for the torchrun that a wrapper script starts (agent.node.torchrunshim).
ENV_ALLOCATION = "RESURGO_ALLOCATION"
# Set for per-rank launches: the rank shim gives the command Slurm's task variables.
ENV_SLURM_TASKS = "RESURGO_SLURM_TASKS"
# First on every rank's PYTHONPATH: its sitecustomize arms automatic progress
# for scripts that import nothing (agent.train.autohooks; opt out with
# RESURGO_AUTO_PROGRESS=0).
BOOTSTRAP_DIR = str(PurePath(__file__).parents[1] / "bootstrap")
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
    "--rdzv-conf",
    "--rdzv_conf",
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


# srun options a per-rank launch honours (the count of ranks per node) or that
# change nothing when the agent starts the ranks itself; any other is refused
# at submit rather than silently dropped. Values: does the option take one?
_SRUN_OPTIONS = {
    "-n": True, "--ntasks": True, "--ntasks-per-node": True,
    "-c": True, "--cpus-per-task": True,  # the allocation's own, from sbatch
    "--mpi": True, "--export": True,
    "-u": False, "--unbuffered": False, "-l": False, "--label": False,
    "-K": False, "--kill-on-bad-exit": False,  # the supervisor decides on exits
}  # fmt: skip
# Launchers that start ranks their own way, across nodes: under Resurgo every
# node's agent would start a whole world of its own.
_FOREIGN_LAUNCHERS = {
    "mpirun": "an MPI launcher",
    "mpiexec": "an MPI launcher",
    "orterun": "an MPI launcher",
    "horovodrun": "Horovod's launcher",
    "deepspeed": "DeepSpeed's launcher",
    "accelerate": "Accelerate's launcher",
    "salloc": "a new allocation",
    "sbatch": "a new job",
}


class Shape(enum.Enum):
    """How the user's command starts its ranks; see the module docstring."""

    TORCHRUN = "torchrun"
    PER_RANK = "per_rank"
    WRAPPER = "wrapper"


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
    # Whether this node's torchrun hosts the rendezvous store (None: torchrun guesses).
    rdzv_host: bool | None = None
    # torchrun's static rendezvous, each node's rank given (``node_rank``, the store's host
    # 0): no polls of a store while the nodes arrive. False: c10d, ranked as they arrive.
    static: bool = False

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
    # Windows of the global sample cursor the ranks do not train on (agent.skips).
    skip_samples: tuple[SampleRange, ...] = ()
    ckpt_root: str | None = None
    ckpt_interval_s: float | None = None
    ckpt_interval_file: str | None = None
    save_request_file: str | None = None
    # Ranks per node of a per-rank launch (srun's --ntasks-per-node wins).
    procs_per_node: int = 1
    # Where the agent put Resurgo's ``torchrun`` (TORCHRUN_SHIM): first on a
    # wrapper's PATH.
    shim_dir: str | None = None
    # Where torchrun's parser is described (agent.node.torchrun_options), for the
    # ``torchrun`` a wrapper starts.
    torchrun_options_dir: str | None = None
    # torchrun's --log-dir unless the user gave one: in the agent's run directory, which
    # goes with the launch. Without one torchrun makes a /tmp/torchelastic_* directory
    # at every start and never removes it: a cluster's nodes gather them by the thousand.
    torchrun_log_dir: str | None = None
    # The socket of this node's warm pool (agent.node.warmpool), for the rank shims.
    warm_pool: str | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """The process to start: argv, environment, its shape, and how many ranks it will run
    here (None: a wrapper's, learnt from its ranks)."""

    argv: tuple[str, ...]
    env: dict[str, str] = field(repr=False)
    shape: Shape
    local_ranks: int | None

    @property
    def is_torchrun(self) -> bool:
        """The ranks run under torchrun started by the agent (the torchrun and per-rank shapes)."""
        return self.shape is not Shape.WRAPPER


def torchrun_shim(python: str) -> str:
    """The ``torchrun`` put first on a wrapper's ``PATH``: fits the real one to the job."""
    return f'#!/bin/sh\nexec {_sh_quote(python)} -m agent.node.torchrunshim "$@"\n'


def _sh_quote(word: str) -> str:
    return "'" + word.replace("'", "'\"'\"'") + "'"


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


def is_python(command: Sequence[str]) -> bool:
    """A Python interpreter running a script or module (not torchrun), or a ``.py`` file."""
    if not command or is_torchrun(command):
        return False
    name = PurePath(command[0]).name
    return name.endswith(".py") or (
        name.startswith("python") and len(command) >= 2 and command[1] not in ("-c", "-")
    )


def launch_shape(command: Sequence[str]) -> Shape:
    """Which of the three shapes ``command`` is (see the module docstring)."""
    if is_torchrun(command):
        return Shape.TORCHRUN
    if (command and PurePath(command[0]).name == "srun") or is_python(command):
        return Shape.PER_RANK
    return Shape.WRAPPER


def split_srun(command: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
    """``srun [options] COMMAND`` -> (srun's options by name, COMMAND); ConfigError
    naming an option a per-rank launch would not apply, or a missing command."""
    options: dict[str, str | None] = {}
    words = list(command[1:])
    index = 0
    while index < len(words) and words[index].startswith("-"):
        word = words[index]
        index += 1
        if word.startswith("--"):
            name, equals, value = word.partition("=")
        else:
            name, value = word[:2], word[2:]
            equals = "=" if value else ""
        if name not in _SRUN_OPTIONS:
            raise ConfigError(
                f"srun option {word!r} is not applied when Resurgo starts the ranks itself "
                "(one process per rank, with SLURM_PROCID etc. set as srun would): give it to "
                "resurgo submit as an sbatch option, or drop it"
            )
        if _SRUN_OPTIONS[name] and not equals:
            if index >= len(words):
                raise ConfigError(f"srun option {name} needs a value")
            value = words[index]
            index += 1
        options[name] = value if _SRUN_OPTIONS[name] else None
    if index >= len(words):
        raise ConfigError("srun with no command: give the training command after srun's options")
    return options, words[index:]


def srun_tasks_per_node(options: Mapping[str, str | None], nnodes: int) -> int | None:
    """Ranks per node from srun's ``--ntasks-per-node`` or ``--ntasks`` over ``nnodes``
    nodes (None: neither given); ConfigError when they do not make whole nodes."""
    per_node = options.get("--ntasks-per-node")
    total = options.get("--ntasks") or options.get("-n")
    if per_node is not None:
        return _count("srun --ntasks-per-node", per_node)
    if total is None:
        return None
    count = _count("srun --ntasks", total)
    if count % nnodes:
        raise ConfigError(
            f"srun --ntasks={count} does not split evenly over {nnodes} nodes: give "
            "--ntasks-per-node instead, so that a smaller relaunch keeps the same ranks per node"
        )
    return count // nnodes


def _count(what: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{what}={value!r}: give a whole number >= 1")
    return int(value)


def refusal(command: Sequence[str], nnodes: int) -> str | None:
    """Why Resurgo cannot supervise ``command`` and what to do instead; None when it can."""
    if not command:
        return "no command to launch: give it after `--`, e.g. -- torchrun train.py"
    name = PurePath(command[0]).name
    if name in _FOREIGN_LAUNCHERS:
        return (
            f"{name} is {_FOREIGN_LAUNCHERS[name]}: under Resurgo each node's agent starts "
            "that node's ranks, so every node would start a world of its own. Launch with "
            "torchrun (-- torchrun --nproc-per-node=K train.py), srun-style (-- srun python "
            "train.py, one process per rank with SLURM_PROCID), or python train.py per node"
        )
    if name == "srun":
        try:
            options, _ = split_srun(command)
            srun_tasks_per_node(options, nnodes)
        except ConfigError as error:
            return str(error)
    return None


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
    is torchrun's (:func:`agent.node.torchrun_options.torchrun_parser`), passed
    in so this module stays cheap to import; required for torchrun commands.
    """
    if not command:
        raise ConfigError("no command to launch: give it after `--`, e.g. -- torchrun train.py")
    # The windows to skip are this launch's alone: one left in the agent's own
    # environment (an earlier launch's) would make the ranks skip data still wanted.
    env = {name: value for name, value in environ.items() if name != ENV_SKIP_SAMPLES}
    env.update(_resurgo_env(allocation, settings))
    env["PYTHONPATH"] = with_bootstrap(environ.get("PYTHONPATH"))
    if settings.torchrun_log_dir and ENV_TORCHRUN_LOG_DIR not in environ:
        env[ENV_TORCHRUN_LOG_DIR] = settings.torchrun_log_dir  # a --log-dir given still wins
    shape = launch_shape(command)
    if shape is Shape.WRAPPER:
        env.update(torchrun_env(allocation, environ.get("PET_RDZV_CONF", "")))
        env[ENV_ALLOCATION] = json.dumps(asdict(allocation), sort_keys=True)
        if settings.shim_dir:
            rest = [entry for entry in environ.get("PATH", "").split(_PATHSEP) if entry]
            env["PATH"] = _PATHSEP.join([settings.shim_dir, *rest])
        return LaunchPlan(tuple(command), env, shape, local_ranks=None)
    if torchrun_parser is None:
        raise ValueError("plan_launch needs torch's torchrun parser")
    if shape is Shape.PER_RANK:
        per_rank = list(command)
        nproc = settings.procs_per_node
        if PurePath(command[0]).name == "srun":
            options, per_rank = split_srun(command)
            nproc = srun_tasks_per_node(options, allocation.nnodes) or nproc
        env[ENV_SLURM_TASKS] = "1"
        command = ["torchrun", f"--nproc-per-node={nproc}", "--no-python", *per_rank]
    argv, nproc = fit_torchrun(command, allocation, python, torchrun_parser)
    return LaunchPlan(argv, env, shape, local_ranks=nproc)


def fit_torchrun(
    command: Sequence[str],
    allocation: Allocation,
    python: str,
    torchrun_parser: argparse.ArgumentParser,
) -> tuple[tuple[str, ...], int]:
    """A torchrun command line fitted to ``allocation``, its workers under the rank shim,
    and its ranks per node."""
    parsed, kept = _split_torchrun(_torchrun_options(command), torchrun_parser)
    nproc = _nproc(parsed.nproc_per_node)
    target: list[str]
    if parsed.no_python:
        target = ["--no-python", parsed.training_script]
    elif parsed.module:
        target = ["--module", parsed.training_script]
    else:
        target = [parsed.training_script]
    argv = (
        python,
        "-m",
        "torch.distributed.run",
        *kept,
        *(
            f"--{name.lower().replace('_', '-')}={value}"
            for name, value in _rendezvous(allocation, parsed.rdzv_conf).items()
        ),
        "--max-restarts=0",
        "--no-python",
        python,
        "-m",
        "agent.node.rankexec",
        *target,
        *parsed.training_script_args,
    )
    return argv, nproc


def rdzv_conf(user_conf: str, rdzv_host: bool | None, static: bool = False) -> str:
    """The rendezvous settings: the user's, with ``is_host`` the agent's own.

    Told nothing, torchrun hosts the store on whichever node takes the endpoint's
    address for its own, and every node does when it is a loopback address or a
    name that several resolve alike; the store then lives on the node that bound
    first, and that node's loss ends the whole world. ``static``: the store's host
    is node rank 0 (no ``is_host``), and its wait for the nodes is ``timeout``,
    the user's ``join_timeout`` when that is all they set.
    """
    settings = [part for part in user_conf.split(",") if part.strip()]
    keys = {part.split("=", 1)[0].strip(): part for part in settings}
    if rdzv_host is not None or static:
        settings = [part for part in settings if part.split("=", 1)[0].strip() != "is_host"]
    if static:
        if "timeout" not in keys and "join_timeout" in keys:
            settings.append("timeout=" + keys["join_timeout"].split("=", 1)[1].strip())
    elif rdzv_host is not None:
        settings.append(f"is_host={str(rdzv_host).lower()}")
    return ",".join(settings)


def _rendezvous(allocation: Allocation, user_conf: str) -> dict[str, str]:
    """torchrun's rendezvous options for ``allocation``, by name (``NNODES``, ...)."""
    options = {
        "NNODES": str(allocation.nnodes),
        "RDZV_BACKEND": "static" if allocation.static else "c10d",
        "RDZV_ENDPOINT": f"{allocation.master_addr}:{allocation.master_port}",
        "RDZV_ID": allocation.rdzv_id,
    }
    if allocation.static:
        options["NODE_RANK"] = str(allocation.node_rank)
    if conf := rdzv_conf(user_conf, allocation.rdzv_host, allocation.static):
        options["RDZV_CONF"] = conf
    return options


def torchrun_env(allocation: Allocation, user_rdzv_conf: str = "") -> dict[str, str]:
    """``PET_*`` defaults that fit any torchrun below a wrapper to the job (its flags win)."""
    env = {f"PET_{name}": value for name, value in _rendezvous(allocation, user_rdzv_conf).items()}
    env["PET_MAX_RESTARTS"] = "0"
    return env


def allocation_from_env(environ: Mapping[str, str]) -> Allocation:
    """The allocation a wrapper's torchrun belongs to (:data:`ENV_ALLOCATION`)."""
    try:
        return Allocation(**json.loads(environ[ENV_ALLOCATION]))
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(
            f"{ENV_ALLOCATION} is missing or unreadable: Resurgo's torchrun runs only "
            "below a node agent"
        ) from error


def slurm_task_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Slurm's task variables for one rank of a per-rank launch, from torchrun's.

    What ``srun`` would have given the rank's task: its rank (``SLURM_PROCID``),
    local rank, node index among the ranks' nodes, and the task counts.
    """
    rank = environ.get("RANK", "0")
    world = environ.get("WORLD_SIZE", "1")
    local_world = environ.get("LOCAL_WORLD_SIZE", "1")
    return {
        "SLURM_PROCID": rank,
        "SLURM_LOCALID": environ.get("LOCAL_RANK", "0"),
        "SLURM_NODEID": environ.get("GROUP_RANK", "0"),
        "SLURM_NTASKS": world,
        "SLURM_NPROCS": world,
        "SLURM_STEP_NUM_TASKS": world,
        "SLURM_NTASKS_PER_NODE": local_world,
        "SLURM_TASKS_PER_NODE": f"{local_world}(x{environ.get('GROUP_WORLD_SIZE', '1')})",
    }


def _torchrun_options(command: Sequence[str]) -> list[str]:
    return list(command[1:]) if PurePath(command[0]).name == "torchrun" else list(command[3:])


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
        ENV_SKIP_SAMPLES: format_skip_samples(settings.skip_samples) or None,
        ENV_CKPT_ROOT: settings.ckpt_root,
        ENV_CKPT_INTERVAL_S: None
        if settings.ckpt_interval_s is None
        else repr(settings.ckpt_interval_s),
        ENV_CKPT_INTERVAL_FILE: settings.ckpt_interval_file,
        ENV_SAVE_REQUEST_FILE: settings.save_request_file,
        ENV_TORCHRUN_OPTIONS_DIR: settings.torchrun_options_dir,
        ENV_WARM_SOCKET: settings.warm_pool,
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
