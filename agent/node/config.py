"""The node agent's configuration: one frozen dataclass, from TOML, then environment, then flags.

Every field can be set in a TOML file (``--config FILE``, keys as the field
names), in the environment as ``RESURGO_AGENT_<FIELD>`` (upper case), or as a
flag ``--<field-with-dashes>``; later sources win. Unknown TOML keys are an
error naming the key. Durations carry their unit in the name.

Slurm's own environment supplies the allocation when run under ``srun``:
``SLURM_JOB_ID``, ``SLURMD_NODENAME``, ``SLURM_STEP_NUM_NODES`` (the step's,
not the job's stale count after a resize), ``SLURM_NODEID`` and
``SLURM_RESTART_COUNT``.
"""

from __future__ import annotations

import argparse
import logging
import math
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from agent.node.hang import HangConfig
from agent.skips import SampleRange, parse_skip_samples
from agent.wire.errors import ConfigError
from agent.wire.settings import add_flags, add_version, layered, read_toml

log = logging.getLogger(__name__)

ENV_PREFIX = "RESURGO_AGENT_"


@dataclass(frozen=True)
class AgentConfig:
    """Everything ``resurgo-agent`` needs; see the module docstring for the sources.

    - ``job_id``: the Slurm job this agent serves (from SLURM_JOB_ID under srun).
    - ``node``: this node's name (from SLURMD_NODENAME, else the host name).
    - ``nnodes``: the step's node count (from SLURM_STEP_NUM_NODES under srun).
    - ``node_rank``: this node's place in the step, 0 to ``nnodes`` - 1 (from
      SLURM_NODEID under srun).
    - ``procs_per_node``: how many ranks a per-rank command (``srun python train.py``,
      ``python train.py``) runs on each node; srun's own ``--ntasks-per-node`` wins.
    - ``master_addr``: the host whose rendezvous store the launch's ranks meet at.
    - ``master_port``: the TCP port of that rendezvous store.
    - ``master_node``: the node whose torchrun hosts that store (empty: each torchrun
      guesses from the address, which any node takes for its own when it is a loopback).
    - ``node_order``: the launch's nodes, comma-separated, the store's host first: each
      node's place in it is its ``node_rank``, and torchrun meets in its static
      rendezvous, polling no store (empty, or not naming this node among ``nnodes``:
      torchrun's c10d rendezvous, ranking the nodes as they arrive).
    - ``restart_count``: Slurm's requeue count of the job (SLURM_RESTART_COUNT).
    - ``launch_nonce``: tells this launch's agents from an earlier one's on the same node.
    - ``attempt``: the supervisor's attempt number this launch belongs to (0: the first,
      unnumbered).
    - ``run_dir``: the agent's private directory for its sockets and spool (empty: one
      under /tmp named for the job, node and launch).
    - ``supervisor_url``: where to report (empty: no supervisor; events go to
      ``events_log`` alone).
    - ``secret_file``: the job's signing secret, needed with ``supervisor_url`` (0600).
    - ``aggregator_url``: the job's aggregator (in the in-job driver) that heartbeats go
      to instead of the supervisor (empty: none; events always go to the supervisor).
    - ``warm_pool``: ask this node's warm pool (run by the in-job driver:
      :mod:`agent.node.warmpool`) to fork each rank from an interpreter that has imported
      torch; a rank it cannot serve starts as a fresh interpreter.
    - ``events_log``: also append every event to this file as JSON lines (empty: no file).
    - ``resume_from``: the checkpoint the ranks resume from (empty: a fresh start).
    - ``skip_samples``: windows of the global sample cursor the ranks do not train on,
      START:END[,START:END...] (empty: none).
    - ``ckpt_root``: where the job's checkpoints are written.
    - ``ckpt_interval_s``: the checkpoint interval handed to the ranks (0: theirs).
    - ``heartbeat_report_s``: how often a heartbeat summary goes to the supervisor.
    - ``watch_interval_s``: how often the ranks' processes are checked for an exit.
    - ``hang_check_s``: how often the ranks' heartbeats are checked for a hang.
    - ``hang_floor_s``: the shortest training-step timeout, whatever the step times say.
    - ``hang_k``: the training-step timeout is this factor x the p99 of recent step times
      (at least ``hang_floor_s``).
    - ``hang_busy_floor_s``: the training-step timeout of a rank that stopped stepping but
      keeps a core busy outside any collective (work no hook sees, which its peers may wait
      for); reported as phase ``compute`` until then.
    - ``init_grace_s``: the timeout while a rank starts (imports, data loading, the
      first collective), before its first step.
    - ``checkpoint_grace_s``: the timeout while a rank saves a checkpoint.
    - ``eval_grace_s``: the timeout while a rank evaluates (``model.eval()``).
    - ``data_grace_s``: the timeout while a rank waits for its data loader's next batch.
    - ``stack_sample_s``: how often the ranks' stacks are sampled while they send no beats.
    - ``stack_timeout_s``: how long an unchanged stack inside a collective is tolerated.
    - ``health_check``: a command run on the node every ``health_check_interval_s``; a
      non-zero exit reports the node unhealthy (empty: none).
    - ``health_check_interval_s``: how often ``health_check`` runs.
    - ``health_check_timeout_s``: how long one run of ``health_check`` may take; one that
      takes longer reports the node unhealthy.
    - ``health_builtin_timeout_s``: how long each built-in check of the health gate before
      the launch may take (they run at once; ``agent/node/healthchecks.py``).
    - ``health_min_free_gb``: the free space (10^9 bytes) the gate wants under ``ckpt_root``
      (0: not checked).
    - ``stop_grace_s``: SIGTERM to SIGKILL when the ranks are stopped.
    - ``drain_timeout_s``: how long an agent whose launch failed keeps delivering its
      unsent reports before it exits (they stay spooled).
    - ``time_limit_file``: the in-job driver's time-limit notice (empty: none).
    - ``time_limit_poll_s``: how often that notice is looked for.
    """

    job_id: str = ""
    node: str = ""
    nnodes: int = 1
    node_rank: int = 0
    procs_per_node: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    master_node: str = ""
    node_order: str = ""
    restart_count: int = 0
    launch_nonce: str = "0"
    attempt: int = 0
    run_dir: str = ""
    supervisor_url: str = ""
    secret_file: str = ""
    aggregator_url: str = ""
    warm_pool: bool = False
    events_log: str = ""
    resume_from: str = ""
    skip_samples: str = ""
    ckpt_root: str = ""
    ckpt_interval_s: float = 0.0
    heartbeat_report_s: float = 5.0
    watch_interval_s: float = 0.25
    hang_check_s: float = 1.0
    hang_floor_s: float = 20.0
    hang_k: float = 5.0
    hang_busy_floor_s: float = 60.0
    init_grace_s: float = 600.0
    checkpoint_grace_s: float = 600.0
    eval_grace_s: float = 900.0
    data_grace_s: float = 600.0
    stack_sample_s: float = 5.0
    stack_timeout_s: float = 120.0
    health_check: str = ""
    health_check_interval_s: float = 300.0
    health_check_timeout_s: float = 60.0
    health_builtin_timeout_s: float = 30.0
    health_min_free_gb: float = 1.0
    stop_grace_s: float = 30.0
    # Long, because the supervisor may be restarting: a rank exit lost with
    # the agent turns one node's fault into a silent job. Delivered at once
    # when it is up; a clean end waits at most agent.node.agent.CLEAN_DRAIN_S.
    drain_timeout_s: float = 1800.0
    time_limit_file: str = ""
    time_limit_poll_s: float = 1.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    f"agent setting {field.name} must be finite and >= 0, got {value}"
                )
        for name in _PERIODS:
            if getattr(self, name) <= 0:
                raise ConfigError(f"agent setting {name} must be > 0: it is a loop's period")
        if self.health_builtin_timeout_s <= 0:
            raise ConfigError("agent setting health_builtin_timeout_s must be > 0")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"agent settings: node_rank {self.node_rank} must be in 0..nnodes-1 "
                f"(nnodes {self.nnodes})"
            )
        if self.procs_per_node < 1:
            raise ConfigError(f"agent setting procs_per_node must be >= 1: {self.procs_per_node}")
        if not 0 <= self.master_port < 65536:
            raise ConfigError(f"agent setting master_port {self.master_port} is not a port")
        if self.restart_count < 0 or self.attempt < 0:
            raise ConfigError("agent settings restart_count and attempt must be >= 0")
        self.skip_ranges()  # refused at start, not at the launch

    def skip_ranges(self) -> tuple[SampleRange, ...]:
        """``skip_samples`` as ranges; ConfigError naming the setting when malformed."""
        return parse_skip_samples(self.skip_samples, "agent setting skip_samples")

    def hang_config(self) -> HangConfig:
        """The hang/straggler thresholds for :mod:`agent.node.hang`."""
        return HangConfig(
            floor_s=self.hang_floor_s,
            k=self.hang_k,
            init_grace_s=self.init_grace_s,
            checkpoint_grace_s=self.checkpoint_grace_s,
            eval_grace_s=self.eval_grace_s,
            data_grace_s=self.data_grace_s,
            busy_floor_s=self.hang_busy_floor_s,
            stack_timeout_s=self.stack_timeout_s,
        )


