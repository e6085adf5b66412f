"""The node agent's view of its ranks' progress: heartbeats, stack samples, verdicts, reports.

:class:`RankMonitor` holds what the agent knows about each live rank (the
:class:`~agent.node.hang.RankProgress` from heartbeats, the stack samples of ranks
that send none) and turns it into events: a hang (with every local rank's
stack, collected before anything is killed, and the ranks ordered most
suspect first), a straggler, and the periodic heartbeat report. The decisions
themselves are the pure functions of :mod:`agent.node.hang`; this module gathers
their inputs (py-spy through :mod:`agent.node.stacks`) and reports each episode once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import psutil

from agent.node.hang import (
    HangConfig,
    HangReason,
    HangVerdict,
    RankProgress,
    StackSample,
    busy_share,
    computing,
    culprit_hints,
    hang_verdicts,
    local_stragglers,
    observe,
    stack_hang_verdict,
)
from agent.node.procs import RankProcess
from agent.node.stacks import StackDump, dump_all, dump_all_placed, fingerprint, in_collective
from agent.wire import protocol
from agent.wire.datagram import Phase, RankBeat, StepReport

log = logging.getLogger(__name__)

STACK_SAMPLES_KEPT = 32
SAMPLE_DEADLINE_S = 15.0
EVIDENCE_DEADLINE_S = 30.0
MAX_PLACED_EVERY_S = 60.0

CPU_SAMPLES_KEPT = 16

Emit = Callable[[protocol.EventKind, dict[str, Any]], Awaitable[None]]
Hung = dict[int, tuple[HangVerdict, protocol.HangDetector]]
CpuSeconds = Callable[[int], "float | None"]


def cpu_seconds(pid: int) -> float | None:
    """The CPU time (user + system, every thread) process ``pid`` used; None when gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return float(times.user + times.system)


