"""Checkpoint schedule: pure due/record logic, the collective decision, the interval source."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from agent.train.schedule import (
    ENV_EVERY_STEPS,
    ENV_INTERVAL_FILE,
    ENV_INTERVAL_S,
    CheckpointInterval,
    CheckpointSchedule,
    IntervalSource,
    broadcast_from_rank0,
    due_on_all_ranks,
    format_override,
    parse_override,
)
from agent.wire.errors import ConfigError

NOW = 1000.0


def _schedule(seconds: float | None = None, steps: int | None = None) -> CheckpointSchedule:
    return CheckpointSchedule(CheckpointInterval(seconds, steps), start_step=100, start_s=NOW)


@pytest.mark.parametrize(
    ("seconds", "steps", "step", "now", "due"),
    [
        (60.0, None, 101, NOW + 59.9, False),
        (60.0, None, 101, NOW + 60.0, True),
        (None, 10, 109, NOW + 1e6, False),
        (None, 10, 110, NOW, True),
        (60.0, 10, 105, NOW + 61, True),
        (60.0, 10, 110, NOW + 1, True),
        (None, None, 10_000, NOW + 1e9, False),
        # At or before the start (resume) step: never, however late.
        (60.0, 1, 100, NOW + 1e6, False),
        (60.0, 1, 99, NOW + 1e6, False),
    ],
)
def test_due_after_either_criterion_and_never_at_or_before_the_last_save(
    seconds: float | None, steps: int | None, step: int, now: float, due: bool
) -> None:
    assert _schedule(seconds, steps).due(step, now) is due


def test_record_save_restarts_both_clocks() -> None:
    schedule = _schedule(60.0, 10)
    schedule.record_save(105, NOW + 30)
    assert not schedule.due(114, NOW + 89)
    assert schedule.due(115, NOW + 89)
    assert schedule.due(106, NOW + 90)
    assert not schedule.due(105, NOW + 1e6)


def test_shortening_the_interval_counts_from_the_last_save() -> None:
    schedule = _schedule(3600.0)
    assert not schedule.due(200, NOW + 700)
    schedule.set_interval_s(600.0)
    assert schedule.due(200, NOW + 700)
    schedule.record_save(200, NOW + 700)
    assert not schedule.due(201, NOW + 1299)
    assert schedule.interval == CheckpointInterval(600.0, None)


@pytest.mark.parametrize(
    ("seconds", "steps"), [(0.0, None), (-1.0, None), (float("inf"), None), (None, 0), (None, 1.5)]
)
def test_invalid_intervals_are_refused(seconds: float | None, steps: int | None) -> None:
    with pytest.raises(ValueError, match="interval"):
        CheckpointInterval(seconds, steps)  # type: ignore[arg-type]


def test_only_rank_0_decides_and_every_rank_gets_its_answer() -> None:
    early = _schedule(60.0)  # rank 0's clock says not yet
    late = _schedule(1.0)  # another rank's would say due
    sent: list[bool] = []

    def broadcast(flag: bool) -> bool:
        sent.append(flag)
        return sent[0]  # what rank 0 put in

    answers = [
        due_on_all_ranks(schedule, 101, NOW + 30, rank=rank, broadcast=broadcast)
        for rank, schedule in enumerate([early, late, late])
    ]
    assert answers == [False, False, False]
    assert sent == [False, False, False]


def test_checking_every_k_steps_skips_the_collective_on_the_same_steps_everywhere() -> None:
    calls: list[int] = []

    def broadcast(flag: bool) -> bool:
        calls.append(1)
        return flag

    schedule = _schedule(steps=1)
    due = [
        due_on_all_ranks(schedule, step, NOW, rank=0, broadcast=broadcast, check_every_steps=5)
        for step in range(101, 111)
    ]
    assert due == [False] * 4 + [True] + [False] * 4 + [True]
    assert len(calls) == 2


def test_broadcast_without_a_process_group_returns_the_local_flag() -> None:
    assert not dist.is_initialized()
    assert broadcast_from_rank0(True) is True
    assert broadcast_from_rank0(False) is False


def test_broadcast_with_a_gloo_group_returns_rank_0s_flag(tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        assert broadcast_from_rank0(True) is True
        assert broadcast_from_rank0(False) is False
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("environ", "interval"),
    [
        ({}, CheckpointInterval()),
        ({ENV_INTERVAL_S: "1800"}, CheckpointInterval(1800.0)),
        ({ENV_INTERVAL_S: " 90.5 ", ENV_EVERY_STEPS: "500"}, CheckpointInterval(90.5, 500)),
        ({ENV_INTERVAL_S: "", ENV_EVERY_STEPS: ""}, CheckpointInterval()),
    ],
)
def test_environment_sets_the_initial_interval(
    environ: dict[str, str], interval: CheckpointInterval
) -> None:
    assert IntervalSource(environ).current() == interval


@pytest.mark.parametrize(
    ("name", "value"),
    [
        (ENV_INTERVAL_S, "abc"),
        (ENV_INTERVAL_S, "0"),
        (ENV_INTERVAL_S, "-5"),
        (ENV_INTERVAL_S, "nan"),
        (ENV_EVERY_STEPS, "0"),
        (ENV_EVERY_STEPS, "2.5"),
        (ENV_EVERY_STEPS, "many"),
    ],
)
def test_bad_environment_values_raise_config_error_naming_the_variable(
    name: str, value: str
) -> None:
    with pytest.raises(ConfigError, match=rf"{name}=.*e\.g\. {name}="):
        IntervalSource({name: value})


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _write(path: Path, text: str, mtime_ns: int) -> None:
    # Write-then-rename, as the node agent does; an explicit mtime makes the
    # test independent of the filesystem's timestamp granularity.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.utime(tmp, ns=(mtime_ns, mtime_ns))
    tmp.replace(path)


def test_override_file_is_followed_at_most_once_per_poll_period(tmp_path: Path) -> None:
    path, clock = tmp_path / "interval.json", _Clock()
    source = IntervalSource(
        {ENV_INTERVAL_S: "1800", ENV_EVERY_STEPS: "1000", ENV_INTERVAL_FILE: str(path)},
        poll_period_s=10.0,
        clock=clock,
    )
    assert source.path == path
    assert source.current() == CheckpointInterval(1800.0, 1000)  # no file yet

    _write(path, format_override(CheckpointInterval(600.0, None)), 1)
    clock.now = 5.0
    assert source.current() == CheckpointInterval(1800.0, 1000)  # within the period
    clock.now = 10.0
    assert source.current() == CheckpointInterval(600.0, None)

    _write(path, '{"interval_s": 300}', 2)
    clock.now = 20.0
    # A missing key keeps the environment's value.
    assert source.current() == CheckpointInterval(300.0, 1000)


def test_malformed_override_is_logged_once_and_the_last_good_value_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, clock = tmp_path / "interval.json", _Clock()
    source = IntervalSource(
        {ENV_INTERVAL_S: "1800", ENV_INTERVAL_FILE: str(path)}, poll_period_s=1.0, clock=clock
    )
    _write(path, '{"interval_s": 600}', 1)
    assert source.current() == CheckpointInterval(600.0)

    _write(path, '{"interval_s": -3}', 2)
    with caplog.at_level(logging.WARNING, logger="agent.train.schedule"):
        for tick in range(1, 6):
            clock.now = float(tick)
            assert source.current() == CheckpointInterval(600.0)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "ignoring checkpoint interval override" in warnings[0].getMessage()

    path.unlink()
    clock.now = 10.0
    assert source.current() == CheckpointInterval(600.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not JSON"),
        ("[600]", "JSON object"),
        ('{"interval_s": 600, "every": 3}', "unknown key"),
        ('{"interval_s": "600"}', "positive number"),
        ('{"every_steps": 0}', "steps"),
    ],
)
def test_parse_override_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_override(text, CheckpointInterval(1800.0))


def test_format_and_parse_override_round_trip_including_switching_off() -> None:
    for interval in (CheckpointInterval(1530.9, None), CheckpointInterval(None, 50)):
        assert parse_override(format_override(interval), CheckpointInterval(1.0, 2)) == interval
