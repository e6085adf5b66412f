"""The decision core's vocabulary: job states and their transitions, causes, the job record.

What the core consumes (observations) and emits (intents) lives in
:mod:`supervisor.core.observations` and :mod:`supervisor.core.intents`; the pure function
that joins them is :func:`supervisor.core.policy.decide`. The store persists a
:class:`JobRecord` as the JSON document :func:`record_to_json` writes.

This module is pure: no clock, no OS (STYLE.md §2).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from supervisor.errors import SupervisorError

RECORD_VERSION = 1

# Older signatures cannot match a new crash once the job moved past them; the
# store document stays small however long the job runs.
MAX_SIGNATURES = 32
# A rank exit window keeps the earliest deaths only: the root cause is among
# them, and a job of thousands of ranks must not grow the record without bound.
MAX_EXITS = 64


def at_step(step: int | None) -> str:
    """ "at step N", or what a person says when no step is known."""
    return "before any step was reported" if step is None else f"at step {step}"


class IllegalTransition(SupervisorError):
    """The core tried a transition that :data:`TRANSITIONS` forbids: a bug in the core."""


class RecordFormatError(SupervisorError):
    """A stored job record cannot be read; the message names the field."""


class JobState(enum.Enum):
    """Where a job is in its life; this table is the specification of the lifecycle.

    ============  ==============================================================
    SUBMITTED     sbatch accepted it; waiting in Slurm's queue the first time.
    STARTING      Slurm runs it (first time, after a requeue, or a relaunched
                  step): agents start, ranks load; no training step seen yet.
    RUNNING       ranks make progress (a step or a checkpoint commit was seen).
    RECOVERING    a fault was seen: evidence is collected (other nodes' hang
                  reports, or the exits of the dead rank's peers until the
                  root cause is clear), the blamed node drained, checkpoints
                  validated, and the backoff waited out. The job's
                  :class:`Recovery` says how far it got.
    RELAUNCHING   a new srun step was ordered inside the current allocation
                  (the fast path); waiting for the driver to report it started.
    REQUEUED      the job waits in Slurm's queue again: requeued by us with a
                  new size (after a fault, or growing back onto idle nodes
                  from a running job), by Slurm itself (node failure), or
                  after a preemption or time limit.
    COMPLETED     the job ended successfully (terminal).
    FAILED        stopped for good: crash loop, restart budget exhausted, no
                  valid checkpoint, fewer usable nodes than the minimum, or
                  Slurm failed it (terminal). ``final_reason`` says which.
    CANCELLED     an operator or the user cancelled it (terminal).
    ============  ==============================================================

    Staying in a state is not a transition; every change goes through
    :func:`check_transition`.
    """

    SUBMITTED = "submitted"
    STARTING = "starting"
    RUNNING = "running"
    RECOVERING = "recovering"
    RELAUNCHING = "relaunching"
    REQUEUED = "requeued"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        """True for the states a job never leaves."""
        return not TRANSITIONS[self]


_ENDINGS = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # A short job may start and finish between two polls: SUBMITTED can see its end.
    JobState.SUBMITTED: frozenset({JobState.STARTING, JobState.RUNNING, *_ENDINGS}),
    JobState.STARTING: frozenset(
        {JobState.RUNNING, JobState.RECOVERING, JobState.REQUEUED, *_ENDINGS}
    ),
    JobState.RUNNING: frozenset({JobState.RECOVERING, JobState.REQUEUED, *_ENDINGS}),
    # RECOVERING never goes straight to RUNNING: a relaunch has to happen first.
    JobState.RECOVERING: frozenset({JobState.RELAUNCHING, JobState.REQUEUED, *_ENDINGS}),
    JobState.RELAUNCHING: frozenset(
        {JobState.STARTING, JobState.RUNNING, JobState.RECOVERING, JobState.REQUEUED, *_ENDINGS}
    ),
    JobState.REQUEUED: frozenset({JobState.STARTING, JobState.RUNNING, *_ENDINGS}),
    JobState.COMPLETED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.CANCELLED: frozenset(),
}


def check_transition(source: JobState, target: JobState) -> None:
    """Raise :class:`IllegalTransition` unless ``source -> target`` is in :data:`TRANSITIONS`."""
    if source is not target and target not in TRANSITIONS[source]:
        raise IllegalTransition(f"job state {source.value} -> {target.value} is not allowed")


class Cause(enum.Enum):
    """Why a recovery (or a stop) happened; metrics count restarts by these values."""

    RANK_SIGNAL = "rank_signal"  # a rank died by a signal that points at the node
    USER_EXCEPTION = "user_exception"  # a rank exited non-zero: the user's code raised
    CRASH_LOOP = "crash_loop"  # the same failure at the same step again
    HANG = "hang"  # ranks stopped making progress
    NODE_LOST = "node_lost"  # agent lease expired, or Slurm says DOWN/NOT_RESPONDING
    HEALTH_CHECK = "health_check"  # the node health-check command failed
    STRAGGLER = "straggler"  # a persistently slow rank
    PREEMPTED = "preempted"  # Slurm preempted the job
    TIME_LIMIT = "time_limit"  # the job reached its time limit
    SLURM_REQUEUE = "slurm_requeue"  # Slurm requeued the job by itself
    RELAUNCH_FAILED = "relaunch_failed"  # the fast-path srun step could not start
    BUDGET_EXHAUSTED = "budget_exhausted"  # too many restarts without progress
    NO_CHECKPOINT = "no_checkpoint"  # checkpoints existed, none passed validation
    BELOW_MIN_NODES = "below_min_nodes"  # fewer usable nodes than the job's minimum
    SLURM_ENDED = "slurm_ended"  # Slurm reports the job ended (completed, failed)
    OPERATOR = "operator"  # cancelled by a person
    # The ranks formed a world that is not the job's (a wrapper's torchrun kept
    # its own --nnodes or --standalone): every node trains alone; stopped at once.
    WORLD_MISMATCH = "world_mismatch"
    # A planned restart, no fault: the job ran below its original size, idle
    # nodes now allow a larger one, and a checkpoint was just committed.
    GROW = "grow"
    # The training signal went bad without an error (a NaN or infinite loss, a
    # loss spike, a grad-norm explosion): rolled back to a checkpoint before it,
    # past the data around it. Its own budget (``anomaly_max_rollbacks``).
    TRAINING_ANOMALY = "training_anomaly"
    # The same anomaly again on fresh data, from the ranks of one node only:
    # that node computes wrong (silent data corruption). A node fault.
    SILENT_CORRUPTION = "silent_corruption"
    # What a failed rank's evidence says it was (supervisor.core.failure_rules): the
    # script is wrong (it failed before its first step on every node), the script's
    # memory (the kernel's OOM kill, a CUDA out-of-memory error), the node's
    # hardware (a GPU Xid, an ECC error, an operator's hardware rule), the storage.
    USER_ERROR = "user_error"
    OOM = "oom"
    HARDWARE = "hardware"
    # The checkpoint root's storage failed (full, a quota, an I/O error, a stale
    # handle): no node is at fault; the relaunch waits for the storage.
    STORAGE = "storage"


# Causes that are no fault of the job's: the cluster's doing (preemption, the
# time limit) or a planned grow back to a larger size. They never spend budget.
# A training anomaly's rollback spends its own budget, not this one.
NO_BUDGET_CAUSES = frozenset(
    {Cause.PREEMPTED, Cause.TIME_LIMIT, Cause.GROW, Cause.TRAINING_ANOMALY}
)
# Causes that are a fault of a node: they count toward the cluster's MTBF.
NODE_FAULT_CAUSES = frozenset(
    {
        Cause.RANK_SIGNAL,
        Cause.HANG,
        Cause.NODE_LOST,
        Cause.HEALTH_CHECK,
        Cause.STRAGGLER,
        Cause.SILENT_CORRUPTION,
        Cause.HARDWARE,
    }
)
# Anomalies kept on the record: enough to judge a recurrence and show the history.
MAX_ANOMALIES = 16


@dataclass(frozen=True)
class AnomalySeen:
    """One training anomaly the supervisor acted on (or only reported), for recurrence
    judgement and the report.

    ``kind`` is :class:`supervisor.core.anomaly.AnomalyKind`'s value; ``onset_step``
    the first bad step; ``nodes`` the nodes whose ranks alone went bad at the
    onset (empty: every reporting node did, or the job reports one rank only, so
    no node can be told apart); ``cursor`` the global sample cursor before the
    onset step (None: the script reports none); ``batch`` the global batch size
    seen in the cursors (None: unknown). ``action``: ``rollback``, ``alert``,
    ``drain`` (silent corruption), ``crash_loop`` or ``off``; ``skipped`` the
    sample range the rollback skipped (set at its relaunch), ``resumed_step`` the
    checkpoint step it resumed from.
    """

    kind: str
    onset_step: int
    attempt: int
    nodes: tuple[str, ...]
    cursor: int | None
    batch: int | None
    detail: str
    action: str
    skipped: tuple[int, int] | None = None
    resumed_step: int | None = None


@dataclass(frozen=True)
class CrashSignature:
    """What identifies "the same failure": the error's digest and the step it hit.

    ``digest`` is the agent's hash of exception type and message when it sent
    one, else ``exit:<code>``.
    """

    digest: str
    step: int | None


@dataclass(frozen=True)
class Suspect:
    """One hung rank a node agent reported, kept until blame compares nodes."""

    node: str
    global_rank: int
    last_step: int | None
    in_collective: bool | None
    stopped_at_s: float  # event time minus seconds since progress: when it stopped
    reason: str = ""


@dataclass(frozen=True)
class ExitSeen:
    """One failed rank collected in an exit evidence window, kept until the root cause is chosen.

    ``died_at_s`` is when the rank died by the clock of its node (the event's
    ``exit_time_unix_s``), else when the agent reported it: the earliest death
    is the root cause, the others its consequences. ``error_digest`` as in
    :class:`CrashSignature`. ``raised`` / ``raised_at_s``: the rank's uncaught
    exception type and when it reached the top, when it raised one (a rank
    stopped while it unwound its exception failed when it raised). ``script_ended``:
    the rank's script had run to its end (a signal came in its teardown).
    """

    node: str
    global_rank: int | None
    exit_code: int | None
    signal: int | None
    step: int | None
    died_at_s: float
    error_digest: str | None = None
    raised: str | None = None
    raised_at_s: float | None = None
    script_ended: bool = False
    # What failed (supervisor.core.failure_rules): the class's value, the rule that
    # said so and the evidence line it matched; None: no rule (or not classified).
    failure: str | None = None
    rule: str | None = None
    quote: str = ""


# Requeues made again after Slurm reported the job ended before it ran again.
MAX_LOST_REQUEUES = 2


@dataclass(frozen=True)
class Recovery:
    """How far the current recovery got; None on the record when none is under way.

    - ``evidence_until_s``: evidence is collected until then (None: evidence
      complete, the cause decided and the restart counted). With ``exits``
      empty it is a hang window: other nodes' hang reports become
      ``suspects``, so blame can compare nodes. With ``exits`` it is an exit
      window: the ranks that failed, earliest death first (at most
      :data:`MAX_EXITS`), so the root cause is the first to die and not the
      first reported; ``cause`` is the cause of the earliest so far.
      ``settled``: the job's nodes whose launcher ended in this exit window
      (the agent reports every rank's exit before its launcher's), or whose
      last rank's exit said none was left: once all have, no exit is still on
      its way and the window closes early.
    - ``exclude``: nodes the relaunch must not use (blamed, lost, lemons).
    - ``requeue``: the allocation cannot be reused (batch host died, Slurm
      ended the allocation, the fast path failed) or is given up to grow.
    - ``validated``: a checkpoint was chosen (``resume_from``/``resume_step``;
      both None when the job never committed one and starts from scratch).
    - ``rejected``: checkpoint paths that failed validation in this recovery.
    - ``requeue_seen``: Slurm showed the job queued again after the requeue
      (until then an ended state from Slurm predates the requeue).
    - ``requeues_lost``: requeues Slurm showed queued and then reported ended
      before the job ran again (the earlier run's end overrode them); each is
      made again, up to :data:`MAX_LOST_REQUEUES`.
    """

    cause: Cause
    started_s: float
    evidence_until_s: float | None = None
    suspects: tuple[Suspect, ...] = ()
    exits: tuple[ExitSeen, ...] = ()
    settled: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    requeue: bool = False
    validated: bool = False
    resume_from: str | None = None
    resume_step: int | None = None
    rejected: tuple[str, ...] = ()
    requeue_seen: bool = False
    requeues_lost: int = 0
    # A rollback after a training anomaly: only checkpoints of this step or
    # earlier are candidates (None: any).
    resume_before: int | None = None
    # The exit window opened before the launch's first training step: its exits are
    # judged as failures at start (supervisor.core.failures).
    before_first_step: bool = False
    # A storage failure's wait (supervisor.core.failures): until when the checkpoint
    # root may take to come back, how many looks so far, when the next one is due.
    storage_until_s: float | None = None
    storage_probes: int = 0
    storage_next_s: float | None = None
    # The file system (mount point) the wait is for, once a look found it unusable:
    # the storage incident the job is part of.
    storage_fs: str | None = None
    # Slurm requeued the job itself: the allocation (world and spares) it was
    # requeued from, whose nodes decide whether the pending job must be resized
    # (supervisor.core.recovery.resize_requeued).
    slurm_requeued: tuple[str, ...] = ()

    @property
    def collecting_exits(self) -> bool:
        """An exit window is open: rank exits are evidence, the root cause is not chosen yet."""
        return self.evidence_until_s is not None and bool(self.exits)


@dataclass(frozen=True)
class JobRecord:
    """Everything the core knows about one job; the store keeps it as a JSON document.

    Sizes: ``original_nodes`` as submitted, ``min_nodes`` the floor, ``unit`` the
    multiple the parallelism needs; ``nodes`` the current allocation, first node
    the batch host. ``procs_per_node`` maps a global rank to its node.
    Spares: ``spares_wanted`` hot spares were asked for; ``spare_nodes`` are
    the allocation's nodes that run no ranks, ready to replace a blamed node
    (``swaps`` counts those replacements by cause).
    ``attempt`` counts launches (1 = the first). ``restarts`` counts restarts by
    cause. Budget: ``restarts_without_progress`` counts consecutive restarts with
    no committed step newer than ``step_at_last_restart``. ``not_before_s``
    holds the next relaunch back (backoff). Times are the supervisor's clock.
    """

    job_id: str
    state: JobState
    original_nodes: int
    min_nodes: int
    unit: int
    nodes: tuple[str, ...]
    submitted_s: float
    state_since_s: float
    procs_per_node: int = 1
    attempt: int = 1
    restarts: tuple[tuple[Cause, int], ...] = ()
    last_step: int | None = None
    last_checkpoint_path: str | None = None
    step_at_last_restart: int | None = None
    restarts_without_progress: int = 0
    user_retries_without_progress: int = 0
    signatures: tuple[CrashSignature, ...] = ()
    blamed_nodes: tuple[str, ...] = ()
    straggler_reports: tuple[tuple[str, int], ...] = ()
    slurm_restart_count: int = 0
    not_before_s: float | None = None
    recovery: Recovery | None = None
    final_reason: str = ""
    # A planned stop for the time limit is under way: Slurm ends the job then
    # (the supervisor's clock). The ranks save and stop; nothing is a fault.
    time_limit_end_s: float | None = None
    spares_wanted: int = 0
    spare_nodes: tuple[str, ...] = ()
    swaps: tuple[tuple[Cause, int], ...] = ()
    # Training anomalies (newest last, at most MAX_ANOMALIES), the global sample
    # ranges every launch skips ([start, end), merged), and rollbacks so far.
    anomalies: tuple[AnomalySeen, ...] = ()
    skipped_samples: tuple[tuple[int, int], ...] = ()
    rollbacks: int = 0
    # Ranks that exited 0, as (attempt, global rank, last step): a rank that dies in its
    # teardown after every peer finished the same last step ended a completed run.
    finished_ranks: tuple[tuple[int, int, int | None], ...] = ()
    # Whose job it is, as Slurm said at registration: drains and tickets name them.
    slurm_user: str = ""
    # Failures of the job's ranks, by failure class (supervisor.core.failure_rules):
    # the root cause of each recovery counted once; a class's retry budget reads it.
    failures: tuple[tuple[str, int], ...] = ()
    # Ranks an agent found stopped outside any collective while none of its node
    # waits in one (its stall report): evidence kept for a hang other nodes report
    # (supervisor.core.policy._on_stall); cleared when a recovery starts.
    stalls: tuple[Suspect, ...] = ()

    def with_anomaly(self, seen: AnomalySeen) -> JobRecord:
        """This record with ``seen`` as its newest anomaly (the oldest dropped past the cap)."""
        return replace(self, anomalies=(*self.anomalies, seen)[-MAX_ANOMALIES:])

    def with_swap(self, cause: Cause) -> JobRecord:
        """This record with one more spare swap counted for ``cause``."""
        counts = dict(self.swaps)
        counts[cause] = counts.get(cause, 0) + 1
        return replace(self, swaps=tuple(sorted(counts.items(), key=lambda kv: kv[0].value)))

    def with_failure(self, failure_class: str) -> JobRecord:
        """This record with one more failure of ``failure_class`` counted."""
        counts = dict(self.failures)
        counts[failure_class] = counts.get(failure_class, 0) + 1
        return replace(self, failures=tuple(sorted(counts.items())))

    def failures_of(self, failure_class: str) -> int:
        """How many failures of ``failure_class`` the job has had."""
        return dict(self.failures).get(failure_class, 0)

    def restarts_for(self, cause: Cause) -> int:
        """How many restarts ``cause`` has caused so far."""
        return dict(self.restarts).get(cause, 0)

    def with_restart(self, cause: Cause) -> JobRecord:
        """This record with one more restart counted for ``cause``."""
        counts = dict(self.restarts)
        counts[cause] = counts.get(cause, 0) + 1
        return replace(self, restarts=tuple(sorted(counts.items(), key=lambda kv: kv[0].value)))

    def node_of_rank(self, global_rank: int) -> str | None:
        """The node a global rank runs on (torchrun places ranks node by node)."""
        index = global_rank // self.procs_per_node
        return self.nodes[index] if 0 <= index < len(self.nodes) else None

    @property
    def batch_host(self) -> str | None:
        """The node running the batch script; losing it loses the allocation."""
        return self.nodes[0] if self.nodes else None


@dataclass(frozen=True)
class ClusterView:
    """What the core may know about the cluster beyond the job, as the daemon last saw it.

    ``usable``: nodes up and not drained; ``drained`` and ``down`` as Slurm
    says; ``drains_last_hour``: Resurgo's drains in the last hour across all
    jobs (from the store's audit), and those decided and not done yet, for the
    rate limit; ``recent_blames``: (node, job) of every blame within the
    policy's storm window, for the storm brake; ``user_blames``: (user, node)
    of every blame within the lemon window, for flagging a user whose jobs
    blame too many nodes; ``user_acts``: (user, nodes drained or ticketed
    for their jobs within the last hour), for each user's share of the
    drains; ``lemons``: repeat
    offenders that no relaunch uses; ``idle``: usable nodes allocated to no
    job (sinfo's IDLE), where a job asking for them starts at once. A job
    below its original size grows back onto idle nodes, so ``idle`` holds
    only nodes the supervised jobs may use (their partition).
    ``lemon_blames``: (lemon, standing blames within ``lemon_window_s``)
    pairs, so a decision can say why a lemon is kept out. ``may_drain``:
    the supervisor has Slurm operator rights; without them a blamed node is
    excluded and ticketed (:class:`~supervisor.core.intents.DrainTicket`), never
    drained. ``ticketed``: (node, the users whose jobs raised its open tickets;
    empty: a job of unknown user did) pairs: each user's relaunches leave out
    the nodes their own jobs ticketed (:meth:`avoided_by`). ``storage_waits``:
    (file system, job) of every job waiting for its checkpoint root's storage,
    filled in for a decision on a storage look only: jobs that wait on one file
    system are one incident.
    """

    usable: frozenset[str] = frozenset()
    drained: frozenset[str] = frozenset()
    down: frozenset[str] = frozenset()
    drains_last_hour: int = 0
    recent_blames: tuple[tuple[str, str], ...] = ()
    user_blames: tuple[tuple[str, str], ...] = ()
    user_acts: tuple[tuple[str, int], ...] = ()
    lemons: frozenset[str] = frozenset()
    idle: frozenset[str] = frozenset()
    lemon_blames: tuple[tuple[str, int], ...] = ()
    lemon_window_s: float = 0.0
    may_drain: bool = True
    ticketed: tuple[tuple[str, tuple[str, ...]], ...] = ()
    storage_waits: tuple[tuple[str, str], ...] = ()

    def avoided_by(self, user: str) -> frozenset[str]:
        """The nodes a relaunch of ``user``'s job leaves out: the lemons, and the nodes
        with an open ticket that one of ``user``'s jobs raised (one user's word keeps a
        node out of their own jobs only). A ticket of unknown user, or a job of unknown
        user (``""``), keeps every ticketed node out."""
        return self.lemons | frozenset(
            node for node, users in self.ticketed if not users or not user or user in users
        )

    @property
    def size(self) -> int:
        """Every node the cluster has, whatever its state."""
        return len(self.usable | self.drained | self.down)


def new_record(
    job_id: str,
    nodes: int,
    now_s: float,
    *,
    min_nodes: int | None = None,
    unit: int = 1,
    procs_per_node: int = 1,
    spares: int = 0,
    slurm_user: str = "",
) -> JobRecord:
    """The record of a job sbatch just accepted."""
    return JobRecord(
        job_id=job_id,
        state=JobState.SUBMITTED,
        original_nodes=nodes,
        min_nodes=nodes if min_nodes is None else min_nodes,
        unit=unit,
        nodes=(),
        submitted_s=now_s,
        state_since_s=now_s,
        procs_per_node=procs_per_node,
        spares_wanted=spares,
        slurm_user=slurm_user,
    )


# ---------------------------------------------------------------------------
# JSON: enums by value, tuples as lists; the version guards the shape.


def _to_doc(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple | list):
        return [_to_doc(item) for item in value]
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _to_doc(getattr(value, f.name)) for f in fields(value)}
    return value


def record_to_doc(record: JobRecord) -> dict[str, Any]:
    """The record as a document of JSON types with a ``version`` field."""
    return {"version": RECORD_VERSION, **_to_doc(record)}


def record_to_json(record: JobRecord) -> str:
    """The record as a JSON document with a ``version`` field; keys sorted, so stable."""
    return json.dumps(record_to_doc(record), sort_keys=True)


def _get(doc: Mapping[str, Any], name: str) -> Any:
    if name not in doc:
        raise RecordFormatError(f"job record: missing field {name!r}")
    return doc[name]


def _suspect(doc: Mapping[str, Any]) -> Suspect:
    return Suspect(**{f.name: _get(doc, f.name) for f in fields(Suspect)})


def _exit_seen(doc: Mapping[str, Any]) -> ExitSeen:
    # Not in records stored before they existed.
    later = {"script_ended": False, "failure": None, "rule": None, "quote": ""}
    values = {f.name: doc.get(f.name, later[f.name]) if f.name in later else _get(doc, f.name)
              for f in fields(ExitSeen)}  # fmt: skip
    values["script_ended"] = bool(values["script_ended"])
    return ExitSeen(**values)


def _anomaly(doc: Mapping[str, Any]) -> AnomalySeen:
    values = {f.name: _get(doc, f.name) for f in fields(AnomalySeen)}
    values["nodes"] = tuple(values["nodes"])
    skipped = values["skipped"]
    values["skipped"] = None if skipped is None else (int(skipped[0]), int(skipped[1]))
    return AnomalySeen(**values)


def _recovery(doc: Mapping[str, Any] | None) -> Recovery | None:
    if doc is None:
        return None
    # Records written before exit windows (or their early close) existed lack
    # ``exits`` (``settled``): none collected.
    later = {"exits": (), "settled": (), "resume_before": None, "before_first_step": False,
             "storage_until_s": None, "storage_probes": 0, "storage_next_s": None,
             "storage_fs": None, "slurm_requeued": ()}  # fmt: skip
    values = {f.name: _get(doc, f.name) for f in fields(Recovery) if f.name not in later}
    values.update({name: doc.get(name, default) for name, default in later.items()})
    values["before_first_step"] = bool(values["before_first_step"])
    values["cause"] = Cause(values["cause"])
    values["suspects"] = tuple(_suspect(s) for s in values["suspects"])
    values["exits"] = tuple(_exit_seen(e) for e in values["exits"])
    values["settled"] = tuple(values["settled"])
    values["exclude"] = tuple(values["exclude"])
    values["rejected"] = tuple(values["rejected"])
    values["slurm_requeued"] = tuple(values["slurm_requeued"])
    return Recovery(**values)


def record_from_json(text: str) -> JobRecord:
    """Read a document :func:`record_to_json` wrote; raises :class:`RecordFormatError`."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise RecordFormatError(f"job record is not JSON: {error}") from error
    if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
        found = doc.get("version") if isinstance(doc, dict) else None
        raise RecordFormatError(
            f"job record version {found!r} is not {RECORD_VERSION}: "
            "migrate the store with the Resurgo version that wrote it"
        )
    # Fields newer than the record format: absent in records written before them.
    later: dict[str, Any] = {
        "time_limit_end_s": None,
        "spares_wanted": 0,
        "spare_nodes": (),
        "swaps": (),
        "anomalies": (),
        "skipped_samples": (),
        "rollbacks": 0,
        "finished_ranks": (),
        "slurm_user": "",
        "failures": (),
        "stalls": (),
    }
    values: dict[str, Any] = {
        f.name: doc.get(f.name, later[f.name]) if f.name in later else _get(doc, f.name)
        for f in fields(JobRecord)
    }
    try:
        values["state"] = JobState(values["state"])
        values["nodes"] = tuple(values["nodes"])
        values["restarts"] = tuple((Cause(c), int(n)) for c, n in values["restarts"])
        values["spare_nodes"] = tuple(values["spare_nodes"])
        values["swaps"] = tuple((Cause(c), int(n)) for c, n in values["swaps"])
        values["signatures"] = tuple(
            CrashSignature(_get(s, "digest"), _get(s, "step")) for s in values["signatures"]
        )
        values["blamed_nodes"] = tuple(values["blamed_nodes"])
        values["straggler_reports"] = tuple((n, int(c)) for n, c in values["straggler_reports"])
        values["recovery"] = _recovery(values["recovery"])
        values["anomalies"] = tuple(_anomaly(a) for a in values["anomalies"])
        values["skipped_samples"] = tuple(
            (int(start), int(end)) for start, end in values["skipped_samples"]
        )
        values["failures"] = tuple((str(c), int(n)) for c, n in values["failures"])
        values["stalls"] = tuple(_suspect(s) for s in values["stalls"])
        values["finished_ranks"] = tuple(
            (int(attempt), int(rank), None if step is None else int(step))
            for attempt, rank, step in values["finished_ranks"]
        )
        record = JobRecord(**values)
    except (TypeError, ValueError, AttributeError, OverflowError) as error:
        raise RecordFormatError(f"job record is malformed: {error}") from error
    _check_types(record, "job record")
    return record


_SCALARS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "int | None": (int, type(None)),
    "float | None": (int, float, type(None)),
    "str | None": (str, type(None)),
}


def _check_types(value: Any, where: str) -> None:
    """Every scalar field of the record (and the dataclasses in it) has its annotated type."""
    for f in fields(value):
        item = getattr(value, f.name)
        allowed = _SCALARS.get(str(f.type))
        if allowed is not None:
            wrong_bool = isinstance(item, bool) and bool not in allowed
            if wrong_bool or not isinstance(item, allowed):
                raise RecordFormatError(
                    f"{where}: {f.name} must be {f.type}, got {type(item).__name__}"
                )
        nested = item if isinstance(item, tuple) else (item,)
        for part in nested:
            if is_dataclass(part) and not isinstance(part, type):
                _check_types(part, f"{where}.{f.name}")


__all__ = [
    "MAX_ANOMALIES",
    "MAX_EXITS",
    "MAX_SIGNATURES",
    "NO_BUDGET_CAUSES",
    "RECORD_VERSION",
    "TRANSITIONS",
    "AnomalySeen",
    "Cause",
    "ClusterView",
    "CrashSignature",
    "ExitSeen",
    "IllegalTransition",
    "JobRecord",
    "JobState",
    "RecordFormatError",
    "Recovery",
    "Suspect",
    "check_transition",
    "new_record",
    "record_from_json",
    "record_to_doc",
    "record_to_json",
]
