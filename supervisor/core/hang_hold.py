"""When a hang report is decided on: held while a rank elsewhere saves, evaluates or
waits for its data loader, or until the other nodes' next heartbeats, and dropped
once training goes on.

Ranks that wait in a collective for a rank-0-only ``torch.save`` or an
evaluation look hung to their agents; the busy rank's own agent knows better
(its phase grace) and reports it if it overruns. And a rank-0-only save's
heartbeat may reach the supervisor after the reports it explains. So a hang
report is:

- **held** (:func:`hold`) while a rank of the current attempt on another node
  of the job is busy (a checkpoint, an evaluation, a wait for data, or work no
  hook sees that keeps a core busy outside any collective, which its agent
  calls ``compute`` up to its busy floor; heard within a lease);
- else **awaited** (:func:`await_heartbeats`) until each other node that calls
  in has sent a heartbeat after it: twice its last gap between heartbeats
  after its newest one, a lease at most (a silent node's silence may be the
  hang, so it is not waited for long);
- decided on otherwise.

Held reports are **dropped** once a rank stepped past them (they were waits),
and **released** once no node has been busy for :func:`patience_s` without
progress (:func:`settle`). Everything here takes ``now``; nothing reads a clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec

from agent.wire.datagram import Phase
from agent.wire.protocol import Event
from supervisor.core.model import JobRecord

# Phases in which a rank may keep its peers waiting in a collective for long.
BUSY_PHASES = frozenset({Phase.CHECKPOINT, Phase.EVAL, Phase.DATA, Phase.COMPUTE})


class BusyRank(NamedTuple):
    """A node's rank in a busy phase (:data:`BUSY_PHASES`), from the node's newest heartbeat."""

    attempt: int
    seen_s: float
    global_rank: int
    phase: Phase


class Heard(msgspec.Struct, frozen=True, gc=False):
    """A node's newest heartbeat report: its attempt, when, and the gap since the one before.

    One per node each beat: untracked by the garbage collector (``gc=False``;
    it holds no container), which at 16,384 nodes otherwise traversed every
    new one, a 40-55 ms stop of the event loop every few seconds.
    """

    attempt: int
    seen_s: float
    gap_s: float | None


class HeldHang(NamedTuple):
    """A hang report held while another node was busy: its attempt and highest hung step."""

    attempt: int
    top_step: int
    event: Event


class AwaitedHang(NamedTuple):
    """A hang report waiting until each of ``nodes`` sent a heartbeat, or ``deadline_s``."""

    deadline_s: float
    nodes: frozenset[str]
    event: Event


@dataclass(frozen=True)
class Hold:
    """A hang report to hold, and the busy rank it waits for (the first by node name)."""

    held: HeldHang
    busy_node: str
    busy: BusyRank


class Settle(enum.Enum):
    """What a heartbeat with progress does to the held hang reports."""

    KEEP = "keep"  # a node is still busy, or the patience is not over
    DROP = "drop"  # training went on past them: they were waits
    RELEASE = "release"  # nobody busy for the patience without progress: decide on them


@dataclass(frozen=True)
class Settled:
    """:func:`settle`'s verdict, the new start of the idle time, and why (for DROP)."""

    verdict: Settle
    idle_since_s: float | None
    why: str = ""


def busy_now(
    busy: Mapping[str, BusyRank],
    record: JobRecord,
    now: float,
    lease_s: float,
    exclude: str | None = None,
) -> dict[str, BusyRank]:
    """Busy nodes of the current attempt still in the job, heard from within a lease."""
    return {
        node: rank
        for node, rank in busy.items()
        if node != exclude
        and node in record.nodes
        and rank.attempt == record.attempt
        and now - rank.seen_s <= lease_s
    }


def top_hung_step(event: Event) -> int:
    """The highest step a hang report's hung ranks name (-1: none)."""
    steps = [hung.get("last_step") for hung in event.payload.get("hung", ())]
    return max((step for step in steps if isinstance(step, int)), default=-1)


