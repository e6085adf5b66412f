"""The supervisor's configuration: daemon settings plus the recovery :class:`Policy`.

Sources, later ones winning (:mod:`agent.wire.settings`): a TOML file
(``--config FILE``; daemon settings at the top level, policy settings in a
``[policy]`` table), the environment (``RESURGO_SUPERVISOR_<FIELD>``,
``RESURGO_POLICY_<FIELD>``; ``RESURGO_STATE_DIR`` and ``RESURGO_JOBS_DIR``,
which the ``resurgo`` commands read too, are the lowest-priority source of
those two directories; with neither set anywhere, the state directory is
:func:`default_state_dir`), then flags (``--state-dir``,
``--policy-max-drain-share-per-hour``, ...). Durations carry their unit in
the name.

Example ``/etc/resurgo/supervisor.toml``::

    state_dir = "/var/lib/resurgo"
    listen_port = 8740
    url = "http://head01:8740"

    [policy]
    max_drain_share_per_hour = 0.2
    validation_level = "full"
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from agent.wire.errors import ConfigError
from agent.wire.settings import add_flags, add_version, layered, read_toml
from supervisor.core.failure_rules import DEFAULT_RULES, Rule
from supervisor.core.policy import Policy
from supervisor.failure_config import in_force, parse_rules

ENV_PREFIX = "RESURGO_SUPERVISOR_"
POLICY_ENV_PREFIX = "RESURGO_POLICY_"
POLICY_FLAG_PREFIX = "policy-"
DEFAULT_STATE_DIR = "/var/lib/resurgo"
DEFAULT_PORT = 8740


def default_state_dir(environ: Mapping[str, str], uid: int, *, system_dir_usable: bool) -> str:
    """The state directory when none is configured: :data:`DEFAULT_STATE_DIR`, unless a
    user other than root cannot use it (``system_dir_usable``: it exists and they may
    write it, for the supervisor, or search it, for the ``resurgo`` commands); then
    ``$XDG_STATE_HOME/resurgo``, else ``$HOME/.local/state/resurgo``, where the
    per-user unit's ``StateDirectory=resurgo`` puts it (``systemd/user/``).

    Root, and the site-wide service's user (its ``StateDirectory`` exists and is
    theirs), keep the system path, as before.
    """
    if uid == 0 or system_dir_usable:
        return DEFAULT_STATE_DIR
    # The XDG base-directory specification ignores a relative XDG_STATE_HOME.
    xdg = environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "resurgo")
    home = environ.get("HOME", "")
    if os.path.isabs(home):
        return os.path.join(home, ".local", "state", "resurgo")
    return DEFAULT_STATE_DIR


def this_users_state_dir(environ: Mapping[str, str], *, write: bool) -> str:
    """:func:`default_state_dir` for the user running this process; ``write``: the
    supervisor (it writes the store), else a ``resurgo`` command."""
    # A command needs only the search bit: a site-wide supervisor gives users 0701/2751
    # so that `resurgo submit` reaches <state_dir>/jobs, and they must keep finding it.
    mode = os.W_OK | os.X_OK if write else os.X_OK
    usable = os.path.isdir(DEFAULT_STATE_DIR) and os.access(DEFAULT_STATE_DIR, mode)
    return default_state_dir(environ, os.geteuid(), system_dir_usable=usable)


@dataclass(frozen=True)
class SupervisorConfig:
    """The daemon's settings (the policy is separate: :class:`supervisor.core.policy.Policy`).

    - ``state_dir``: the store (``resurgo.db``; a local filesystem: SQLite's
      WAL needs shared memory, which NFS does not give).
    - ``jobs_dir``: one directory per submitted job (spec and signing secret);
      compute nodes read the job's secret there, so it must be on a
      filesystem they share. Empty: ``<state_dir>/jobs`` (one machine).
    - ``state_group``: a group of operators who may read the store: the
      state directory is then 2750 and the store's files 0640 (empty: 0700
      and 0600; ``supervisor/store/modes.py``; set at every start, whatever
      the umask).
    - ``listen_host``: the address the API listens on (``0.0.0.0``: every
      interface).
    - ``listen_port``: the TCP port the API listens on (0: one the system picks).
    - ``url``: how agents and drivers reach the API (empty:
      ``http://<hostname>:<port>``).
    - ``poll_s``: Slurm polling period (``squeue``/``sinfo``).
    - ``tick_s``: how often waits (evidence windows, backoff) are re-checked.
    - ``lease_s``: an agent silent this long is lost (its node is blamed).
    - ``reconcile_s``: how often unfinished actions are retried.
    - ``interval_check_s``: how often the recommended checkpoint interval (Daly,
      from the cluster's MTBF and each job's save cost) is recomputed and,
      when it moved by more than 10%, pushed to the job's agents.
    - ``probation_check``: the command that says a drained node is healthy again
      (``{node}`` is replaced; e.g. ``ssh {node} /usr/sbin/nhc``); empty: the
      node answers Slurm and is not DOWN. Checked every ``interval_check_s``
      for nodes whose probation (``policy.probation_s``) is over.
    - ``straggler_check_s``: how often each running job's ranks are compared
      for a straggler (their compute times, from the agents' heartbeats).
    - ``slurm_timeout_s``: the limit on every Slurm command.
    - ``log_json``: ``yes``: one JSON object per log line; ``no``: plain text;
      ``auto``: JSON only when stderr is not a terminal (journald, a log file).
    - ``body_timeout_s``: how long a request's body may take to arrive; a
      slower one is answered 408 and its connection closed.
    - ``header_timeout_s``: how long a connection may take to send a request's
      head (also how long an idle keep-alive connection is kept); a slower
      one is closed.
    - ``events_per_minute``: the events one job may send a minute (at least;
      120 per rank of its world when that is more); beyond it a batch is
      refused 429 and its agent sends it again later (0: no budget).
    - ``event_quota``: the most agent events the store keeps of one job; past it
      (or past ``event_quota_mib``), the job's oldest reports are deleted down to
      90% of both, in one go with one log line (events a decision names and the
      supervisor's own records stay).
    - ``event_quota_mib``: the most MiB of agent event payloads the store keeps of
      one job; past it (or past ``event_quota``), the job's oldest reports are
      deleted down to 90% of both.
    - ``unauthenticated_buffer_bytes``: the most bytes the bodies of requests
      not yet authenticated may hold together (more: 503, retried later).
    - ``metrics_listen``: ``host:port`` of a listener of its own for
      ``/metrics`` (e.g. ``127.0.0.1:9740`` for a local Prometheus); empty:
      ``/metrics`` is served on the API's listener.
    - ``slurm_rights``: ``auto`` (detect whether this user may drain nodes:
      root, the SlurmUser or an operator AdminLevel), ``operator`` or
      ``user``. Without operator rights a blamed node is excluded and a drain
      ticket raised instead of a drain (``supervisor/slurm/rights.py``).
    - ``ticket_hook``: a command that receives each drain ticket as one JSON
      object on its standard input (e.g. a script that mails the admins);
      empty: none.
    - ``observe_only``: decide and record everything as usual, and do nothing: each
      drain, ticket, requeue, relaunch, stop and agent command is recorded as
      what it would have done (``would_act`` in the job's events), and a job
      whose step fails ends as it would without Resurgo. Checkpoints are still
      validated and alerts still raised. For a trial beside a production
      cluster before the supervisor may act.
    - ``node_check``: the operator's health check (e.g. ``/usr/sbin/nhc``), run with the
      built-in node checks when the supervisor checks a node one job blamed
      before draining it (``policy.corroborate_drains``); empty: the built-in
      checks only. The check is a Slurm job of the supervisor's user, pinned to
      the node with ``--nodelist``, once the blaming job left it
      (``supervisor/act/node_checks.py``).
    - ``node_check_sbatch``: extra ``sbatch`` options for those checks (e.g.
      ``--partition=admin --qos=high``), so they start ahead of queued work.
    - ``node_check_wait_s``: how long a check may wait for the node and the
      queue; one that has not started by then has no verdict (nothing drained).
    - ``node_check_time_s``: how long each of the check's checks may run (the
      Slurm job's time limit is a minute more).
    - ``validation_memory_mib``: the memory validating one checkpoint may use beyond
      the validator's imports. Validation runs in a process of its own (a
      checkpoint is its owner's data); a checkpoint past this limit or the next
      two is invalid, and the next older one is tried
      (``supervisor/act/validation.py``).
    - ``validation_cpu_s``: the CPU time validating one checkpoint may take; a
      checkpoint past it is invalid, and the next older one is tried.
    - ``validation_timeout_s``: the wall-clock time validating one checkpoint may
      take; a checkpoint past it is invalid, and the next older one is tried.
    - ``validation_keep_warm``: start the validation process (torch imported:
      about 250 MiB, and seconds of CPU) as soon as a job is followed, so that a
      recovery's validation need not wait for it (10 s on a loaded head node).
      Off: the first validation starts it; a head node short of memory, or a
      supervisor restarted often, saves the import. Either way it stops after
      five minutes without a job.
    - ``validate_ahead``: validate each job's newest checkpoint as soon as it is
      reported, in the background, so that a recovery takes that verdict while
      the checkpoint is unchanged (every file's name, size, inode and times)
      instead of reading it between the fault and the relaunch
      (``supervisor/act/ahead.py``). Off: each checkpoint is read once per
      recovery only, and never while the job trains.
    """

    state_dir: str = DEFAULT_STATE_DIR
    jobs_dir: str = ""
    state_group: str = ""
    listen_host: str = "0.0.0.0"
    listen_port: int = DEFAULT_PORT
    url: str = ""
    poll_s: float = 2.0
    tick_s: float = 1.0
    lease_s: float = 30.0
    reconcile_s: float = 10.0
    interval_check_s: float = 60.0
    probation_check: str = ""
    straggler_check_s: float = 30.0
    slurm_timeout_s: float = 15.0
    log_json: str = "auto"
    body_timeout_s: float = 30.0
    header_timeout_s: float = 30.0
    events_per_minute: int = 6000
    event_quota: int = 200_000
    event_quota_mib: int = 256
    unauthenticated_buffer_bytes: int = 128 << 20
    metrics_listen: str = ""
    slurm_rights: str = "auto"
    ticket_hook: str = ""
    observe_only: bool = False
    node_check: str = ""
    node_check_sbatch: str = ""
    node_check_wait_s: float = 3600.0
    node_check_time_s: float = 300.0
    validation_memory_mib: int = 4096
    validation_cpu_s: float = 600.0
    validation_timeout_s: float = 900.0
    validation_keep_warm: bool = True
    validate_ahead: bool = True

    def __post_init__(self) -> None:
        for name in (
            "poll_s", "tick_s", "lease_s", "reconcile_s", "interval_check_s", "slurm_timeout_s",
            "straggler_check_s", "body_timeout_s", "validation_cpu_s", "validation_timeout_s",
            "header_timeout_s", "node_check_wait_s", "node_check_time_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"supervisor setting {name} must be > 0, got {value!r}")
        if not 0 <= self.listen_port < 65536:
            raise ConfigError(f"supervisor setting listen_port {self.listen_port} is not a port")
        if self.log_json not in ("auto", "yes", "no"):
            raise ConfigError("supervisor setting log_json must be auto, yes or no")
        if self.slurm_rights not in ("auto", "operator", "user"):
            raise ConfigError(
                f"supervisor setting slurm_rights must be auto, operator or user, got "
                f"{self.slurm_rights!r}"
            )
        if self.unauthenticated_buffer_bytes < (8 << 20):
            raise ConfigError(
                "supervisor setting unauthenticated_buffer_bytes must be at least 8388608 "
                "(one largest body)"
            )
        if self.events_per_minute < 0:
            raise ConfigError("supervisor setting events_per_minute must be >= 0 (0: no budget)")
        if self.event_quota < 1000 or self.event_quota_mib < 1:
            raise ConfigError(
                "supervisor settings event_quota must be at least 1000 and event_quota_mib "
                "at least 1: a job's recent reports must fit"
            )
        if self.validation_memory_mib < 256:
            raise ConfigError(
                "supervisor setting validation_memory_mib must be at least 256: a checkpoint's "
                "metadata needs room to load"
            )
        if self.metrics_listen:
            self.metrics_address()
        try:
            shlex.split(self.node_check_sbatch)
            shlex.split(self.node_check)
        except ValueError as error:
            raise ConfigError(
                f"supervisor settings node_check / node_check_sbatch do not split like a shell "
                f"line: {error}"
            ) from error

    def metrics_address(self) -> tuple[str, int] | None:
        """``metrics_listen`` as (host, port); None when /metrics shares the API's listener."""
        if not self.metrics_listen:
            return None
        host, _, port = self.metrics_listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(
                f"supervisor setting metrics_listen {self.metrics_listen!r} is not host:port "
                "(e.g. 127.0.0.1:9740)"
            )
        return host.strip("[]"), int(port)

    @property
    def store_path(self) -> Path:
        """The SQLite store."""
        return Path(self.state_dir) / "resurgo.db"

    @property
    def jobs_path(self) -> Path:
        """Where submitted jobs' directories are (``jobs_dir``, else ``<state_dir>/jobs``)."""
        return Path(self.jobs_dir) if self.jobs_dir else Path(self.state_dir) / "jobs"

    def public_url(self, bound_port: int | None = None) -> str:
        """The URL agents use: ``url``, else this host and the (bound) port."""
        if self.url:
            return self.url.rstrip("/")
        return f"http://{socket.gethostname()}:{bound_port or self.listen_port}"


def build_parser() -> argparse.ArgumentParser:
    """``resurgo-supervisor``'s flags: every daemon and policy setting, and ``--config``."""
    parser = argparse.ArgumentParser(
        prog="resurgo-supervisor",
        description=(
            "Head-node daemon: watches every job's ranks through the node agents, decides "
            "recoveries (blame, drain, checkpoint, relaunch) and carries them out through "
            "Slurm. Settings: TOML (--config), RESURGO_SUPERVISOR_* / RESURGO_POLICY_* "
            "environment variables, then these flags."
        ),
    )
    add_version(parser)
    parser.add_argument(
        "--config", type=Path, help="TOML file, the policy in a [policy] table (default: none)"
    )
    parser.add_argument(
        "--print-rules",
        action="store_true",
        help="list the failure rules in force (the config's [[failure_rules]] first, then the "
        "built-in ones) and exit (default: false)",
    )
    add_flags(parser, SupervisorConfig)
    add_flags(parser, Policy, POLICY_FLAG_PREFIX)
    return parser


@dataclass(frozen=True)
class Settings:
    """Everything ``resurgo-supervisor`` is told: the daemon's settings, the policy, the
    failure rules in force (the operator's first), and whether only to list those."""

    config: SupervisorConfig
    policy: Policy
    rules: tuple[Rule, ...] = DEFAULT_RULES
    print_rules: bool = False


def load_config(
    argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> tuple[SupervisorConfig, Policy]:
    """The daemon settings and the policy from ``--config``, the environment and flags."""
    settings = load_settings(argv, environ)
    return settings.config, settings.policy


def load_settings(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> Settings:
    """:class:`Settings` from ``--config``, the environment and flags."""
    env = os.environ if environ is None else environ
    args = build_parser().parse_args(list(argv))
    document: dict[str, Any] = {}
    if args.config is not None:
        document = read_toml(args.config, "supervisor")
    policy_doc = document.pop("policy", {})
    if not isinstance(policy_doc, dict):
        raise ConfigError(f"[policy] in {args.config} must be a table")
    source = str(args.config)
    operator_rules = parse_rules(document.pop("failure_rules", []), source)
    # The CLI's RESURGO_STATE_DIR names the same directory: one variable serves both.
    # Without it, a user who may not write the system path gets their own directory.
    shared = {"state_dir": env.get("RESURGO_STATE_DIR") or this_users_state_dir(env, write=True)}
    if env.get("RESURGO_JOBS_DIR"):
        shared["jobs_dir"] = env["RESURGO_JOBS_DIR"]
    config = layered(
        SupervisorConfig,
        owner="supervisor",
        base=shared,
        document=document,
        source=source,
        env_prefix=ENV_PREFIX,
        environ=env,
        flags=args,
    )
    policy = layered(
        Policy,
        owner="policy",
        document=policy_doc,
        source=f"[policy] of {source}",
        env_prefix=POLICY_ENV_PREFIX,
        environ=env,
        flags=args,
        flag_prefix=POLICY_FLAG_PREFIX,
    )
    return Settings(config, policy, in_force(operator_rules), args.print_rules)


def describe(config: SupervisorConfig, policy: Policy) -> dict[str, Any]:
    """Every effective setting, for the start-up log line."""
    return {
        **{f.name: getattr(config, f.name) for f in fields(config)},
        "policy": {
            f.name: getattr(getattr(policy, f.name), "value", getattr(policy, f.name))
            for f in fields(policy)
        },
    }