# Periods of the agent's loops: zero would spin.
_PERIODS = ("heartbeat_report_s", "watch_interval_s", "hang_check_s", "stack_sample_s",
            "health_check_interval_s", "time_limit_poll_s")  # fmt: skip


def _slurm_defaults(environ: Mapping[str, str]) -> dict[str, Any]:
    found: dict[str, Any] = {"node": environ.get("SLURMD_NODENAME") or socket.gethostname()}
    sources = {
        "job_id": "SLURM_JOB_ID",
        "nnodes": "SLURM_STEP_NUM_NODES",
        "node_rank": "SLURM_NODEID",
        "restart_count": "SLURM_RESTART_COUNT",
    }
    for name, variable in sources.items():
        if environ.get(variable):
            found[name] = environ[variable]
    return found


def _ranked_by_order(config: AgentConfig) -> AgentConfig:
    """``config`` with its node rank its place in ``node_order``; without the order when
    the order does not name this node among ``nnodes`` (c10d ranks the nodes then)."""
    if not config.node_order:
        return config
    order = config.node_order.split(",")
    if len(order) != config.nnodes or order.count(config.node) != 1:
        log.warning(
            "node order %s does not name %s among %d node(s): torchrun ranks the nodes "
            "as they arrive", config.node_order, config.node, config.nnodes,
        )  # fmt: skip
        return replace(config, node_order="")
    return replace(config, node_rank=order.index(config.node))