class RankMonitor:
    """Per-rank progress and stack history; reports hangs and stragglers once per episode."""

    def __init__(
        self,
        config: HangConfig,
        stack_sample_s: float,
        emit: Emit,
        cpu: CpuSeconds = cpu_seconds,
    ) -> None:
        self._config = config
        self._stack_sample_s = stack_sample_s
        self._emit = emit
        self._cpu = cpu
        self._cpu_samples: dict[int, deque[tuple[float, float]]] = {}  # by pid
        # Ranks that stopped stepping but work outside any collective, as of the
        # check at the time noted: phase compute in the heartbeat reports.
        self._computing: dict[int, float] = {}
        self.progress: dict[int, RankProgress] = {}
        self._samples: dict[int, deque[StackSample]] = {}
        self._last_sample: dict[int, float] = {}
        self._hang_reported: dict[int, float] = {}
        # Ranks told in a stall report (stopped outside any collective), this episode.
        self._stall_reported: dict[int, float] = {}
        self._straggling: set[int] = set()
        # Native-aware "in a collective?" of the local ranks, taken on suspicion.
        self._placed: dict[int, bool] = {}
        self._placed_dumps: dict[int, StackDump] = {}  # by pid, the dumps that placed them
        self._placed_s = -1e9
        # A native dump pauses the ranks ~0.5-1 s: while nothing is confirmed
        # (a long evaluation), each round waits twice as long as the last.
        self._placed_every = stack_sample_s
        self._placed_asked = False

    def on_beat(self, beat: RankBeat, now_s: float) -> None:
        """Fold one heartbeat in; progress after a reported hang starts a new episode.

        A beat the wire protocol cannot carry to the supervisor (a negative
        rank or step, a pid below 1) is dropped: kept, it would make every
        heartbeat report of this node invalid until the rank's next beat (a
        ``beat(-1)`` before a long setup), and the supervisor would take the
        silent node for lost.
        """
        if min(beat.rank, beat.local_rank, beat.step) < 0 or beat.pid < 1:
            return
        progress = observe(self.progress.get(beat.rank), beat, now_s, window=self._config.window)
        self.progress[beat.rank] = progress
        for told in (self._hang_reported, self._stall_reported):
            reported = told.get(beat.rank)
            if reported is not None and progress.progress_s > reported:
                del told[beat.rank]

    def is_behind(self, beat: RankBeat | StepReport) -> bool:
        """Whether ``beat``'s process already told of a later step (a late loss report)."""
        known = self.progress.get(beat.rank)
        return known is not None and known.pid == beat.pid and beat.step < known.step

    def forget(self, global_rank: int) -> RankProgress | None:
        """Drop an exited rank; return what was known of it."""
        self._samples.pop(global_rank, None)
        self._computing.pop(global_rank, None)
        progress = self.progress.pop(global_rank, None)
        if progress is not None:
            self._cpu_samples.pop(progress.pid, None)
        return progress

    async def check_hangs(self, live: Mapping[int, RankProcess], now_s: float) -> None:
        """Decide hangs among ``live`` ranks; report a new one with every local stack."""
        self._placed_asked = False
        try:
            await self._check_hangs(live, now_s)
        finally:
            if not self._placed_asked:  # nothing suspect now: the next suspicion starts afresh
                self._placed_every = self._stack_sample_s

    async def _check_hangs(self, live: Mapping[int, RankProcess], now_s: float) -> None:
        beating = {r: p for r, p in self.progress.items() if r in live}
        self._sample_cpu(beating.values(), now_s)
        verdicts = hang_verdicts(beating, now_s, self._config)
        stalled: Hung = {}
        confirming = any(self._needs_confirming(beating[v.rank], v) for v in verdicts)
        # Optimizer steps stopped in a script that imports nothing: a long
        # evaluation or a rank-0 save stops them too. A hang has ranks waiting
        # for a peer: one here must sit in a collective.
        placed = await self._placed_now(live, now_s) if confirming else {}
        self._computing = dict.fromkeys(self._working(verdicts, beating, placed), now_s)
        if self._computing:
            # A rank here works where no hook sees it: the node's other stopped
            # ranks wait for it, and its heartbeat reports say compute.
            verdicts = []
        elif confirming and not any(placed.values()):
            # No hang here; but a rank placed outside any collective may be
            # the one peers on other nodes wait for: their evidence.
            # A rank already reported hung this episode was told (its stop now
            # may be the stop the supervisor asked for).
            stalled = {
                v.rank: (v, protocol.HangDetector.HEARTBEAT)
                for v in verdicts
                if self._needs_confirming(beating[v.rank], v)
                and placed.get(v.rank) is False
                and v.rank not in self._hang_reported
            }
            verdicts = [v for v in verdicts if not self._needs_confirming(beating[v.rank], v)]
        hung: Hung = {
            verdict.rank: (verdict, protocol.HangDetector.HEARTBEAT) for verdict in verdicts
        }
        silent = [rank for key, rank in live.items() if key not in beating]
        frozen_outside: list[int] = []
        if silent:
            await self._sample_stacks(silent, now_s)
            for rank in silent:
                samples = self._samples.get(rank.global_rank, deque())
                verdict = stack_hang_verdict(
                    list(samples), now_s, self._config.stack_timeout_s, rank=rank.global_rank
                )
                if verdict is None and _frozen_for(samples, now_s) > self._config.stack_timeout_s:
                    # Frozen where Python frames cannot place it (DDP's backward):
                    # the native stack says whether it waits in a collective.
                    placed = await self._placed_now(live, now_s)
                    if placed.get(rank.global_rank):
                        samples.append(replace(samples[-1], time_s=now_s, in_collective=True))
                        verdict = stack_hang_verdict(
                            list(samples), now_s, self._config.stack_timeout_s,
                            rank=rank.global_rank,
                        )  # fmt: skip
                if verdict is not None:
                    hung[rank.global_rank] = (verdict, protocol.HangDetector.STACK)
                elif _frozen_for(samples, now_s) > self._config.stack_timeout_s:
                    frozen_outside.append(rank.global_rank)
        # The stack dumps above were awaited: a rank that stepped meanwhile is no longer
        # stopped, whatever the verdict taken before them said.
        hung, stalled = self._still_stopped(hung, now_s), self._still_stopped(stalled, now_s)
        if not hung and any(rank not in self._stall_reported for rank in stalled):
            # The dumps that placed the ranks are its evidence: no second pause of them.
            for key in await self._report_hang(stalled, live, now_s, stall=True):
                self._stall_reported[key] = now_s
            return
        if not any(rank not in self._hang_reported for rank in hung):
            return
        if self._freezing_outside(silent, hung, frozen_outside, now_s):
            return
        # A rank frozen outside any collective while others wait in one is the
        # likely culprit (stopped or deadlocked): it belongs in the report.
        for key in frozen_outside:
            hung.setdefault(key, (self._frozen_verdict(key, now_s), protocol.HangDetector.STACK))
        for key in await self._report_hang(hung, live, now_s):
            self._hang_reported[key] = now_s

    def _sample_cpu(self, ranks: Iterable[RankProgress], now_s: float) -> None:
        """Note each beating rank's CPU time, for :meth:`_working`."""
        pids = set()
        for progress in ranks:
            pids.add(progress.pid)
            used = self._cpu(progress.pid)
            if used is not None:
                kept = self._cpu_samples.setdefault(progress.pid, deque(maxlen=CPU_SAMPLES_KEPT))
                kept.append((now_s, used))
        for pid in self._cpu_samples.keys() - pids:
            del self._cpu_samples[pid]

    def _working(
        self,
        verdicts: list[HangVerdict],
        beating: Mapping[int, RankProgress],
        placed: Mapping[int, bool],
    ) -> set[int]:
        """The ranks of ``verdicts`` that keep a core busy outside any collective."""
        shares = {
            verdict.rank: busy_share(self._cpu_samples.get(beating[verdict.rank].pid, ()))
            for verdict in verdicts
        }
        return computing(verdicts, shares, placed, self._config)

    def _still_stopped(self, hung: Hung, since_s: float) -> Hung:
        """``hung`` less the beating ranks that made progress after ``since_s`` (or
        exited): their verdict was taken before. Stack verdicts stand: their ranks
        send no beats."""
        return {
            key: (verdict, detector)
            for key, (verdict, detector) in hung.items()
            if detector is not protocol.HangDetector.HEARTBEAT
            or ((progress := self.progress.get(key)) is not None and progress.progress_s <= since_s)
        }

    def _freezing_outside(
        self, silent: list[RankProcess], hung: Hung, frozen_outside: list[int], now_s: float
    ) -> bool:
        """Whether a rank's stack stands still outside any collective, short of the
        timeout: the likely culprit, whose freeze counts from later than its waiting
        peers' when its first samples failed (a loaded machine). The report waits
        for it (the timeout at most), or it would name a waiter alone."""
        for rank in silent:
            key = rank.global_rank
            samples = self._samples.get(key)
            if key in hung or key in frozen_outside or not samples:
                continue
            if not samples[-1].in_collective and _frozen_for(samples, now_s) > 0:
                return True
        return False

    def _needs_confirming(self, progress: RankProgress, verdict: HangVerdict) -> bool:
        """An automatic rank's stop, short of the longest grace: a hang only if confirmed."""
        config = self._config
        limit = max(config.eval_grace_s, config.checkpoint_grace_s, config.data_grace_s)
        return progress.automatic and verdict.since_progress_s <= limit

    async def _placed_now(self, live: Mapping[int, RankProcess], now_s: float) -> dict[int, bool]:
        """Whether each local rank waits in a collective, by native-aware stacks; one round
        of dumps per stack sample period, backing off to one a minute while none is."""
        self._placed_asked = True
        if now_s - self._placed_s >= self._placed_every:
            dumps = await asyncio.to_thread(
                dump_all_placed, [rank.pid for rank in live.values()], EVIDENCE_DEADLINE_S
            )
            self._placed = {
                key: in_collective(dumps[rank.pid])
                for key, rank in live.items()
                if dumps[rank.pid].ok
            }
            self._placed_dumps = dumps
            self._placed_s = now_s
            if not any(self._placed.values()):
                self._placed_every = min(MAX_PLACED_EVERY_S, 2 * self._placed_every)
        return self._placed

    async def check_stragglers(self, live: Mapping[int, RankProcess]) -> None:
        """Report ranks whose step time is a local outlier, once until they recover."""
        beating = {r: p for r, p in self.progress.items() if r in live}
        stragglers = {v.rank: v for v in local_stragglers(beating, self._config)}
        for key, verdict in stragglers.items():
            if key in self._straggling:
                continue
            self._straggling.add(key)
            times = beating[key].step_times
            await self._emit(
                protocol.EventKind.STRAGGLER,
                {
                    "global_rank": key,
                    "local_rank": beating[key].local_rank,
                    "step_time_p50_s": float(times.p50 or 0.0),
                    "step_time_p99_s": float(times.p99 or 0.0),
                    "step_time_mean_s": float(times.mean or 0.0),
                    "steps_observed": times.count,
                    "node_median_step_time_s": float(verdict.reference_s),
                },
            )
        self._straggling &= set(stragglers)

    def rank_statuses(
        self, live: Mapping[int, RankProcess], wall_s: float, now_s: float
    ) -> tuple[protocol.RankStatus, ...]:
        """What the heartbeat report says of each live rank (wall times for the supervisor)."""
        statuses = []
        for key, rank in sorted(live.items()):
            progress = self.progress.get(key)
            if progress is None:
                statuses.append(
                    protocol.RankStatus(
                        key, rank.local_rank, rank.pid, None, None, None, None, None, None, 0
                    )
                )
                continue
            times = progress.step_times
            working_since = self._computing.get(key)
            phase = progress.phase
            if working_since is not None and progress.progress_s <= working_since:
                phase = Phase.COMPUTE
            statuses.append(
                protocol.RankStatus(
                    global_rank=key,
                    local_rank=rank.local_rank,
                    pid=rank.pid,
                    step=progress.step,
                    phase=phase.value,
                    last_progress_unix_s=wall_s - (now_s - progress.progress_s),
                    step_time_p50_s=times.p50,
                    step_time_p99_s=times.p99,
                    step_time_mean_s=times.mean,
                    steps_observed=times.count,
                    compute_p50_s=progress.compute_times.p50,
                    compute_observed=progress.compute_times.count,
                )
            )
        return tuple(statuses)

    async def _sample_stacks(self, ranks: list[RankProcess], now_s: float) -> None:
        due = [
            rank
            for rank in ranks
            if now_s - self._last_sample.get(rank.global_rank, -1e9) >= self._stack_sample_s
        ]
        if not due:
            return
        dumps = await asyncio.to_thread(dump_all, [rank.pid for rank in due], SAMPLE_DEADLINE_S)
        for rank in due:
            self._last_sample[rank.global_rank] = now_s
            dump = dumps[rank.pid]
            if not dump.ok:
                log.debug("stack sample of rank %d failed: %s", rank.global_rank, dump.error)
                continue
            samples = self._samples.setdefault(rank.global_rank, deque(maxlen=STACK_SAMPLES_KEPT))
            samples.append(StackSample(now_s, fingerprint(dump), in_collective(dump)))

    def _frozen_verdict(self, rank: int, now_s: float) -> HangVerdict:
        return HangVerdict(
            rank=rank,
            last_step=None,
            phase=None,
            since_progress_s=_frozen_for(self._samples[rank], now_s),
            timeout_s=self._config.stack_timeout_s,
            reason=HangReason.STACK_IN_COLLECTIVE,
            detail="stack frozen outside any collective while other ranks wait in one",
        )

    async def _report_hang(
        self, hung: Hung, live: Mapping[int, RankProcess], since_s: float, stall: bool = False
    ) -> Hung:
        """Report ``hung`` with every local rank's stack and return what was reported:
        nothing when every beating rank in it stepped after ``since_s`` while the
        evidence was taken. ``stall``: as a stall report (evidence only: none of the
        node's ranks waits in a collective), whose stacks are the dumps that placed
        the ranks moments ago."""
        pids = [rank.pid for rank in live.values()]
        if stall and all(pid in self._placed_dumps for pid in pids):
            dumps = self._placed_dumps
        else:
            # Evidence before anything is killed: every local rank's stack, hung or not.
            dumps = await asyncio.to_thread(dump_all_placed, pids, EVIDENCE_DEADLINE_S)
            hung = self._still_stopped(hung, since_s)
            if not hung:
                return hung
        stacks = {
            str(key): protocol.clip_text(_stack_text(dumps[rank.pid]), protocol.MAX_TEXT_CHARS)
            for key, rank in live.items()
        }
        collective = {
            key: in_collective(dumps[rank.pid]) for key, rank in live.items() if dumps[rank.pid].ok
        }
        for key in live.keys() - collective.keys():
            # No evidence dump (a stopped rank under load can time out): what the
            # detection itself saw still places it, inside a collective or not.
            seen = self._placed.get(key)
            if seen is None and self._samples.get(key):
                seen = self._samples[key][-1].in_collective
            if seen is not None:
                collective[key] = seen
        await self._emit(
            protocol.EventKind.HANG,
            {
                "hung": [
                    {
                        "global_rank": key,
                        "local_rank": live[key].local_rank,
                        "pid": live[key].pid,
                        "last_step": verdict.last_step,
                        "phase": None if verdict.phase is None else verdict.phase.value,
                        "seconds_since_progress": float(verdict.since_progress_s),
                        "timeout_s": float(verdict.timeout_s),
                        "detector": detector.value,
                    }
                    for key, (verdict, detector) in sorted(hung.items())
                    if key in live
                ],
                "stacks": stacks,
                "culprits": self._culprits(hung, collective),
                **({"stalled": True} if stall else {}),
            },
        )
        return hung

    def _culprits(self, hung: Hung, collective: Mapping[int, bool]) -> list[dict[str, Any]]:
        """Hung ranks most suspect first: behind, outside the collective, stopped first."""
        hints = culprit_hints(self.progress, hung, collective)
        if hints:
            return [
                {
                    "global_rank": hint.rank,
                    "last_step": hint.last_step,
                    "in_collective": hint.in_collective,
                    "reason": f"{hint.steps_behind} step(s) behind, stopped "
                    f"{hint.stopped_earlier_s:.1f} s before the last",
                }
                for hint in hints
            ]
        # No heartbeats (uninstrumented): the stack is the only evidence.
        return [
            {
                "global_rank": key,
                "last_step": None,
                "in_collective": collective.get(key),
                "reason": "stack frozen outside any collective"
                if collective.get(key) is False
                else "stack frozen in a collective",
            }
            for key in sorted(hung, key=lambda k: (collective.get(k, True), k))
        ]


def _frozen_for(samples: deque[StackSample], now_s: float) -> float:
    """How long the newest stack fingerprint has been unchanged (0 with under two samples)."""
    if len(samples) < 2:
        return 0.0
    newest = samples[-1].fingerprint
    since = samples[-1].time_s
    for sample in reversed(samples):
        if sample.fingerprint != newest:
            break
        since = sample.time_s
    return now_s - since


def _stack_text(dump: StackDump) -> str:
    return dump.text if dump.ok else f"(no stack: {dump.error})"
