"""RankMonitor: a stop of automatic beats (a script that imports nothing) is a hang only
when a native-aware stack places a local rank in a collective; instrumented
beats need no confirmation. Stack dumps are faked here; the real py-spy path
is tests/e2e/test_plain_scripts.py."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from agent.node import watch
from agent.node.hang import HangConfig
from agent.node.procs import RankProcess
from agent.node.stacks import Frame, StackDump, ThreadStack
from agent.wire import protocol
from agent.wire.datagram import Phase, RankBeat

CONFIG = HangConfig(floor_s=8.0, k=5.0, stack_timeout_s=8.0)
LIVE = {0: RankProcess(0, 0, 100), 1: RankProcess(1, 1, 101)}


def dump(pid: int, *functions: str, native: bool = False) -> StackDump:
    frames = tuple(
        Frame(
            function=name, file="libtorch_cpu.so" if native else "train.py", line=0, native=native
        )
        for name in functions
    )
    thread = ThreadStack(thread_id=pid, name="MainThread", idle=True, frames=frames)
    return StackDump(pid, True, f"{functions}", (thread,), None, native)


def idle(pid: int) -> float:
    """Every rank's CPU time stands still: none of them works."""
    return 1.0


def monitor(
    stacks: dict[int, StackDump], monkeypatch: pytest.MonkeyPatch, cpu: watch.CpuSeconds = idle
) -> tuple[watch.RankMonitor, list[dict[str, Any]]]:
    reports: list[dict[str, Any]] = []

    async def emit(kind: protocol.EventKind, payload: dict[str, Any]) -> None:
        assert kind is protocol.EventKind.HANG
        reports.append(payload)

    monkeypatch.setattr(
        watch, "dump_all_placed", lambda pids, timeout_s: {p: stacks[p] for p in pids}
    )
    return watch.RankMonitor(CONFIG, stack_sample_s=1.0, emit=emit, cpu=cpu), reports


def stepped(rankmon: watch.RankMonitor, automatic: bool, steps: int = 10) -> None:
    for step in range(1, steps + 1):
        for rank, process in LIVE.items():
            beat = RankBeat(rank, process.local_rank, process.pid, step, Phase.TRAIN,
                            0.0, None, automatic)  # fmt: skip
            rankmon.on_beat(beat, float(step) * 0.5)


def check(rankmon: watch.RankMonitor, now_s: float) -> None:
    asyncio.run(rankmon.check_hangs(LIVE, now_s))


def stalled_at_60_s(monkeypatch: pytest.MonkeyPatch) -> tuple[
    dict[int, StackDump], watch.RankMonitor, list[dict[str, Any]]
]:  # fmt: skip
    """Automatic beats stopped 55 s ago, every rank outside any collective, checked."""
    stacks = {100: dump(100, "evaluate"), 101: dump(101, "evaluate")}
    rankmon, reports = monitor(stacks, monkeypatch)
    stepped(rankmon, automatic=True)
    check(rankmon, 60.0)
    return stacks, rankmon, reports


def test_automatic_beats_stopped_with_no_rank_in_a_collective_are_only_a_stall_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An evaluation the hooks do not see, or the rank peers elsewhere wait for: every
    # rank here computes (or sleeps) outside any collective. Evidence, once an episode.
    _, rankmon, reports = stalled_at_60_s(monkeypatch)
    (report,) = reports
    assert report["stalled"] is True
    assert sorted(h["global_rank"] for h in report["hung"]) == [0, 1]
    assert {c["in_collective"] for c in report["culprits"]} == {False}
    check(rankmon, 61.0)
    assert len(reports) == 1  # told once an episode
    for rank in LIVE:  # progress: a new episode may be told
        beat_at(rankmon, rank, 11, 70.0)
    check(rankmon, 500.0)  # past 5 x the 64.5 s step just measured
    assert len(reports) == 2 and reports[1]["stalled"] is True


