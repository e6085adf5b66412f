"""Every kind of agent report the decision core decides on, in one table.

A kind of report is decided on only when it has an entry here: the entry
names its observation type (what :func:`~supervisor.core.observations.from_event`
builds), the blame rule that names a node for it, the policy knobs particular to
its decision, the ``cause`` label values it is counted under on ``/metrics``,
and what it means in words. :data:`DECIDED_KINDS` (what the intake hands the
decision task) and :data:`REPLAYED_KINDS` (what the decision task decides on
again after a restart) are derived from it. ``tests/unit/test_faults.py`` holds
the table to the rest of the core: every decided kind has a reading and a
decision, every rule is the one :func:`~supervisor.core.blame.blame` applies,
every knob is a :class:`Policy` field.

A kind is decided in one of two ways. The kinds the core has grown up with
have a case of their own in :func:`~supervisor.core.policy.decide` and their
reading in :mod:`supervisor.core.observations`. A new kind needs neither: its
entry carries its reading (``read``: the wire event to its observation, a
subclass of :class:`~supervisor.core.observations.AgentReport` defined beside
the entry) and its decision (``decide``), and ``decide``'s last case hands
every such report to :func:`decide_reported`. Adding one is then this module
(and the wire protocol's declaration of the event, which the agent sends).
docs/architecture.md, "Adding a fault kind", walks through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.wire.protocol import Event, EventKind
from supervisor.core import blame
from supervisor.core.decision import Context, Decision
from supervisor.core.model import Cause, JobRecord
from supervisor.core.observations import (
    AgentReport,
    AgentStopped,
    CheckpointCommitted,
    CheckpointWritten,
    HangReported,
    HealthCheckFailed,
    LauncherExited,
    RankExited,
    StragglerReported,
    TimeLimitNoticed,
    WorldMismatched,
    from_event,
)

BlameRule = Callable[[Any, JobRecord, frozenset[str]], blame.Blame]
"""``(report, record, lemons) -> Blame``: which node a report of the kind points at."""
Reader = Callable[[Event], AgentReport]
"""The observation of a decoded, valid wire event of the kind."""
Decider = Callable[[JobRecord, Any, Context], Decision]
"""``(record, report, context) -> Decision``: the decision on a report of the kind."""


@dataclass(frozen=True)
class Fault:
    """One kind of agent report the core decides on.

    ``blame``: the rule naming the node at fault (None: the kind blames no
    node; it ends the job, closes a window or is news). ``knobs``: the
    :class:`~supervisor.core.decision.Policy` fields its decision reads beyond
    what every recovery reads (restart budget, backoff, drain limits).
    ``causes``: the :class:`~supervisor.core.model.Cause` values its decisions
    carry, the ``cause`` label of ``resurgo_job_restarts_total``,
    ``resurgo_drains`` and the badput series (docs/operations.md). ``replayed``:
    decided on again from the store after a supervisor restart (a measured
    kind is measured again instead).
    """

    kind: EventKind
    observation: type[AgentReport]
    blame: BlameRule | None
    knobs: tuple[str, ...]
    causes: tuple[Cause, ...]
    replayed: bool
    text: str
    # A kind decided through this table alone: its reading and its decision (None: the
    # kind's reading is in supervisor.core.observations and its case in decide).
    read: Reader | None = None
    decide: Decider | None = None


FAULTS: tuple[Fault, ...] = (
    Fault(
        EventKind.RANK_EXITED,
        RankExited,
        blame.of_rank_exit,
        ("exit_evidence_window_s", "user_exception_retries"),
        (Cause.RANK_SIGNAL, Cause.USER_EXCEPTION, Cause.CRASH_LOOP),
        replayed=True,
        text="a rank process ended: a node signal (SIGKILL, SIGSEGV, ...) blames its node, "
        "an exception or exit code is the user's code; the earliest of several is the root cause",
    ),
    Fault(
        EventKind.HANG,
        HangReported,
        blame.of_hang,
        ("hang_evidence_window_s",),
        (Cause.HANG,),
        replayed=True,
        text="ranks made no progress for longer than their timeout: every node's report is "
        "compared, and the rank behind or outside the collective is blamed",
    ),
    Fault(
        EventKind.HEALTH_CHECK_FAILED,
        HealthCheckFailed,
        blame.of_health_check,
        (),
        (Cause.HEALTH_CHECK,),
        replayed=True,
        text="a node failed the health gate before a launch: it leaves the job and is drained "
        "(a check of what nodes share, the checkpoint root or the rendezvous host, blames none)",
    ),
    Fault(
        EventKind.STRAGGLER,
        StragglerReported,
        blame.of_straggler,
        ("straggler_drain", "straggler_reports_to_drain"),
        (Cause.STRAGGLER,),
        replayed=False,
        text="one rank is persistently slow: alerted once; drained only with straggler_drain, "
        "after straggler_reports_to_drain reports",
    ),
    Fault(
        EventKind.CHECKPOINT_COMMITTED,
        CheckpointCommitted,
        None,
        ("grow_back",),
        (Cause.GROW,),
        replayed=True,
        text="a checkpoint is durable: the job's progress, and the moment to grow a job "
        "running below its size back when idle nodes allow",
    ),
    Fault(
        EventKind.CHECKPOINT_WRITTEN,
        CheckpointWritten,
        None,
        (),
        (),
        replayed=True,
        text="a checkpoint the script wrote itself (torch.save, DCP, a framework's) is "
        "complete: the job's progress, as a commit is",
    ),
    Fault(
        EventKind.LAUNCHER_EXITED,
        LauncherExited,
        None,
        ("exit_evidence_window_s",),
        (),
        replayed=True,
        text="a node's launcher ended: its ranks' exits are all in; once every node's are, "
        "the exit window closes early",
    ),
    Fault(
        EventKind.AGENT_STOPPED,
        AgentStopped,
        None,
        ("exit_evidence_window_s",),
        (),
        replayed=True,
        text="a node's agent exits cleanly: as a launcher end, and its lease expiring later "
        "is no lost node",
    ),
    Fault(
        EventKind.TIME_LIMIT_NEAR,
        TimeLimitNoticed,
        None,
        (),
        (Cause.TIME_LIMIT,),
        replayed=False,
        text="the time limit is near: a planned stop, exits and hangs during it are no fault, "
        "and the job is requeued at its size without spending budget",
    ),
    Fault(
        EventKind.WORLD_MISMATCH,
        WorldMismatched,
        None,
        (),
        (Cause.WORLD_MISMATCH,),
        replayed=True,
        text="a rank trains a world that is not the job's (a wrapper kept its own --nnodes or "
        "--standalone): no restart fixes the command, the job fails at once",
    ),
)

BY_KIND: dict[EventKind, Fault] = {fault.kind: fault for fault in FAULTS}
BY_TYPE: dict[type[AgentReport], Fault] = {fault.observation: fault for fault in FAULTS}
DECIDED_KINDS: frozenset[EventKind] = frozenset(BY_KIND)
"""The agent event kinds the intake hands the decision core (others are stored only)."""
REPLAYED_KINDS: tuple[EventKind, ...] = tuple(fault.kind for fault in FAULTS if fault.replayed)
"""The kinds decided on again from the store after a restart, in the table's order."""


def read(event: Event) -> AgentReport:
    """The observation of a decoded, valid agent event of a decided kind (ValueError for
    any other kind: the daemon keeps those and decides nothing on them)."""
    fault = BY_KIND.get(event.kind)
    if fault is not None and fault.read is not None:
        return fault.read(event)
    return from_event(event)


def decide_reported(record: JobRecord, report: AgentReport, ctx: Context) -> Decision:
    """The decision on a report of a kind decided through this table (``Fault.decide``).

    A report of no kind here, or of one without a decision, is a bug in the
    core (a kind added halfway), never something to pass over in silence.
    """
    fault = BY_TYPE.get(type(report))
    if fault is None or fault.decide is None:
        raise TypeError(
            f"{type(report).__name__} has no decision: give its Fault in "
            "supervisor/core/faults.py a decide, or decide gives it a case"
        )
    return fault.decide(record, report, ctx)
