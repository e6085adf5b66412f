"""What every decision module shares: the recovery settings, the outcome, the live states.

:class:`Policy` is the operator's policy table, :class:`Decision` what
:func:`supervisor.core.policy.decide` and its helpers in
:mod:`~supervisor.core.recovery`, :mod:`~supervisor.core.follow_slurm` and
:mod:`~supervisor.core.planned_stop` return. They live here, below all of
those modules, so that each imports them downward and no module of the core
imports another that imports it back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from agent.wire.errors import ConfigError
from supervisor.core.anomaly import AnomalyAction, WatchPolicy
from supervisor.core.failure_rules import DEFAULT_RULES, Rule
from supervisor.core.intents import Intent, ValidationLevel
from supervisor.core.model import Cause, ClusterView, JobRecord, JobState

__all__ = ["LIVE", "Context", "Decision", "Policy", "decision"]

# States in which ranks run (or are being started): a fault there starts a recovery.
LIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RELAUNCHING})


@dataclass(frozen=True)
class Policy:
    """The supervisor's recovery settings; durations in seconds (``_s``).

    - ``max_drain_share_per_hour``: at most this share of the cluster's nodes
      drained per hour (rounded down); beyond it, alert instead.
    - ``min_drains_per_hour``: drains allowed per hour whatever the share says:
      on a small cluster the share rounds down to none (0.1 of 4 nodes), and a
      policy that can never drain only alerts.
    - ``drain_confidence``: the least blame confidence that drains a node.
    - ``straggler_drain``: drain a straggler's node once it was reported
      ``straggler_reports_to_drain`` times (false: stragglers are only
      reported, since slow is not broken).
    - ``straggler_reports_to_drain``: the straggler reports of one node after
      which it is drained, when ``straggler_drain`` is on.
    - ``straggler_factor``: a rank whose median compute time exceeds this
      factor x the other ranks' median is a straggler
      (:mod:`supervisor.core.stragglers`); the daemon reports it at each
      straggler check while it lasts.
    - ``straggler_min_steps``: the fewest steps a rank's median compute time is
      taken over before the rank can be judged a straggler.
    - ``max_restarts_without_progress``: consecutive restarts with no newer
      committed checkpoint before the job is stopped as FAILED.
    - ``backoff_base_s``: the wait before the first relaunch without progress,
      doubled for each further one in a row (up to ``backoff_max_s``); a
      first fault after progress relaunches with no wait.
    - ``backoff_max_s``: the longest wait before a relaunch, however many
      restarts without progress came before it.
    - ``user_exception_retries``: relaunches after a Python exception.
    - ``stop_grace_s``: SIGTERM to SIGKILL when stopping ranks.
    - ``validation_level``: how deep a checkpoint is validated before resuming.
    - ``hang_evidence_window_s``: how long other nodes' hang reports are
      awaited before blaming; the window closes early once every node of the
      attempt has reported.
    - ``exit_evidence_window_s``: after a rank fails, the longest the other
      ranks' exits are awaited before the earliest death is taken as the
      root cause (0: act on the first exit reported). The window closes
      sooner once every node's launcher has ended: their exits are all in.
    - ``resume_loss_tolerance``: replayed losses may differ by this much
      (absolute) and the resume still counts as verified (0: exact).
    - ``probation_s``: a node drained once for a transient fault returns to
      service this long after its drain, once its health check passes.
    - ``lemon_blames``: a node blamed this often within ``lemon_window_s``
      (across jobs) is a lemon: it stays out and no job uses it.
    - ``lemon_window_s``: how far back a node's blames count towards
      ``lemon_blames``, and a user's towards ``user_flag_share``.
    - ``lemon_users``: a node is a lemon only when its blames came from jobs
      of at least this many Slurm users (or it failed the supervisor's own
      check): one user's jobs, buggy or hostile, cannot keep a node from
      everyone.
    - ``user_flag_share``: a user whose jobs blamed this share of the
      cluster's nodes (rounded down, at least ``user_flag_min_nodes``) within
      ``lemon_window_s`` is flagged: the jobs, not the nodes, are the likelier
      cause, and their blames drain and ticket nothing more (one critical
      alert).
    - ``user_flag_min_nodes``: the fewest distinct nodes a user's jobs must
      have blamed before the user is flagged, however small the share makes
      it (0: never flag).
    - ``max_user_drain_share``: the share of the hourly drain limit (rounded
      down, at least one) that one Slurm user's jobs may take, drains and
      drain tickets alike: past it their blames exclude the node from the job
      and warn, as when the hourly share is used up.
    - ``corroborate_drains``: one job's evidence (its owner controls the job)
      removes the node from that job only; the node is drained once the
      supervisor's own check of it (a Slurm job of the supervisor's user on
      the node, after the job has left it) fails, or at once when jobs of
      another user blamed it too or Slurm itself reports it not responding
      (:mod:`supervisor.core.drains`). False: drain on one job's evidence.
    - ``storm_nodes``: the storm brake. Blames of at least this many distinct
      nodes from at least ``storm_jobs`` jobs within ``storm_window_s`` point at
      a shared cause (storage, the network, the scheduler) rather than at the
      nodes: no node is drained or ticketed while that holds, the jobs go on
      without the nodes they blamed, and one critical alert is raised (0: no
      brake).
    - ``storm_jobs``: the fewest distinct jobs whose blames make a storm (with
      ``storm_nodes`` nodes within ``storm_window_s``).
    - ``storm_window_s``: how far back blames count towards a storm.
    - ``grow_back``: a job running below its original size is requeued at a
      larger one from a checkpoint it just committed when idle nodes allow it.
    - ``relaunch_start_timeout_s``: a relaunched step none of whose agents
      called in by then never started (Slurm kept its nodes busy): the job
      falls back to the requeue path.
    - ``storage_wait_s``: after a storage failure (a full disk, a quota, an
      I/O error or a stale handle on the checkpoint root), the longest the
      relaunch waits for the root to take a checkpoint again before the job
      is stopped as FAILED (:mod:`supervisor.core.failures`).
    - ``storage_min_free_gb``: the free space (10^9 bytes) the storage wait's
      look wants on the checkpoint root, besides room for the newest
      checkpoint again: the agents' health gate wants as much
      (``health_min_free_gb``) before a relaunch starts a rank, so a root the
      look calls usable also passes the gate.
    - ``silence_share``: when at least this share of all agents go silent
      within one lease (there being at least ``silence_min_agents``), or every
      agent of a job does, the silence has a common cause (the supervisor was
      away, the network, the job ended): no node is blamed for it, and Slurm's
      view decides (:mod:`supervisor.core.silence`).
    - ``silence_min_agents``: the fewest agents, all jobs together, among
      which ``silence_share`` of them going silent counts as a common cause.
    - ``spare_check_interval_s``: how often the health gate runs on a job's idle
      hot spares (0: only when a spare is swapped in); a spare that fails it is
      released and kept out of the job (:mod:`agent.node.sparecheck`).
    - ``anomaly_action``: what a training anomaly (a NaN or infinite loss or
      grad norm, a loss spike, a grad-norm explosion in the ranks' step
      reports) does: ``rollback`` (stop, resume from a checkpoint before the
      onset, skip the data around it, relaunch), ``alert`` (tell a person,
      train on) or ``off`` (no detection) (:mod:`supervisor.core.rollback`).
    - ``anomaly_margin_steps``: a rollback resumes from the newest valid
      checkpoint at least this many steps before the onset's step - 1.
    - ``anomaly_skip_batches``: how many global batches a rollback skips,
      from ``anomaly_skip_lead_batches`` before the onset batch on (0: none).
    - ``anomaly_skip_lead_batches``: how many batches before the onset batch
      the skipped ones start.
    - ``anomaly_max_rollbacks``: rollbacks a job may make; one more stops it.
    - ``anomaly_recurrence_steps``: an anomaly within this many steps after
      the last one's onset is a recurrence: on fresh data a crash loop, unless
      one node's ranks alone went bad both times (silent data corruption:
      that node is blamed and drained).
    - ``anomaly_window_steps``: the steps of each rank's trailing window a
      loss spike is judged against.
    - ``anomaly_warmup_steps``: the steps a rank's window must hold before any
      spike is judged.
    - ``anomaly_spike_score``: a loss at least this many robust standard
      deviations above its window's median (and ``anomaly_spike_min_ratio``
      times it) is a spiking step (:class:`supervisor.core.anomaly.WatchPolicy`).
    - ``anomaly_spike_min_ratio``: a spiking step's loss is also at least this
      many times its window's median (with ``anomaly_spike_score``).
    - ``anomaly_spike_steps``: spiking steps in a row that make a spike.
    - ``anomaly_grad_score``: a grad norm at least this many robust standard
      deviations above its window's median (and ``anomaly_grad_min_ratio``
      times it) marks a step of a grad-norm explosion
      (``anomaly_spike_steps`` in a row make one).
    - ``anomaly_grad_min_ratio``: an exploding grad norm is also at least this
      many times its window's median (with ``anomaly_grad_score``).

    Job sizes (original, minimum, unit) are the job's, on its record.
    """

    max_drain_share_per_hour: float = 0.1
    min_drains_per_hour: int = 1
    drain_confidence: float = 0.6
    straggler_drain: bool = False
    straggler_reports_to_drain: int = 3
    straggler_factor: float = 1.5
    straggler_min_steps: int = 10
    max_restarts_without_progress: int = 3
    backoff_base_s: float = 10.0
    backoff_max_s: float = 600.0
    user_exception_retries: int = 1
    stop_grace_s: float = 30.0
    validation_level: ValidationLevel = ValidationLevel.FULL
    hang_evidence_window_s: float = 30.0
    # Peers see a dead rank's closed connection within a second or so and the
    # window closes once every launcher ended; the longest wait covers a
    # loaded node whose agent reports late (peers that hang never end).
    exit_evidence_window_s: float = 10.0
    resume_loss_tolerance: float = 0.0
    probation_s: float = 1800.0
    lemon_blames: int = 2
    lemon_window_s: float = 7 * 86400.0
    lemon_users: int = 2
    user_flag_share: float = 0.05
    user_flag_min_nodes: int = 5
    max_user_drain_share: float = 0.5
    corroborate_drains: bool = True
    storm_nodes: int = 3
    storm_jobs: int = 2
    storm_window_s: float = 600.0
    grow_back: bool = True
    relaunch_start_timeout_s: float = 300.0
    storage_wait_s: float = 3600.0
    storage_min_free_gb: float = 1.0
    silence_share: float = 0.5
    silence_min_agents: int = 4
    spare_check_interval_s: float = 300.0
    anomaly_action: AnomalyAction = AnomalyAction.ROLLBACK
    anomaly_margin_steps: int = 20
    anomaly_skip_batches: int = 20
    anomaly_skip_lead_batches: int = 0
    anomaly_max_rollbacks: int = 5
    anomaly_recurrence_steps: int = 200
    anomaly_window_steps: int = 50
    anomaly_warmup_steps: int = 20
    anomaly_spike_score: float = 8.0
    anomaly_spike_min_ratio: float = 1.5
    anomaly_spike_steps: int = 3
    anomaly_grad_score: float = 10.0
    anomaly_grad_min_ratio: float = 5.0

    def __post_init__(self) -> None:
        kinds = {
            "straggler_drain": bool,
            "grow_back": bool,
            "corroborate_drains": bool,
            "validation_level": ValidationLevel,
            "anomaly_action": AnomalyAction,
        }
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in kinds:
                expected = kinds[f.name]
                if not isinstance(value, expected):
                    raise ConfigError(f"policy: {f.name} must be a {expected.__name__}")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"policy: {f.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"policy: {f.name} must be finite and >= 0, got {value!r}")
        if self.max_drain_share_per_hour > 1:
            raise ConfigError("policy: max_drain_share_per_hour is a share, at most 1")
        if self.user_flag_share > 1:
            raise ConfigError("policy: user_flag_share is a share, at most 1")
        if self.max_user_drain_share > 1:
            raise ConfigError("policy: max_user_drain_share is a share, at most 1")
        if self.silence_share > 1:
            raise ConfigError("policy: silence_share is a share, at most 1")
        if self.drain_confidence > 1:
            raise ConfigError("policy: drain_confidence is at most 1")
        for name in ("straggler_reports_to_drain", "lemon_blames", "straggler_min_steps",
                     "storm_jobs", "lemon_users"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ConfigError(f"policy: {name} must be >= 1")
        if self.storm_nodes == 1:
            raise ConfigError(
                "policy: storm_nodes 1 would call every blame a storm and never drain: "
                "give at least 2, or 0 to turn the storm brake off"
            )
        if self.straggler_factor <= 1:
            raise ConfigError("policy: straggler_factor must be > 1")
        if self.backoff_max_s < self.backoff_base_s:
            raise ConfigError("policy: backoff_max_s must be >= backoff_base_s")
        for name in ("anomaly_margin_steps", "anomaly_skip_batches", "anomaly_skip_lead_batches",
                     "anomaly_max_rollbacks", "anomaly_recurrence_steps", "anomaly_window_steps",
                     "anomaly_warmup_steps", "anomaly_spike_steps", "storm_nodes",
                     "storm_jobs", "lemon_users", "user_flag_min_nodes"):  # fmt: skip
            if not isinstance(getattr(self, name), int):
                raise ConfigError(f"policy: {name} must be a whole number")
        try:
            self.watch_policy()
        except ValueError as error:
            raise ConfigError(f"policy: {error}") from error

    def watch_policy(self) -> WatchPolicy:
        """The detector's thresholds from the ``anomaly_*`` settings."""
        return WatchPolicy(
            window=self.anomaly_window_steps,
            warmup_steps=self.anomaly_warmup_steps,
            spike_score=self.anomaly_spike_score,
            spike_min_ratio=self.anomaly_spike_min_ratio,
            spike_steps=self.anomaly_spike_steps,
            grad_score=self.anomaly_grad_score,
            grad_min_ratio=self.anomaly_grad_min_ratio,
        )


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` concluded: the new record, intents in order, the cause, why."""

    record: JobRecord
    intents: tuple[Intent, ...]
    cause: Cause | None
    explanation: str


@dataclass(frozen=True)
class Context:
    """What one decision is made in, built once by :func:`~supervisor.core.policy.decide`
    and passed down: the time (``now_s``, never read from a clock), the operator's
    policy, the cluster as last seen, and the failure rules in force (the
    operator's first, :mod:`supervisor.core.failure_rules`)."""

    now_s: float
    policy: Policy
    cluster: ClusterView
    rules: tuple[Rule, ...] = DEFAULT_RULES


def decision(
    record: JobRecord, intents: tuple[Intent, ...], cause: Cause | None, explanation: str
) -> Decision:
    """A :class:`Decision` (positional, as the decision modules build them)."""
    return Decision(record, intents, cause, explanation)
