"""Hang and straggler verdicts: table tests with a fixed NOW (no clock, no OS)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from agent.node.hang import (
    HangConfig,
    HangReason,
    HangVerdict,
    RankProgress,
    StackSample,
    StepTimes,
    busy_share,
    computing,
    culprit_hints,
    hang_verdicts,
    local_stragglers,
    observe,
    stack_hang_verdict,
    timeout_for,
)
from agent.wire.datagram import Phase, RankBeat
from agent.wire.errors import ConfigError

NOW = 10_000.0
CONFIG = HangConfig()


def b(step: int, phase: Phase = Phase.TRAIN, *, rank: int = 0, pid: int = 100) -> RankBeat:
    return RankBeat(rank=rank, local_rank=rank, pid=pid, step=step, phase=phase, wall_time_s=0.0)


def feed(
    beats: Sequence[tuple[float, RankBeat]], previous: RankProgress | None = None
) -> RankProgress:
    """Replay (agent time, beat) pairs through observe."""
    state = previous
    for at, beat in beats:
        state = observe(state, beat, at)
    assert state is not None
    return state


def training(rank: int, step_s: float, steps: int, end_s: float, pid: int = 100) -> RankProgress:
    """A rank that did ``steps`` steps of ``step_s`` each, the last one at ``end_s``."""
    start = end_s - steps * step_s
    return feed([(start + i * step_s, b(i, rank=rank, pid=pid)) for i in range(steps + 1)])


def test_compute_times_are_kept_per_rank_from_the_beats_that_carry_them() -> None:
    def timed(step: int, compute_s: float | None, pid: int = 100) -> RankBeat:
        return RankBeat(0, 0, pid, step, Phase.TRAIN, 0.0, compute_s)

    state = feed([(NOW, timed(1, 0.5)), (NOW + 1, timed(2, None)), (NOW + 2, timed(3, 0.7))])
    assert state.compute_times.durations == (0.5, 0.7)
    assert state.compute_times.p50 == 0.5
    restarted = observe(state, timed(0, 0.1, pid=200), NOW + 3)  # a new process starts afresh
    assert restarted.compute_times.durations == (0.1,)


# --- config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("floor_s", 0.0),
        ("k", -1.0),
        ("init_grace_s", float("nan")),
        ("checkpoint_grace_s", float("inf")),
        ("eval_grace_s", "900"),
        ("stack_timeout_s", True),
        ("window", 1),
        ("window", 2.5),
        ("straggler_factor", 1.0),
        ("straggler_min_steps", 0),
    ],
)
def test_bad_hang_config_names_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        HangConfig(**{field: value})  # type: ignore[arg-type]


# --- step times and progress ------------------------------------------------------------


def test_step_times_keep_a_bounded_window_with_nearest_rank_quantiles() -> None:
    times = StepTimes(window=4)
    for d in (9.0, 1.0, 2.0, 3.0, 4.0):
        times = times.add(d)
    assert times.durations == (1.0, 2.0, 3.0, 4.0)
    assert (times.count, times.p50, times.p99, times.mean) == (4, 2.0, 4.0, 2.5)
    assert StepTimes().p99 is None and StepTimes().mean is None


def test_step_times_are_the_intervals_between_step_advances_per_step() -> None:
    state = feed([(0.0, b(0)), (2.0, b(1)), (8.0, b(4))])
    assert state.step_times.durations == (2.0, 2.0)
    assert (state.step, state.progress_s) == (4, 8.0)


def test_re_sending_the_same_step_is_not_progress() -> None:
    state = feed([(0.0, b(5)), (30.0, b(5)), (59.0, b(5))])
    assert (state.progress_s, state.seen_s, state.beats) == (0.0, 59.0, 3)
    assert state.step_times.count == 0


def test_a_phase_change_is_progress_but_its_duration_is_not_a_step_time() -> None:
    state = feed(
        [
            (0.0, b(10)),
            (1.0, b(11)),
            (2.0, b(11, Phase.CHECKPOINT)),
            (302.0, b(11, Phase.TRAIN)),
            (303.0, b(12)),
        ]
    )
    assert state.step_times.durations == (1.0, 1.0)
    assert state.progress_s == 303.0


def test_a_new_pid_starts_a_fresh_history() -> None:
    old = training(0, 1.0, 20, NOW - 100)
    fresh = observe(old, b(0, Phase.INIT, pid=200), NOW)
    assert (fresh.pid, fresh.step, fresh.step_times.count, fresh.progress_s) == (200, 0, 0, NOW)


# --- hang verdicts ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "progress", "timeout", "reason"),
    [
        ("fast steps: the floor wins", training(0, 1.0, 20, 0.0), 20.0, HangReason.FLOOR),
        ("slow steps: k x p99 wins", training(0, 30.0, 20, 0.0), 150.0, HangReason.ADAPTIVE),
        ("init", feed([(0.0, b(0, Phase.INIT))]), 600.0, HangReason.INIT_GRACE),
        (
            "train before any step time",
            feed([(0.0, b(0, Phase.INIT)), (1.0, b(0))]),
            600.0,
            HangReason.INIT_GRACE,
        ),
        (
            "checkpoint",
            feed([(0.0, b(3)), (1.0, b(3, Phase.CHECKPOINT))]),
            600.0,
            HangReason.CHECKPOINT_GRACE,
        ),
        ("eval", feed([(0.0, b(3, Phase.EVAL))]), 900.0, HangReason.EVAL_GRACE),
        ("data", feed([(0.0, b(3)), (1.0, b(3, Phase.DATA))]), 600.0, HangReason.DATA_GRACE),
        ("compute", feed([(0.0, b(3, Phase.COMPUTE))]), 60.0, HangReason.BUSY_FLOOR),
    ],
)
def test_timeout_for_each_phase(
    case: str, progress: RankProgress, timeout: float, reason: HangReason
) -> None:
    assert timeout_for(progress, CONFIG) == (timeout, reason), case


def test_adaptive_timeout_follows_the_p99_of_recent_steps() -> None:
    # 49 one-second steps and one 20 s step: p99 over 50 is the 20 s one.
    beats = [(float(i), b(i)) for i in range(50)] + [(69.0, b(50))]
    state = feed(beats)
    assert state.step_times.p99 == 20.0
    assert timeout_for(state, CONFIG) == (100.0, HangReason.ADAPTIVE)


@pytest.mark.parametrize(
    ("since_s", "hung"),
    [(19.9, False), (20.0, False), (20.1, True)],
)
def test_train_hang_strictly_after_the_floor(since_s: float, hung: bool) -> None:
    ranks = {0: training(0, 1.0, 20, NOW - since_s)}
    assert bool(hang_verdicts(ranks, NOW, CONFIG)) is hung


def test_a_rank_that_keeps_beating_the_same_step_is_still_hung() -> None:
    state = training(0, 1.0, 20, NOW - 100)
    state = feed([(NOW - 50 + i, b(state.step)) for i in range(50)], state)
    (verdict,) = hang_verdicts({0: state}, NOW, CONFIG)
    assert verdict.since_progress_s == 100.0
    assert verdict.last_step == 20


def test_no_false_hang_during_a_slow_startup_or_checkpoint_within_grace() -> None:
    ranks = {
        0: feed([(NOW - 599, b(0, Phase.INIT))]),
        1: feed([(NOW - 700, b(0, Phase.INIT, rank=1)), (NOW - 30, b(0, rank=1))]),
        2: feed(
            [
                (NOW - 1000, b(40, rank=2)),
                (NOW - 999, b(41, rank=2)),
                (NOW - 599, b(41, Phase.CHECKPOINT, rank=2)),
            ]
        ),
        3: feed([(NOW - 899, b(9, Phase.EVAL, rank=3))]),
    }
    assert hang_verdicts(ranks, NOW, CONFIG) == []
    later = hang_verdicts(ranks, NOW + 2, CONFIG)
    assert [(v.rank, v.reason) for v in later] == [
        (0, HangReason.INIT_GRACE),
        (2, HangReason.CHECKPOINT_GRACE),
        (3, HangReason.EVAL_GRACE),
    ]


def test_hang_verdict_says_what_why_and_for_how_long() -> None:
    state = training(4, 30.0, 20, NOW - 200)
    (verdict,) = hang_verdicts({4: state}, NOW, CONFIG)
    assert (verdict.rank, verdict.last_step, verdict.phase) == (4, 20, Phase.TRAIN)
    assert (verdict.since_progress_s, verdict.timeout_s) == (200.0, 150.0)
    assert verdict.reason is HangReason.ADAPTIVE
    assert "200.0 s" in verdict.detail and "p99 step time 30.000 s" in verdict.detail


def test_config_changes_the_verdict() -> None:
    ranks = {0: training(0, 1.0, 20, NOW - 20)}
    assert hang_verdicts(ranks, NOW, CONFIG) == []
    assert hang_verdicts(ranks, NOW, HangConfig(floor_s=10.0))[0].timeout_s == 10.0


# --- stragglers -------------------------------------------------------------------------


def test_a_rank_slower_than_its_local_peers_is_a_straggler() -> None:
    ranks = {r: training(r, 1.0, 20, NOW) for r in range(3)}
    ranks[3] = training(3, 1.6, 20, NOW)
    (verdict,) = local_stragglers(ranks, CONFIG)
    assert verdict.rank == 3
    assert (verdict.median_step_s, verdict.reference_s) == pytest.approx((1.6, 1.0))
    assert verdict.ratio == pytest.approx(1.6)


@pytest.mark.parametrize(
    ("case", "step_times", "steps"),
    [
        ("within the factor", [1.0, 1.0, 1.4], 20),
        ("too few steps", [1.0, 1.0, 3.0], 9),
        ("alone", [3.0], 20),
    ],
)
def test_no_straggler(case: str, step_times: list[float], steps: int) -> None:
    ranks = {r: training(r, s, steps, NOW) for r, s in enumerate(step_times)}
    assert local_stragglers(ranks, CONFIG) == [], case


# --- stacks (uninstrumented scripts) ----------------------------------------------------


def samples(*spec: tuple[float, str, bool]) -> list[StackSample]:
    return [StackSample(t, fp, c) for t, fp, c in spec]


@pytest.mark.parametrize(
    ("case", "spec", "hung"),
    [
        ("frozen in a collective", [(NOW - 400, "a", True), (NOW - 10, "a", True)], True),
        (
            "frozen since the change",
            [(NOW - 900, "b", True), (NOW - 250, "a", True), (NOW, "a", True)],
            False,
        ),
        ("frozen but not in a collective", [(NOW - 400, "a", False), (NOW, "a", False)], False),
        ("moving", [(NOW - 400, "a", True), (NOW - 10, "b", True)], False),
        ("one sample proves nothing", [(NOW - 400, "a", True)], False),
        ("exactly the timeout", [(NOW - 300, "a", True), (NOW, "a", True)], False),
    ],
)
def test_stack_hang_verdict(case: str, spec: list[tuple[float, str, bool]], hung: bool) -> None:
    verdict = stack_hang_verdict(samples(*spec), NOW, 300.0, rank=2)
    assert (verdict is not None) is hung, case


def test_stack_hang_verdict_counts_from_the_first_sample_of_the_frozen_stretch() -> None:
    spec = [(NOW - 900, "b", False), (NOW - 400, "a", True), (NOW - 5, "a", True)]
    verdict = stack_hang_verdict(samples(*spec), NOW, 300.0, rank=2)
    assert verdict is not None
    assert (verdict.rank, verdict.last_step, verdict.phase) == (2, None, None)
    assert (verdict.since_progress_s, verdict.reason) == (400.0, HangReason.STACK_IN_COLLECTIVE)


# --- culprit hints ----------------------------------------------------------------------


def test_culprit_is_behind_then_outside_the_collective_then_stopped_first() -> None:
    ranks = {
        0: feed([(NOW - 100, b(50, rank=0))]),
        1: feed([(NOW - 90, b(49, rank=1))]),
        2: feed([(NOW - 120, b(50, rank=2))]),
        3: feed([(NOW - 101, b(50, rank=3))]),
        4: feed([(NOW - 1, b(51, rank=4))]),  # not hung
    }
    hints = culprit_hints(ranks, [0, 1, 2, 3, 7], in_collective={0: True, 2: True, 3: False})
    assert [h.rank for h in hints] == [1, 3, 2, 0]
    assert (hints[0].steps_behind, hints[0].stopped_earlier_s) == (1, 0.0)
    assert hints[2].stopped_earlier_s == 30.0
    assert hints[1].in_collective is False


def test_culprit_hints_without_stacks_order_by_step_then_time() -> None:
    ranks = {r: feed([(NOW - t, b(50, rank=r))]) for r, t in [(0, 5.0), (1, 9.0), (2, 7.0)]}
    assert [h.rank for h in culprit_hints(ranks, ranks)] == [1, 2, 0]
    assert culprit_hints(ranks, []) == []


def test_hang_module_imports_nothing_that_touches_the_os_or_the_clock() -> None:
    import ast
    from pathlib import Path

    import agent.node.hang

    tree = ast.parse(Path(agent.node.hang.__file__).read_text())
    roots = {
        name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        )
    }
    assert not roots & {"time", "os", "socket", "subprocess", "psutil", "sqlite3", "shutil"}


# --- busy ranks ------------------------------------------------------------------------


def test_busy_share_is_the_core_share_over_the_last_few_seconds() -> None:
    assert busy_share([]) is None
    assert busy_share([(0.0, 1.0), (2.0, 3.0)]) is None  # under the 3 s window
    assert busy_share([(0.0, 1.0), (1.0, 1.0), (4.0, 4.0)]) == 1.0  # the newest 3 s span
    assert busy_share([(0.0, 1.0), (4.0, 4.0)]) == 0.75
    assert busy_share([(0.0, 5.0), (4.0, 5.0)]) == 0.0


def test_a_verdicts_rank_computes_while_busy_outside_a_collective_short_of_the_busy_floor() -> None:
    def verdict(rank: int, since_s: float) -> HangVerdict:
        return HangVerdict(rank, 3, Phase.TRAIN, since_s, 20.0, HangReason.FLOOR, "")

    verdicts = [verdict(0, 30.0), verdict(1, 30.0), verdict(2, 61.0), verdict(3, 30.0)]
    shares = {0: 0.9, 1: 0.01, 2: 0.9, 3: 0.9}
    placed = {3: True}  # waits in a collective: NCCL may spin there
    assert computing(verdicts, shares, placed, CONFIG) == {0}
