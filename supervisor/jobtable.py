"""The job table the daemon's components share, and the decision queue they feed.

:class:`JobTable` owns one :class:`TrackedJob` per registered job: what the
supervisor keeps in memory about it (the store has the rest). The intake,
the Slurm poll, the timers and the decision task all read and update it, on
the one event loop, so no entry is ever seen half changed. Each component
hands what it observed to the decision task through :class:`DecisionQueue`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from supervisor.core.driver_answer import Aside
from supervisor.core.hang_hold import AwaitedHang, BusyRank, Heard, HeldHang
from supervisor.core.intents import Intent
from supervisor.core.model import JobRecord, JobState
from supervisor.core.observations import Observation, SlurmJobSeen
from supervisor.core.steps import StepEndNote
from supervisor.core.stragglers import ComputeSample
from supervisor.jobs import JobSpec
from supervisor.slurm.parse import JobState as SlurmState
from supervisor.training_watch import JobWatch


class Inbox(Protocol):
    """Where observations go to be decided on: what the intake needs of the decision task."""

    def enqueue(self, job_id: str, observation: Observation, ref: str | None = None) -> None:
        """Have ``observation`` decided on (``ref``: the stored event it comes from)."""


class DecisionQueue(Inbox, Protocol):
    """The decision task's inbox (:class:`supervisor.deciding.Deciding`)."""

    def act(self, job_id: str, intents: tuple[Intent, ...]) -> None:
        """Have intents the core decided outside :func:`decide` planned and carried out."""

    def sighted(self, job_id: str, observation: SlurmJobSeen, read_s: float) -> None:
        """Have what a Slurm read begun at ``read_s`` saw of the job decided on."""


class SlurmSighting(NamedTuple):
    """The last Slurm sighting handed on, with the record's state then (a sighting is
    news again once the record moved)."""

    state: SlurmState
    nodes: tuple[str, ...]
    restart_count: int
    record_state: JobState


class SaveCost(NamedTuple):
    """The newest checkpoint's step and what its save cost the run."""

    step: int
    stall_s: float
    write_s: float


class _Allocation(NamedTuple):
    """The record's nodes and Slurm's, and their union, as of the last look."""

    record_nodes: tuple[str, ...]
    slurm_nodes: tuple[str, ...]
    union: frozenset[str]


@dataclass
class TrackedJob:
    """What the supervisor keeps in memory about one job (the store has the rest)."""

    record: JobRecord
    secret: bytes
    spec: JobSpec
    # Slurm's newest view of the job's nodes, and the last sighting handed on.
    slurm_nodes: tuple[str, ...] = ()
    last_seen: SlurmSighting | None = None
    # Nodes reported lost to the core (once each until they are fine again), and
    # NOT_RESPONDING nodes not taken as lost while their agent calls in (logged once).
    nodes_flagged: set[str] = field(default_factory=set)
    nodes_excused: set[str] = field(default_factory=set)
    # agent incarnation -> the attempt it was launched for (from agent_started)
    incarnations: dict[str, int] = field(default_factory=dict)
    # agent incarnations that stopped cleanly (agent_stopped)
    stopped: set[str] = field(default_factory=set)
    progress_step: int | None = None
    # When a current agent last called in (a heartbeat or events; None: not
    # since this supervisor started), and the driver's "the step ended".
    last_report_s: float | None = None
    step_ended: StepEndNote | None = None
    # attempts whose resume verification has a result, or that resumed from nothing
    # to compare (checked once each)
    verified: set[int] = field(default_factory=set)
    # the most ranks one agent of the job listed in a heartbeat (bounds its ranks)
    local_ranks_seen: int = 0
    save_cost: SaveCost | None = None
    interval_s: float | None = None  # the interval last pushed to the agents
    # global rank -> its newest compute median (this attempt's agents only)
    compute: dict[int, ComputeSample] = field(default_factory=dict)
    # Hang reports held or awaited (supervisor.core.hang_hold): each node's busy
    # rank and newest heartbeat, the reports held while a node is busy, since when
    # no node has been busy while some are held, and the reports awaiting heartbeats.
    busy: dict[str, BusyRank] = field(default_factory=dict)
    held_hangs: list[HeldHang] = field(default_factory=list)
    idle_since_s: float | None = None
    heard: dict[str, Heard] = field(default_factory=dict)
    # Whether the job's heartbeats came through its aggregator, and the nodes heard
    # straight from their agents since (the aggregator failed them).
    aggregated: bool = False
    heard_directly: set[str] = field(default_factory=set)
    unconfirmed: list[AwaitedHang] = field(default_factory=list)
    # when the driver was last asked to health-check the idle spares (None: not yet)
    spares_checked_s: float | None = None
    # the training-health watch over the step reports (None: anomaly_action off)
    watch: JobWatch | None = None
    # checkpoint path -> why the driver was last told to move it aside
    aside: dict[str, Aside] = field(default_factory=dict)
    _allocation: _Allocation | None = field(default=None, init=False, repr=False, compare=False)

    def allocation(self) -> frozenset[str]:
        """The record's nodes and Slurm's newest view (a relaunch moves both).

        Every request checks its node against it, so the set is built again only
        when either tuple is replaced.
        """
        nodes, seen = self.record.nodes, self.slurm_nodes
        cached = self._allocation
        if cached is None or cached.record_nodes is not nodes or cached.slurm_nodes is not seen:
            cached = _Allocation(nodes, seen, frozenset(nodes) | frozenset(seen))
            self._allocation = cached
        return cached.union

    def current(self, incarnation: str) -> bool:
        """Whether an agent incarnation belongs to the current attempt (or is unknown)."""
        return self.incarnations.get(incarnation, self.record.attempt) >= self.record.attempt

    def attempt_of(self, incarnation: str) -> int:
        """The attempt an agent incarnation was launched for (unknown: the current one)."""
        return self.incarnations.get(incarnation, self.record.attempt)


class JobTable:
    """Every registered job's :class:`TrackedJob`, by Slurm job id."""

    def __init__(self) -> None:
        self._jobs: dict[str, TrackedJob] = {}

    def add(self, job_id: str, job: TrackedJob) -> None:
        """Track a job registered now, or loaded from the store at start."""
        self._jobs[job_id] = job

    def get(self, job_id: str) -> TrackedJob | None:
        """The job, or None when it is not registered."""
        return self._jobs.get(job_id)

    def __getitem__(self, job_id: str) -> TrackedJob:
        return self._jobs[job_id]

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def __iter__(self) -> Iterator[str]:
        return iter(self._jobs)

    def __len__(self) -> int:
        return len(self._jobs)

    def items(self) -> list[tuple[str, TrackedJob]]:
        """(job id, job) of every job, a copy: a caller may register jobs meanwhile."""
        return list(self._jobs.items())

    def unfinished(self) -> list[tuple[str, TrackedJob]]:
        """(job id, job) of every job whose record is not terminal."""
        return [
            (job_id, job) for job_id, job in self._jobs.items() if not job.record.state.terminal
        ]
