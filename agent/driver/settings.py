"""The driver's command line: what the batch script passes, as :class:`DriverSettings`;
and :data:`Ask`, the driver's question to the supervisor as its parts call it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.wire.errors import ConfigError
from agent.wire.protocol import DriverAnswer

# A relaunched step that fails this fast did not start (bad node list, srun refused).
START_CHECK_S = 5.0

# ``ask(request, wait_s=...)``: post a DriverRequest until answered or ``wait_s`` passed
# (None then); the driver's one link to the supervisor (``Driver._ask``).
Ask = Callable[..., Awaitable[DriverAnswer | None]]


@dataclass(frozen=True)
class DriverSettings:
    """The driver's command line (the batch script passes it)."""

    job_id: str
    job_dir: Path
    supervisor_url: str
    ckpt_root: str
    command: tuple[str, ...]
    python: str = sys.executable
    supervisor_wait_s: float = 600.0
    start_wait_s: float = 60.0
    request_timeout_s: float = 10.0
    start_check_s: float = START_CHECK_S
    watch_s: float = 2.0
    kill_grace_s: float = 10.0
    # The agents' SIGTERM-to-SIGKILL grace, counted into the time-limit warning.
    stop_grace_s: float = 30.0
    # Seconds before the time limit to start the planned stop (None: computed).
    time_limit_lead_s: float | None = None
    # Ranks per node, for the agents of a per-rank launch (srun-style, python train.py).
    procs_per_node: int = 1
    # The world's node count when the allocation holds hot spares besides it
    # (None: the world is the whole allocation). Used only when no supervisor
    # says where to launch.
    world_nodes: int | None = None
    # Whether the agents' heartbeats go through the driver's aggregator.
    aggregate: bool = True
    # Whether torchrun and the ranks fork from the nodes' warm pools (agent.driver.warm).
    warm_pool: bool = True


def build_parser() -> argparse.ArgumentParser:
    """``python -m agent.driver``'s flags."""
    parser = argparse.ArgumentParser(
        prog="python -m agent.driver",
        description="Resurgo's in-job driver: runs the node agents with srun and relaunches "
        "them where the supervisor says after a fault. Written into batch scripts by "
        "`resurgo submit`.",
    )
    parser.add_argument(
        "--jobs-dir", required=True, help="the supervisor's jobs directory (holds the secret)"
    )
    parser.add_argument("--supervisor-url", required=True)
    parser.add_argument("--ckpt-root", required=True)
    parser.add_argument(
        "--procs-per-node",
        type=int,
        default=1,
        help="ranks per node: the agents start this many of a per-rank command (default 1)",
    )
    parser.add_argument(
        "--supervisor-wait-s",
        type=float,
        default=600.0,
        help="after a failure, how long to keep asking an unreachable supervisor",
    )
    parser.add_argument(
        "--start-wait-s",
        type=float,
        default=60.0,
        help="at start, how long to wait for the supervisor before launching unsupervised",
    )
    parser.add_argument(
        "--time-limit-lead-s",
        type=float,
        default=None,
        help="start the planned stop this many seconds before the time limit (default: "
        "room for two saves of the measured size, the stop grace and the requeue, at "
        "most a quarter of the limit)",
    )
    parser.add_argument(
        "--world-nodes",
        type=int,
        default=None,
        help="the world's node count when the job holds hot spares besides it: without "
        "a supervisor the driver launches on the allocation's first N nodes",
    )
    parser.add_argument(
        "--stop-grace-s",
        type=float,
        default=30.0,
        help="the agents' SIGTERM-to-SIGKILL grace (counted into the time-limit warning)",
    )
    parser.add_argument(
        "--no-aggregate",
        action="store_true",
        help="the agents send their heartbeats straight to the supervisor, not through the "
        "driver's aggregator (also RESURGO_AGGREGATE=0 in the job's environment)",
    )
    parser.add_argument(
        "--no-warm-pool",
        action="store_true",
        help="torchrun and the ranks start as fresh interpreters, not forked from each "
        "node's pool that imported torch (also RESURGO_WARM_POOL=0 in the job's environment)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return parser


def settings_from(argv: Sequence[str], environ: Mapping[str, str]) -> DriverSettings:
    """Parse the flags; the job id comes from Slurm (``SLURM_JOB_ID``)."""
    args = build_parser().parse_args(list(argv))
    job_id = environ.get("SLURM_JOB_ID", "")
    if not job_id:
        raise ConfigError("SLURM_JOB_ID is not set: the driver runs as a Slurm batch script")
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ConfigError("no command after --")
    return DriverSettings(
        job_id=job_id,
        job_dir=Path(args.jobs_dir) / job_id,
        supervisor_url=args.supervisor_url.rstrip("/"),
        ckpt_root=args.ckpt_root,
        command=tuple(command),
        supervisor_wait_s=args.supervisor_wait_s,
        start_wait_s=args.start_wait_s,
        stop_grace_s=args.stop_grace_s,
        time_limit_lead_s=args.time_limit_lead_s,
        procs_per_node=args.procs_per_node,
        world_nodes=args.world_nodes,
        aggregate=not args.no_aggregate and environ.get("RESURGO_AGGREGATE", "1") != "0",
        warm_pool=not args.no_warm_pool and environ.get("RESURGO_WARM_POOL", "1") != "0",
    )
