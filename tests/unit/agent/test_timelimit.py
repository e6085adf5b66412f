"""The planned stop's pure parts and files: the warning's lead, Slurm durations, the notice,
the save request, and the rank's decision to save on request."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.stopfiles import (
    SaveRequest,
    clear_notice,
    clear_save_request,
    held_ranks,
    notice_path,
    read_notice,
    write_notice,
    write_save_request,
)
from agent.timelimit import (
    MIN_LEAD_S,
    STOPPED_BEFORE_END_S,
    Notice,
    parse_slurm_duration,
    stop_grace_s,
    warning_lead_s,
)
from agent.train.schedule import CheckpointInterval, CheckpointSchedule, due_on_all_ranks
from supervisor.sbatch import parse_request, supervision_options


@pytest.mark.parametrize(
    ("limit_s", "save_s", "lead_s"),
    [
        (None, None, 180.0),  # unknown limit: two default saves + grace + requeue
        (86400.0, None, 180.0),  # a day: the same
        (86400.0, 300.0, 660.0),  # a slow save (5 min) moves the warning earlier
        (180.0, None, 45.0),  # a 3-minute job: a quarter of it, never "at second 4"
        (60.0, None, 15.0),  # one minute: 15 s
        (20.0, None, MIN_LEAD_S),  # never under the floor
        (86400.0, float("nan"), 180.0),  # a broken measurement counts as none
    ],
)
def test_the_warning_lead_scales_with_the_limit_and_the_measured_save(
    limit_s: float | None, save_s: float | None, lead_s: float
) -> None:
    assert warning_lead_s(limit_s, save_s, stop_grace_s=30.0) == lead_s


def test_a_requested_lead_wins_but_stays_inside_the_limit() -> None:
    assert warning_lead_s(3600.0, 10.0, requested_s=900.0) == 900.0
    assert warning_lead_s(600.0, 10.0, requested_s=900.0) == 300.0  # at most half the limit


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1", 60.0),
        ("1:30", 90.0),
        ("2:00:00", 7200.0),
        ("1-00:00:00", 86400.0),
        ("2-12", 2 * 86400.0 + 12 * 3600.0),
        ("1-02:30", 86400.0 + 2 * 3600.0 + 30 * 60.0),
        ("0:07", 7.0),
        ("UNLIMITED", None),
        ("INVALID", None),
        ("", None),
        ("1:2:3:4", None),
    ],
)
def test_slurm_durations_are_read_in_every_form_squeue_prints(
    text: str, seconds: float | None
) -> None:
    assert parse_slurm_duration(text) == seconds


def test_submit_warns_a_short_job_a_quarter_of_its_limit_before_the_end() -> None:
    assert "--signal=B:USR1@45" in supervision_options(parse_request(["--time=3"]))
    assert "--signal=B:USR1@180" in supervision_options(parse_request([]))
    own = parse_request(["--signal=B:USR1@300"])
    assert own.signal_lead_s == 300.0
    assert not any(o.startswith("--signal") for o in supervision_options(own))


def test_the_notice_round_trips_and_a_broken_one_reads_as_none(tmp_path: Path) -> None:
    notice = Notice(attempt=3, warned_unix_s=100.0, save_by_unix_s=130.0, end_unix_s=160.0)
    write_notice(tmp_path, notice)
    assert read_notice(notice_path(tmp_path)) == notice
    notice_path(tmp_path).write_text('{"attempt": true, "warned_unix_s": 1}')
    assert read_notice(notice_path(tmp_path)) is None
    clear_notice(tmp_path)
    clear_notice(tmp_path)  # twice: nothing left is no error
    assert read_notice(notice_path(tmp_path)) is None


def test_a_save_request_is_pending_once_per_id(tmp_path: Path) -> None:
    path = tmp_path / "save-request.json"
    request = SaveRequest(str(path), poll_s=1.0)
    assert not request.pending(0.0)  # no file yet
    write_save_request(path, 7)
    assert not request.pending(0.5)  # not polled again within the period
    assert request.pending(1.0)
    request.honoured()
    assert not request.pending(2.0)
    write_save_request(path, 8)
    os.utime(path, ns=(1, 1))  # a rewrite within one mtime tick is still a change (size)
    assert request.pending(3.0)


def test_without_a_request_file_nothing_is_ever_requested() -> None:
    request = SaveRequest.from_env({})
    assert not request.pending(0.0)


def test_rank_zeros_request_makes_a_save_due_off_schedule() -> None:
    schedule = CheckpointSchedule(CheckpointInterval(steps=50), start_step=0, start_s=0.0)
    shared: list[bool] = []

    def broadcast(flag: bool) -> bool:
        shared.append(flag)
        return flag

    assert not due_on_all_ranks(schedule, 7, 1.0, rank=0, broadcast=broadcast)
    assert due_on_all_ranks(schedule, 7, 1.0, rank=0, broadcast=broadcast, force=True)
    # Another rank's own flag is never what is shared: rank 0 decides.
    assert not due_on_all_ranks(schedule, 7, 1.0, rank=1, broadcast=broadcast, force=True)
    assert shared == [False, True, False]


def test_ranks_holding_after_the_final_save_are_seen_and_cleared_with_the_request(
    tmp_path: Path,
) -> None:
    path = tmp_path / "save-request.json"
    write_save_request(path, 1)
    request = SaveRequest(str(path))
    request.mark_held(0)
    request.mark_held(3)
    (tmp_path / "save-request.json.held.x").touch()  # not a rank: ignored
    assert held_ranks(path) == {0, 3}
    clear_save_request(path)
    assert held_ranks(path) == set() and not path.exists()


def test_the_stop_at_a_time_limit_ends_well_before_it_whatever_the_configured_grace() -> None:
    """A one-minute job is warned 15 s before its end; Lightning handles SIGTERM and keeps
    going, so a 30 s grace would outlive the allocation (the driver then requeues the job
    itself and the stop reads as Slurm's). The grace ends 10 s before the end."""
    notice = Notice(attempt=1, warned_unix_s=100.0, save_by_unix_s=107.5, end_unix_s=115.0)
    assert stop_grace_s(notice, 100.0, 30.0) == 15.0 - STOPPED_BEFORE_END_S
    assert stop_grace_s(notice, 100.0, 3.0) == 3.0  # a shorter one stands
    assert stop_grace_s(notice, 114.0, 30.0) == 1.0  # late: a second, then SIGKILL