def test_a_rank_in_a_collective_after_a_stall_report_is_still_reported_hung(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stacks, rankmon, reports = stalled_at_60_s(monkeypatch)
    stacks[100] = dump(100, "c10d::Reducer::finalize_backward", native=True)
    check(rankmon, 200.0)  # past the native dumps' back-off
    assert [r.get("stalled", False) for r in reports] == [True, False]


def test_automatic_beats_stopped_while_a_rank_waits_in_ddp_backward_are_a_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stacks = {
        100: dump(100, "c10d::Reducer::finalize_backward", "THPEngine_run_backward", native=True),
        101: dump(101, "time_sleep", native=True),
    }
    rankmon, reports = monitor(stacks, monkeypatch)
    stepped(rankmon, automatic=True)
    check(rankmon, 60.0)
    (report,) = reports
    assert sorted(h["global_rank"] for h in report["hung"]) == [0, 1]
    # The rank that is not waiting is the most suspect.
    assert report["culprits"][0]["global_rank"] == 1
    assert {c["global_rank"]: c["in_collective"] for c in report["culprits"]} == {0: True, 1: False}


def test_automatic_beats_stopped_past_the_longest_grace_are_a_hang_unconfirmed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stacks = {100: dump(100, "evaluate"), 101: dump(101, "evaluate")}
    rankmon, reports = monitor(stacks, monkeypatch)
    stepped(rankmon, automatic=True)
    check(rankmon, 5.0 + max(CONFIG.eval_grace_s, CONFIG.checkpoint_grace_s) + 1)
    (report,) = reports
    assert "stalled" not in report


def test_instrumented_beats_need_no_confirmation(monkeypatch: pytest.MonkeyPatch) -> None:
    stacks = {100: dump(100, "evaluate"), 101: dump(101, "evaluate")}
    rankmon, reports = monitor(stacks, monkeypatch)
    stepped(rankmon, automatic=False)
    check(rankmon, 60.0)
    assert len(reports) == 1


def test_native_dumps_back_off_while_nothing_is_confirmed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A native dump pauses the ranks: during a long evaluation they come ever rarer."""
    stacks = {100: dump(100, "evaluate"), 101: dump(101, "evaluate")}
    rankmon, _ = monitor(stacks, monkeypatch)
    rounds: list[float] = []
    now = [10.0]

    def counted(pids: list[int], timeout_s: float) -> dict[int, StackDump]:
        rounds.append(now[0])
        return {p: stacks[p] for p in pids}

    monkeypatch.setattr(watch, "dump_all_placed", counted)
    stepped(rankmon, automatic=True)
    while now[0] < 200:
        now[0] += 1.0
        check(rankmon, now[0])
    gaps = [later - earlier for earlier, later in itertools.pairwise(rounds)]
    assert gaps[:5] == [2.0, 4.0, 8.0, 16.0, 32.0] and set(gaps[5:]) == {60.0}, gaps


def test_a_stopped_rank_whose_evidence_dump_fails_is_still_the_first_suspect(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No beats at all (uninstrumented): the stack samples that found the hang place
    each rank when the evidence dump of the stopped one times out."""
    samples = {
        100: StackDump(100, True, "", (ThreadStack(100, "MainThread", True, (
            Frame("all_reduce", "torch/distributed/distributed_c10d.py", 1, False),)),), None),
        101: dump(101, "kill"),
    }  # fmt: skip
    evidence = {
        100: dump(100, "gloo::AllreduceRing::run", native=True),
        101: StackDump(101, False, "", (), "py-spy timed out after 5 s"),
    }
    rankmon, reports = monitor(evidence, monkeypatch)
    monkeypatch.setattr(watch, "dump_all", lambda pids, timeout_s: {p: samples[p] for p in pids})
    for now in range(0, 30):
        check(rankmon, float(now))
    assert reports, "no hang found"
    assert [c["global_rank"] for c in reports[0]["culprits"]] == [1, 0]
    assert reports[0]["culprits"][0]["in_collective"] is False


def test_a_waiter_is_not_reported_alone_while_a_rank_frozen_outside_is_short_of_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under load the stopped rank's first samples failed: its freeze counts from later
    than its waiting peer's, which crosses the timeout first. The report waits for the
    stopped rank, and names it first."""
    frame = Frame("all_reduce", "torch/distributed/distributed_c10d.py", 1, False)
    waiting = StackDump(100, True, "", (ThreadStack(100, "MainThread", True, (frame,)),), None)
    failed = StackDump(101, False, "", (), "py-spy timed out after 5 s")

    def samples(pids: list[int], timeout_s: float, clock: list[float]) -> dict[int, StackDump]:
        stopped = dump(101, "kill") if clock[0] >= 3 else failed
        return {p: waiting if p == 100 else stopped for p in pids}

    clock = [0.0]
    rankmon, reports = monitor({100: waiting, 101: dump(101, "kill")}, monkeypatch)
    monkeypatch.setattr(watch, "dump_all", lambda pids, timeout_s: samples(pids, timeout_s, clock))
    for now in range(0, 30):
        clock[0] = float(now)
        check(rankmon, float(now))
        if reports:
            break
    assert reports, "no hang found"
    assert [c["global_rank"] for c in reports[0]["culprits"]] == [1, 0], reports[0]["culprits"]


def beat_at(rankmon: watch.RankMonitor, rank: int, step: int, now_s: float) -> None:
    process = LIVE[rank]
    rankmon.on_beat(
        RankBeat(rank, process.local_rank, process.pid, step, Phase.TRAIN, 0.0, None, True), now_s
    )


def waiting_in_backward() -> dict[int, StackDump]:
    """Both ranks' native stacks inside DDP's backward, waiting in its all-reduce."""
    return {pid: dump(pid, "c10d::Reducer::finalize_backward", native=True) for pid in (100, 101)}


def test_a_rank_that_steps_while_its_stack_is_dumped_is_not_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Training went on while the dump that confirms the wait ran (seconds under load):
    # the verdict taken before it is stale, and a report of it would open a recovery
    # of a job that trains.
    stacks = waiting_in_backward()
    rankmon, reports = monitor(stacks, monkeypatch)
    stepped(rankmon, automatic=True)

    def dumped_while_training_went_on(pids: list[int], timeout_s: float) -> dict[int, StackDump]:
        for rank in LIVE:
            beat_at(rankmon, rank, 11, 61.0)
        return {pid: stacks[pid] for pid in pids}

    monkeypatch.setattr(watch, "dump_all_placed", dumped_while_training_went_on)
    check(rankmon, 60.0)
    assert reports == []


def test_a_rank_reported_hung_then_stopped_sends_no_stall_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stacks = waiting_in_backward()
    rankmon, reports = monitor(stacks, monkeypatch)
    stepped(rankmon, automatic=True)
    check(rankmon, 60.0)
    # The supervisor stops the ranks: out of the collective, in their teardown.
    stacks[100], stacks[101] = dump(100, "teardown"), dump(101, "teardown")
    check(rankmon, 200.0)
    assert [r.get("stalled", False) for r in reports] == [False]


class Cores:
    """CPU time of the ranks' pids: the ``busy`` ones use a whole core from the clock on."""

    def __init__(self, *busy: int) -> None:
        self.busy = set(busy)
        self.now_s = 0.0

    def __call__(self, pid: int) -> float:
        return self.now_s if pid in self.busy else 1.0


def check_each_second(
    rankmon: watch.RankMonitor, cores: Cores, start_s: float, end_s: float
) -> None:
    now_s = start_s
    while now_s <= end_s:
        cores.now_s = now_s
        check(rankmon, now_s)
        now_s += 1.0


def phases(rankmon: watch.RankMonitor) -> dict[int, str | None]:
    return {status.global_rank: status.phase for status in rankmon.rank_statuses(LIVE, 0.0, 0.0)}


@pytest.mark.parametrize("automatic", [True, False], ids=["automatic", "instrumented"])
def test_a_rank_busy_outside_any_collective_is_compute_until_the_busy_floor(
    automatic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 1 uploads (or recompiles) where no hook sees it; rank 0 sleeps outside any
    # collective too. The node says compute and reports nothing short of the busy
    # floor; then a stall report (automatic beats) or a hang (instrumented).
    stacks = {100: dump(100, "sleep"), 101: dump(101, "upload")}
    cores = Cores(101)
    rankmon, reports = monitor(stacks, monkeypatch, cores)
    stepped(rankmon, automatic=automatic)  # last step at 5 s
    check_each_second(rankmon, cores, 6.0, 64.0)  # 59 s without a step
    assert reports == []
    assert phases(rankmon) == {0: "train", 1: "compute"}
    check_each_second(rankmon, cores, 66.0, 70.0)  # past the 60 s busy floor
    (report,) = reports
    assert report.get("stalled", False) is automatic
    assert phases(rankmon) == {0: "train", 1: "train"}


def test_a_rank_idle_outside_any_collective_is_told_at_the_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    stacks = {100: dump(100, "sleep"), 101: dump(101, "sleep")}
    cores = Cores()
    rankmon, reports = monitor(stacks, monkeypatch, cores)
    stepped(rankmon, automatic=True)
    check_each_second(rankmon, cores, 10.0, 15.0)  # the 8 s floor passed at 13 s
    assert [r.get("stalled") for r in reports] == [True]


def test_a_waiter_spinning_in_a_collective_is_no_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL polls its stream: a waiting rank may keep a core busy inside the collective.
    stacks = {
        100: dump(100, "c10d::Reducer::finalize_backward", native=True),
        101: dump(101, "time_sleep", native=True),
    }
    cores = Cores(100)
    rankmon, reports = monitor(stacks, monkeypatch, cores)
    stepped(rankmon, automatic=True)
    check_each_second(rankmon, cores, 10.0, 15.0)
    (report,) = reports
    assert "stalled" not in report
    assert report["culprits"][0]["global_rank"] == 1