def hold(
    event: Event, busy: Mapping[str, BusyRank], record: JobRecord, now: float, lease_s: float
) -> Hold | None:
    """Hold ``event`` (a hang report) while a rank on another node is busy (:data:`BUSY_PHASES`)."""
    others = busy_now(busy, record, now, lease_s, exclude=event.node)
    if not others:
        return None
    node, rank = sorted(others.items())[0]
    return Hold(HeldHang(record.attempt, top_hung_step(event), event), node, rank)


def await_heartbeats(
    event: Event, heard: Mapping[str, Heard], record: JobRecord, now: float, lease_s: float
) -> AwaitedHang | None:
    """Wait with a hang report nobody is known busy for until each other node of the
    current attempt heard from within a lease has sent a heartbeat after it."""
    nodes: set[str] = set()
    deadline = now
    for node, last in heard.items():
        if (
            node != event.node
            and node in record.nodes
            and last.attempt == record.attempt
            and now - last.seen_s <= lease_s
        ):
            nodes.add(node)
            wait_s = lease_s if last.gap_s is None else 2 * last.gap_s + 1.0
            deadline = max(deadline, last.seen_s + wait_s)
    if not nodes or deadline <= now:
        return None
    return AwaitedHang(min(deadline, now + lease_s), frozenset(nodes), event)


def confirm(
    awaited: Sequence[AwaitedHang], node: str | None, now: float
) -> tuple[list[AwaitedHang], list[Event]]:
    """Note ``node``'s heartbeat (None: only the time passed) against the awaited reports:
    (those still waiting, those heard from every node or past their deadline)."""
    waiting: list[AwaitedHang] = []
    due: list[Event] = []
    for deadline, nodes, event in awaited:
        left = nodes - {node or ""}
        if left and now < deadline:
            waiting.append(AwaitedHang(deadline, left, event))
        else:
            due.append(event)
    return waiting, due


def released(held: Sequence[HeldHang], record: JobRecord) -> list[Event]:
    """The held reports to decide on now: those of the current attempt."""
    return [each.event for each in held if each.attempt == record.attempt]


def patience_s(held: Sequence[HeldHang], lease_s: float) -> float:
    """How long held hang reports wait for progress once nobody is busy any more.

    As long as the agents' own hang timeout that made them report (the
    ``timeout_s`` of each hung rank), and at least a lease: the ranks that
    waited for the busy one must get as long to show progress as they got to
    show it before, or a loaded machine's slow first step after a 60 s
    evaluation turns into a restart.
    """
    timeouts = [
        float(hung["timeout_s"])
        for each in held
        for hung in each.event.payload.get("hung", ())
        if isinstance(hung.get("timeout_s"), int | float)
    ]
    return max([lease_s, *timeouts])


def settle(
    held: Sequence[HeldHang],
    step: int,
    busy: Mapping[str, BusyRank],
    record: JobRecord,
    idle_since_s: float | None,
    now: float,
    lease_s: float,
) -> Settled:
    """After a heartbeat report at ``step`` (the job's slowest rank): drop the held hang
    reports once a rank stepped past them; release them once no node has been busy for
    :func:`patience_s` without progress."""
    if not held:
        return Settled(Settle.KEEP, idle_since_s)
    if step > max(each.top_step for each in held):
        nodes = ", ".join(sorted({each.event.node for each in held}))
        why = f"hang reports from {nodes} were waits: training went on at step {step}"
        return Settled(Settle.DROP, None, why)
    if busy_now(busy, record, now, lease_s):
        return Settled(Settle.KEEP, None)
    if idle_since_s is None:
        return Settled(Settle.KEEP, now)
    if now - idle_since_s >= patience_s(held, lease_s):
        return Settled(Settle.RELEASE, None)
    return Settled(Settle.KEEP, idle_since_s)
