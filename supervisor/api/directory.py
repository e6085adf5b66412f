"""What the API needs to know about jobs, as a Protocol, and an in-memory implementation.

The HTTP layer owns no state: it asks a :class:`JobDirectory` for a job's
secret and current node set, and hands it the events and heartbeats it
accepted. The daemon implements the Protocol over the SQLite store; tests and
early wiring use :class:`MemoryDirectory`.

The methods are synchronous and are called on the server's event loop, so an
implementation must answer quickly (an indexed SQLite lookup, not a Slurm
call).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.wire import protocol
from agent.wire.protocol import (
    AgentCommands,
    Command,
    DriverAction,
    DriverAnswer,
    DriverPhase,
    DriverRequest,
    Event,
    HeartbeatReport,
    JobHeartbeats,
)


class JobDirectory(Protocol):
    """The jobs the API serves: secrets, allocations, and where accepted reports go."""

    def secret(self, job_id: str) -> bytes | None:
        """The job's signing secret; None when the job is unknown."""
        ...

    def allocation(self, job_id: str) -> frozenset[str] | None:
        """The job's current node set; None when the job is unknown."""
        ...

    def ranks(self, job_id: str) -> tuple[int, int] | None:
        """(the most ranks the job's world has ever had, its ranks per node): a report
        about a rank at or beyond them is about no rank of the job; None: unknown."""
        ...

    def accept_events(self, job_id: str, events: Sequence[Event]) -> Sequence[str]:
        """Record ``events`` (in order) durably, once per ``event_id``; return the accepted ids.

        Idempotent: an id recorded before is accepted again and not recorded
        twice. Every event has passed schema, job and allocation checks.
        """
        ...

    async def refuse_events(self, job_id: str, events: Sequence[Event]) -> str | None:
        """Why a batch that passed every other check cannot be taken (answered 403
        ``outside_root``), or None. Checks that touch the disk belong here, off the loop."""
        ...

    def accept_heartbeat(self, job_id: str, report: HeartbeatReport) -> None:
        """Take a node's heartbeat; one older than that node's newest may be ignored."""
        ...

    def durably(self) -> AbstractContextManager[Any]:
        """One durable transaction around several :meth:`accept_events` (nested: a
        savepoint, whose writes an exception undoes alone)."""
        ...

    def accept_job_heartbeats(self, job_id: str, batch: JobHeartbeats) -> None:
        """Take a job's heartbeats from its aggregator: a beat per node heard (its
        lease and step), and the whole reports of nodes whose ranks changed."""
        ...

    def commands_for(self, job_id: str, node: str, incarnation: str) -> Sequence[Command]:
        """Commands to piggyback on the reply to the agent ``incarnation`` on ``node``.

        At most ``protocol.MAX_COMMANDS``; the incarnation tells one launch's
        agent from the next one's on the same node.

        Delivery is at least once: an implementation may repeat a command
        until it sees its effect; the agent applies each ``command_id`` once.
        """
        ...

    def commands_for_agents(
        self, job_id: str, agents: Sequence[tuple[str, str]]
    ) -> Sequence[AgentCommands]:
        """:meth:`commands_for` each ``(node, incarnation)`` of ``agents`` (a job's
        aggregator's request), only those that have some."""
        ...

    def status(self, job_id: str) -> dict[str, Any] | None:
        """A small JSON-shaped summary of the job for the CLI; None when unknown."""
        ...

    async def driver(self, job_id: str, request: DriverRequest) -> DriverAnswer:
        """Answer the in-job driver (see :class:`agent.wire.protocol.DriverPhase`).

        Asynchronous: confirming a relaunch writes to the store and wakes the
        decision loop. Must answer quickly; WAIT when the answer is not known yet.
        """
        ...


@dataclass
class _Job:
    """Everything :class:`MemoryDirectory` keeps about one job."""

    secret: bytes
    nodes: frozenset[str]
    events: list[Event] = field(default_factory=list)
    event_ids: set[str] = field(default_factory=set)
    heartbeats: dict[str, HeartbeatReport] = field(default_factory=dict)
    job_heartbeats: list[JobHeartbeats] = field(default_factory=list)
    commands: dict[str, list[Command]] = field(default_factory=dict)
    driver_answers: list[DriverAnswer] = field(default_factory=list)
    driver_requests: list[DriverRequest] = field(default_factory=list)
    ranks: tuple[int, int] | None = None