def build_parser() -> argparse.ArgumentParser:
    """Flags for every field, plus ``--config`` and the command after ``--``."""
    parser = argparse.ArgumentParser(
        prog="resurgo-agent",
        description=(
            "Per-node agent: launches this node's share of the ranks (torchrun or any "
            "command), watches them, detects death, hangs and stragglers, collects stack "
            "dumps, and reports to the supervisor. Usage: resurgo-agent [options] -- "
            "torchrun --nproc-per-node=8 train.py ..."
        ),
    )
    add_version(parser)
    parser.add_argument("--config", type=Path, help="TOML file with agent settings (default: none)")
    add_flags(parser, AgentConfig)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return parser


def load_config(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[AgentConfig, list[str]]:
    """Merge Slurm's environment, TOML, ``RESURGO_AGENT_*`` and flags; return (config, command)."""
    args = build_parser().parse_args(list(argv))
    document = None if args.config is None else read_toml(args.config, "agent")
    config = layered(
        AgentConfig,
        owner="agent",
        base=_slurm_defaults(environ),
        document=document,
        source=str(args.config),
        env_prefix=ENV_PREFIX,
        environ=environ,
        flags=args,
    )
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    config = _ranked_by_order(config)
    if not config.job_id:
        raise ConfigError("no job id: run under srun (SLURM_JOB_ID) or pass --job-id")
    return config, command
