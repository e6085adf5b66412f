"""Goodput at scale: a discrete-event simulation of one supervised training job; pure.

A job of ``gpus`` GPUs (``gpus_per_node`` to a node) trains for ``days`` in a
partition holding its nodes, its ``job_spares`` hot spares and ``spare_nodes``
idle ones. Components fail at per-GPU rates (:class:`Component`: a share of
interruptions, the :class:`~supervisor.core.model.Cause` the supervisor
records, whether the node is lost). Each interruption goes the way a
supervised recovery goes:

1. the fault; the supervisor notices it ``detect_s`` later (DETECTION);
2. a faulty node is drained; it comes back idle after ``repair_s``;
3. the relaunch, sized by the supervisor's own rule
   (:func:`supervisor.core.recovery.world_size`, as :func:`~supervisor.core.recovery.relaunch`
   applies it): a hot spare takes the blamed node's place while one is left
   (a new srun step in the allocation, same size: ``swap_s``), else onto
   idle nodes when they make the job larger (a requeue that starts at once),
   else smaller on the healthy nodes (the fast path) when the job's minimum
   and unit allow it, else a requeue that waits in Slurm's queue (a
   log-normal wait) for nodes of other jobs (RECOVERY, QUEUE_WAIT);
4. the work since the last *committed* checkpoint is replayed (LOST_WORK).

Saves are asynchronous: training stalls ``save_stall_s`` per save
(CHECKPOINT_STALL), the write then runs ``write_s`` beside training, and the
checkpoint is committed only when it ends; one save is in flight at a time,
so a save due before the previous write ended waits for it (a stall too). A
job running below its size grows back at the first commit after idle
nodes can make its world larger; one at full size refills its hot spares
the same way, but only once its last spare was used, and then takes as
many as idle nodes allow, up to K (:data:`~supervisor.core.model.Cause.GROW`:
as :func:`supervisor.core.recovery.grow` decides, with the core's own
:func:`~supervisor.core.recovery.with_spares` and
:func:`~supervisor.core.recovery.split_allocation`). A requeue after a
fault takes the spares idle nodes allow, never waiting for them. An idle
hot spare fails at the node-losing components' per-GPU rates while the job
trains: it is drained and repaired like any node, and training goes on.
The checkpoint interval follows :class:`IntervalPolicy`, from
:mod:`agent.checkpoint.interval` and, for the adaptive policy, the daemon's
own MTBF estimate and interval push (:mod:`supervisor.core.goodput`).

The simulation jumps from event to event: between two interruptions it
computes the saves in closed form, so 54 days of 16,384 GPUs (about 420
interruptions) take milliseconds. No clock and no I/O: the random numbers
come from a seeded NumPy generator, and the same seed gives the same result.

Left out, deliberately: faults while the job is down (the failure clock runs
only while it trains), the restart budget (it stops a job after several
restarts without a new checkpoint, which needs several faults within one
interval), the drain rate limit, the loss of the batch host (one node in
thousands), a spare that fails unnoticed and is swapped in (its health check
is taken to catch it), and faults of idle partition nodes (they only delay
a grow). A spare that failed idle leaves the simulated allocation at once;
the core keeps it listed until the next relaunch, and counts it in the
allocation a refill must exceed. After a shrink to a multiple of the unit,
the nodes left over stay as spares up to K here and idle beyond; the core
keeps all of them in the allocation as spares, even for a job that asked
for none.

What a simulation is given lives in :mod:`supervisor.core.simulate_params`,
the interval formulas and the fit of a sweep's curve in
:mod:`supervisor.core.simulate_intervals`; this module re-exports both, so
callers import the simulator from here alone.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from agent.checkpoint.interval import recommended_interval_s, young_interval_s
from supervisor.core.goodput import Badput, Goodput, interval_push, mtbf_estimate
from supervisor.core.model import NODE_FAULT_CAUSES, Cause, JobRecord, new_record
from supervisor.core.recovery import split_allocation, with_spares, world_size
from supervisor.core.save_schedule import Saves
from supervisor.core.simulate_intervals import SweepPoint, best_interval_s, optima_s
from supervisor.core.simulate_params import (
    DAY_S,
    HOUR_S,
    LLAMA3_MIX,
    PRESETS,
    BadParameter,
    Component,
    IntervalPolicy,
    Params,
    llama3,
    llama3_spares,
    opt175b,
)

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class Outcome:
    """What one simulation measured.

    ``accounting`` splits the wall time as :func:`supervisor.core.goodput.account`
    does (its ``ratio`` is the goodput; ``by_fault_cause_s`` is keyed by
    cause value). ``useful_work_share`` weighs productive time by the job's
    size against its full size, so running shrunk counts as lost capacity.
    ``mean_interval_s`` is the interval weighted by training time.

    Hot spares: ``swaps`` counts the faults a spare took over, ``spare_faults``
    the spares that failed while idle (no interruption), ``shrinks`` the
    relaunches that left the world smaller than before the fault.
    ``spare_share`` is the spares' share of the allocation's node time while
    the job trains: nodes paid for that train nothing (``K / (N + K)`` with
    every spare in place, 0 without spares). ``goodput`` is measured against
    the training GPUs, as without spares; :attr:`allocation_goodput` against
    the whole allocation.
    """

    accounting: Goodput
    interruptions: dict[Cause, int]
    grows: int
    queued: int
    saves: int
    useful_work_share: float
    mean_interval_s: float
    final_interval_s: float
    swaps: int
    spare_faults: int
    shrinks: int
    spare_share: float

    @property
    def goodput(self) -> float:
        """Productive share of wall time."""
        return self.accounting.ratio

    @property
    def allocation_goodput(self) -> float:
        """Goodput against the allocation, spares idle: ``goodput * (1 - spare_share)``."""
        return self.goodput * (1.0 - self.spare_share)


class _Simulation:
    """Mutable state of one simulation (local to :func:`simulate`).

    The nodes: ``nodes`` train, ``spares`` wait in the allocation, ``idle``
    wait in the partition, ``repairs`` (when each comes back) are drained.
    """

    def __init__(self, params: Params, seed: int) -> None:
        self.p = params
        # NumPy loads with the first simulation, not with every `resurgo` command.
        from numpy.random import SeedSequence, default_rng

        # The spares' stream is a third child: the first two, hence every run
        # without spares, are what they were before spares existed.
        faults, queue, spares = SeedSequence(seed).spawn(3)
        self.fault_rng: np.random.Generator = default_rng(faults)
        self.queue_rng: np.random.Generator = default_rng(queue)
        self.spare_rng: np.random.Generator = default_rng(spares)
        self.end_s = params.days * DAY_S
        self.gpu_rate = 1.0 / (params.gpu_mtbf_h * HOUR_S)
        # An idle spare runs no code: only the components that take a node fail it.
        node_share = sum(c.share for c in params.mix if c.takes_node)
        self.spare_rate = params.gpus_per_node * self.gpu_rate * node_share
        self.cumulative = list(itertools.accumulate(c.share for c in params.mix))
        self.record: JobRecord = new_record(
            "simulated",
            params.nodes,
            0.0,
            min_nodes=params.min_nodes,
            unit=params.unit_nodes,
            spares=params.job_spares,
        )
        self.home = params.nodes + params.job_spares + params.spare_nodes
        self.nodes = params.nodes
        self.spares = params.job_spares
        self.idle = params.spare_nodes
        self.repairs: list[float] = []
        self.badput = {kind: 0.0 for kind in Badput}
        self.by_cause: dict[str, float] = {}
        self.interruptions = {c.cause: 0 for c in params.mix}
        self.node_faults: list[float] = []
        # Faults come as unit-rate exposures spent at the job's failure rate while
        # it trains: runs with other intervals meet the same faults at the same
        # training times, so their differences are the interval's, not the dice's.
        self.exposure = self.fault_rng.exponential()
        self.spare_exposure = self.spare_rng.exponential()
        self.interval = params.interval_s
        self.productive = self.useful = self.trained = self.interval_time = 0.0
        self.world_node_s = self.spare_node_s = 0.0
        self.grows = self.queued = self.saves = self.attempt = 0
        self.swaps = self.spare_faults = self.shrinks = 0

    def charge(self, kind: Badput, start: float, seconds: float, cause: str | None) -> float:
        """Charge ``seconds`` from ``start`` (clipped at the end) to ``kind``; the new time."""
        seconds = max(0.0, min(seconds, self.end_s - start))
        self.badput[kind] += seconds
        if cause is not None:
            self.by_cause[cause] = self.by_cause.get(cause, 0.0) + seconds
        return start + seconds

    def back_from_repair(self, now: float) -> None:
        """Repaired nodes come back idle to the job's partition of ``home`` nodes.

        A node the job got from the rest of the cluster (after a queue wait)
        goes back there instead: the partition never holds more than ``home``.
        """
        while self.repairs and self.repairs[0] <= now:
            heapq.heappop(self.repairs)
            if self.idle + self.nodes + self.spares + len(self.repairs) < self.home:
                self.idle += 1

    def choose_interval(self, now: float) -> float:
        """The interval for a run starting at ``now``, as :class:`IntervalPolicy` says."""
        p, policy = self.p, self.p.interval_policy
        if policy is IntervalPolicy.YOUNG:
            return young_interval_s(p.save_stall_s, p.job_mtbf_s(self.nodes))
        if policy is IntervalPolicy.DALY:
            return recommended_interval_s(p.save_stall_s, p.write_s, p.job_mtbf_s(self.nodes))
        if policy is IntervalPolicy.ADAPTIVE and now > 0:
            node_mtbf = mtbf_estimate(self.node_faults, now, self.home)
            push = interval_push(
                self.record.job_id, self.attempt, self.interval, node_mtbf, self.nodes,
                p.save_stall_s, p.write_s,
            )  # fmt: skip
            if push is not None:
                self.interval = push.interval_s
        return self.interval

    def grow_time(self, start: float, saves: Saves, since: float) -> tuple[int, float]:
        """When the job grows its allocation back in the run that started at ``start``:
        the first save to commit at or after ``since`` once idle nodes allow it, and
        when (0 and infinity: not in this run)."""
        never = (0, math.inf)
        # At full size, only a job whose last spare was used grows (see allocation).
        full = self.nodes >= self.p.nodes and (self.spares > 0 or not self.p.job_spares)
        if not self.p.grow_back or full:
            return never
        ready, idle, pending = since, self.idle, sorted(self.repairs)
        for index, back_s in enumerate(pending):
            if self.allocation(idle) is not None:
                break
            if idle + self.nodes + self.spares + len(pending) - index - 1 < self.home:
                idle += 1
            ready = max(ready, back_s)
        if self.allocation(idle) is None:
            return never
        save, commit_s = saves.first_commit_after(ready - start)
        return save, start + commit_s

    def larger(self, extra: int) -> int | None:
        """The size ``extra`` idle nodes make, when larger than the job's now (else None)."""
        size = world_size(self.nodes + extra, self.record)
        return size if size is not None and size > self.nodes else None

    def allocation(self, idle: int) -> tuple[int, int] | None:
        """The world and spares a grow requeues the job with, ``idle`` nodes idle, as
        :func:`supervisor.core.recovery.grow` decides; None when it does not grow.

        The job's world, its spares and the idle nodes make the largest valid
        world, never smaller than now, and as many spares besides as they leave
        room for, up to K (:func:`~supervisor.core.recovery.with_spares`). The
        job grows when that is more nodes than it holds, but at full size only
        once its last spare was used: each refill is a restart, and while a
        spare is left the next fault costs no shrink.
        """
        pool = self.nodes + self.spares + idle
        size = world_size(pool, self.record)
        if size is None or size < self.nodes:
            return None
        asked = with_spares(self.record, size, pool)
        if asked <= self.nodes + self.spares or (size == self.nodes and self.spares):
            return None
        return self.split(asked)

    def split(self, allocated: int) -> tuple[int, int]:
        """A new allocation of ``allocated`` nodes as world and spares, as
        :func:`~supervisor.core.recovery.split_allocation` splits it (on counts)."""
        world, spares = split_allocation(self.record, ("",) * allocated)
        return len(world), len(spares)

    def train(self, start: float, saves: Saves, stop: float) -> tuple[float, int, float]:
        """Train from ``start`` until ``stop`` (a fault or the end) or a grow, spares
        failing on the way; the end, and the grow's save and time (if it comes first)."""
        now = start
        while True:
            grow_save, grow_at = self.grow_time(start, saves, now)
            end = min(stop, grow_at)
            rate = self.spares * self.spare_rate
            spare_at = now + self.spare_exposure / rate if rate else math.inf
            self.spare_node_s += self.spares * (min(spare_at, end) - now)
            if spare_at >= end:
                self.spare_exposure -= rate * (end - now)
                return end, grow_save, grow_at
            # An idle spare fails: drained and repaired; training goes on.
            self.spare_exposure = self.spare_rng.exponential()
            self.spares -= 1
            self.spare_faults += 1
            heapq.heappush(self.repairs, spare_at + self.p.repair_s)
            now = spare_at

    def run(self) -> Outcome:
        p, now = self.p, 0.0
        while now < self.end_s:
            self.back_from_repair(now)
            interval = self.choose_interval(now)
            saves = Saves.of(interval, p.save_stall_s, p.write_s)
            rate = self.nodes * p.gpus_per_node * self.gpu_rate
            fault_at = now + self.exposure / rate
            end, grow_save, grow_at = self.train(now, saves, min(fault_at, self.end_s))
            elapsed = end - now
            stalled = saves.stalled(elapsed)
            if end == self.end_s:
                lost = 0.0
            elif end == grow_at:
                lost = saves.lost(elapsed, committed=grow_save)
            else:
                lost = saves.lost(elapsed)
            self.saves += saves.blocks_ended(elapsed)
            self.interval_time += interval * (elapsed - stalled)
            self.trained += elapsed - stalled
            self.world_node_s += self.nodes * elapsed
            self.badput[Badput.CHECKPOINT_STALL] += stalled
            productive = elapsed - stalled - lost
            self.productive += productive
            self.useful += productive * self.nodes / p.nodes
            if end == self.end_s:
                break
            if end == fault_at:
                self.exposure = self.fault_rng.exponential()
                now = self.fault(end, lost)
            else:
                self.exposure -= rate * elapsed
                now = self.grow(end, lost)
        return self.outcome()

    def fault(self, at: float, lost: float) -> float:
        """An interruption at ``at``: detect, drain, relaunch; when the job trains again."""
        p = self.p
        draw = self.fault_rng.random() * self.cumulative[-1]
        component = p.mix[min(bisect.bisect_right(self.cumulative, draw), len(p.mix) - 1)]
        cause = component.cause.value
        self.interruptions[component.cause] += 1
        self.attempt += 1
        self.badput[Badput.LOST_WORK] += lost
        self.by_cause[cause] = self.by_cause.get(cause, 0.0) + lost
        now = self.charge(Badput.DETECTION, at, component.detect_s, cause)
        if component.cause in NODE_FAULT_CAUSES:
            self.node_faults.append(now)
        before = self.nodes
        if component.takes_node:
            self.nodes -= 1
            heapq.heappush(self.repairs, at + p.repair_s)
        self.back_from_repair(now)
        # As swap_in: a free spare takes the blamed node's place (same size and layout).
        swapped = component.takes_node and self.spares > 0
        if swapped:
            self.spares -= 1
            self.nodes += 1
        fast_s = component.recover_s if p.swap_s is None or not swapped else p.swap_s
        now, fast = self.relaunch(now, fast_s, component.recover_s, cause)
        if swapped and fast:
            self.swaps += 1
        if self.nodes < before:
            self.shrinks += 1
        return now

    def relaunch(
        self, now: float, fast_s: float, recover_s: float, cause: str
    ) -> tuple[float, bool]:
        """Relaunch as :func:`supervisor.core.recovery.relaunch` decides; when the job
        trains again, and whether it took the fast path.

        The fast path (``fast_s``: a new srun step, a swap's when a spare took
        the blamed node's place) when the healthy nodes make a valid size,
        unless idle nodes make a larger one (then a requeue onto them, which
        starts at once); else a requeue at full size, which waits in the
        queue unless idle nodes make up the difference. A requeue takes the
        spares that the nodes left free allow; one that waits in the queue
        takes none.
        """
        p = self.p
        alone = world_size(self.nodes, self.record)
        grown = self.larger(self.idle) if alone is not None else None
        if alone is not None and grown is None:
            # The healthy nodes, shrunk to a valid size; the rest stay as spares, or are idle.
            left = self.nodes - alone
            kept = min(left, p.job_spares - self.spares)
            self.spares += kept
            self.idle += left - kept
            self.nodes = alone
            return self.charge(Badput.RECOVERY, now, fast_s, cause), True
        now = self.charge(Badput.RECOVERY, now, recover_s + p.requeue_start_s, cause)
        size = p.nodes if grown is None else grown
        pool = self.nodes + self.spares + self.idle
        if size <= pool:
            asked = with_spares(self.record, size, pool)
            self.nodes, self.spares = self.split(asked)
            self.idle = pool - asked
            return now, False
        self.nodes = size
        # Too few idle nodes: Slurm's queue, until other jobs end (the idle ones are used too).
        self.spares = self.idle = 0
        self.queued += 1
        wait = self.queue_rng.lognormal(math.log(p.queue_median_s), p.queue_sigma)
        return self.charge(Badput.QUEUE_WAIT, now, wait, None), False

    def grow(self, at: float, lost: float) -> float:
        """A planned requeue onto idle nodes right after a commit; when the job trains again."""
        cause = Cause.GROW
        self.back_from_repair(at)
        grown = self.allocation(self.idle)
        assert grown is not None  # grow_time waited for the pool to allow it
        self.grows += 1
        self.attempt += 1
        self.badput[Badput.LOST_WORK] += lost
        self.by_cause[cause.value] = self.by_cause.get(cause.value, 0.0) + lost
        self.idle -= sum(grown) - self.nodes - self.spares
        self.nodes, self.spares = grown
        return self.charge(
            Badput.RECOVERY, at, self.p.grow_recover_s + self.p.requeue_start_s, cause.value
        )

    def outcome(self) -> Outcome:
        accounting = Goodput(self.end_s, self.productive, dict(self.badput), dict(self.by_cause))
        held = self.world_node_s + self.spare_node_s
        return Outcome(
            accounting=accounting,
            interruptions=dict(self.interruptions),
            grows=self.grows,
            queued=self.queued,
            saves=self.saves,
            useful_work_share=self.useful / self.end_s,
            mean_interval_s=self.interval_time / self.trained if self.trained else self.interval,
            final_interval_s=self.choose_interval(self.end_s),
            swaps=self.swaps,
            spare_faults=self.spare_faults,
            shrinks=self.shrinks,
            spare_share=self.spare_node_s / held if held else 0.0,
        )


def simulate(params: Params, seed: int = 0) -> Outcome:
    """Run one simulation of ``params`` with the random numbers of ``seed``."""
    return _Simulation(params, seed).run()


def sweep(params: Params, intervals_s: Sequence[float], seeds: Sequence[int]) -> list[SweepPoint]:
    """Goodput at each fixed interval, averaged over ``seeds``.

    Every interval sees the same seeds, hence the same failures at the same
    training times (common random numbers): the differences between points
    are the interval's, not the dice's.
    """
    points = []
    for interval in intervals_s:
        fixed = replace(params, interval_policy=IntervalPolicy.FIXED, interval_s=interval)
        runs = [simulate(fixed, seed).goodput for seed in seeds]
        points.append(SweepPoint(interval, sum(runs) / len(runs)))
    return points


__all__ = [
    "DAY_S",
    "HOUR_S",
    "LLAMA3_MIX",
    "PRESETS",
    "BadParameter",
    "Component",
    "IntervalPolicy",
    "Outcome",
    "Params",
    "SweepPoint",
    "best_interval_s",
    "llama3",
    "llama3_spares",
    "opt175b",
    "optima_s",
    "simulate",
    "sweep",
]