class MemoryDirectory:
    """A :class:`JobDirectory` in memory: for tests and for the daemon before the store exists.

    Commands are handed out once (popped on delivery). Thread-safe, so a test
    thread can add jobs and queue commands while the server runs in another.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, _Job] = {}

    def add_job(
        self,
        job_id: str,
        secret: bytes,
        nodes: Iterable[str],
        ranks: tuple[int, int] | None = None,
    ) -> None:
        """Register (or replace) a job with its secret and current nodes (and the bounds
        of its ranks, see :meth:`JobDirectory.ranks`; None: any rank)."""
        with self._lock:
            self._jobs[job_id] = _Job(secret=secret, nodes=frozenset(nodes), ranks=ranks)

    def ranks(self, job_id: str) -> tuple[int, int] | None:
        """See :meth:`JobDirectory.ranks` (as given to :meth:`add_job`)."""
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else job.ranks

    def set_allocation(self, job_id: str, nodes: Iterable[str]) -> None:
        """Change a known job's current node set (a shrink or a relaunch elsewhere)."""
        with self._lock:
            self._jobs[job_id].nodes = frozenset(nodes)

    def queue_command(self, job_id: str, node: str, command: Command) -> None:
        """Deliver ``command`` on the next reply to ``node`` of ``job_id``."""
        with self._lock:
            self._jobs[job_id].commands.setdefault(node, []).append(command)

    def answer_driver(self, job_id: str, answer: DriverAnswer) -> None:
        """Queue the answer to the driver's next question (else: LAUNCH on START, WAIT)."""
        with self._lock:
            self._jobs[job_id].driver_answers.append(answer)

    def driver_requests(self, job_id: str) -> list[DriverRequest]:
        """Every question the job's driver asked, in order."""
        with self._lock:
            return list(self._jobs[job_id].driver_requests)

    def events(self, job_id: str) -> list[Event]:
        """The job's distinct events in the order they were first accepted."""
        with self._lock:
            return list(self._jobs[job_id].events)

    def heartbeats(self, job_id: str) -> dict[str, HeartbeatReport]:
        """The newest heartbeat of each node of the job."""
        with self._lock:
            return dict(self._jobs[job_id].heartbeats)

    def secret(self, job_id: str) -> bytes | None:
        """See :meth:`JobDirectory.secret`."""
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else job.secret

    def allocation(self, job_id: str) -> frozenset[str] | None:
        """See :meth:`JobDirectory.allocation`."""
        with self._lock:
            job = self._jobs.get(job_id)
            return None if job is None else job.nodes

    def accept_events(self, job_id: str, events: Sequence[Event]) -> Sequence[str]:
        """See :meth:`JobDirectory.accept_events`."""
        with self._lock:
            job = self._jobs[job_id]
            for event in events:
                if event.event_id not in job.event_ids:
                    job.event_ids.add(event.event_id)
                    job.events.append(event)
            return [event.event_id for event in events]

    async def refuse_events(self, job_id: str, events: Sequence[Event]) -> str | None:
        """See :meth:`JobDirectory.refuse_events`: this directory knows no checkpoint roots."""
        return None

    def accept_heartbeat(self, job_id: str, report: HeartbeatReport) -> None:
        """See :meth:`JobDirectory.accept_heartbeat`; one older than the newest is ignored."""
        with self._lock:
            heartbeats = self._jobs[job_id].heartbeats
            newest = heartbeats.get(report.node)
            # A replay inside the window must not roll a node's view back.
            if newest is None or report.time_unix_s >= newest.time_unix_s:
                heartbeats[report.node] = report

    def durably(self) -> AbstractContextManager[Any]:
        """See :meth:`JobDirectory.durably`: memory is as durable as it gets."""
        return contextlib.nullcontext()

    def accept_job_heartbeats(self, job_id: str, batch: JobHeartbeats) -> None:
        """See :meth:`JobDirectory.accept_job_heartbeats`: kept as they came."""
        with self._lock:
            self._jobs[job_id].job_heartbeats.append(batch)
            for report in batch.reports:
                heartbeats = self._jobs[job_id].heartbeats
                newest = heartbeats.get(report.node)
                if newest is None or report.time_unix_s >= newest.time_unix_s:
                    heartbeats[report.node] = report

    def commands_for(self, job_id: str, node: str, incarnation: str) -> Sequence[Command]:
        """See :meth:`JobDirectory.commands_for`; each command is handed out once."""
        with self._lock:
            pending = self._jobs[job_id].commands.get(node, [])
            taken = pending[: protocol.MAX_COMMANDS]
            del pending[: protocol.MAX_COMMANDS]
            return taken

    def commands_for_agents(
        self, job_id: str, agents: Sequence[tuple[str, str]]
    ) -> Sequence[AgentCommands]:
        """See :meth:`JobDirectory.commands_for_agents`."""
        found = []
        for node, incarnation in agents:
            commands = self.commands_for(job_id, node, incarnation)
            if commands:
                found.append(AgentCommands(node, incarnation, tuple(commands)))
        return found

    def status(self, job_id: str) -> dict[str, Any] | None:
        """See :meth:`JobDirectory.status`: nodes, event count, newest heartbeat per node."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            return {
                "nodes": sorted(job.nodes),
                "events": len(job.events),
                "heartbeats": {
                    node: report.time_unix_s for node, report in sorted(job.heartbeats.items())
                },
            }

    async def driver(self, job_id: str, request: DriverRequest) -> DriverAnswer:
        """See :meth:`JobDirectory.driver`: queued answers first, else LAUNCH on START, WAIT."""
        with self._lock:
            job = self._jobs[job_id]
            job.driver_requests.append(request)
            if job.driver_answers:
                return job.driver_answers.pop(0)
        if request.phase is DriverPhase.START:
            return DriverAnswer(DriverAction.LAUNCH, request.attempt or 1)
        return DriverAnswer(DriverAction.WAIT, request.attempt or 1, reason="nothing decided")
