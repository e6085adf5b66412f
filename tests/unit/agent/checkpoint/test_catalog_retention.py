"""Listing checkpoints, picking the newest valid one, and deciding what to delete."""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from pathlib import Path

import pytest

from agent.checkpoint import format as fmt
from agent.checkpoint.catalog import (
    list_checkpoints,
    newest_committed_step,
    newest_valid,
    step_being_written,
    supersede_newer,
)
from agent.checkpoint.retention import (
    Candidate,
    DeleteReason,
    RetentionPolicy,
    apply_retention,
    plan_retention,
)
from agent.checkpoint.validate import Level
from agent.wire.errors import ConfigError
from tests.ckpt_helpers import make_committed_checkpoint, save_plain_dcp, small_state

NOW = 1_000_000.0
GRACE_S = 600.0
OLD = NOW - 10 * GRACE_S
FRESH = NOW - 10.0
STATS = fmt.SaveStats(
    stall_s=0.5, write_s=2.0, total_bytes=4 << 20, filesystem="lustre", mode="async"
)


def _valid(step: int) -> Candidate:
    return Candidate(step=step, path=f"step-{step}", valid=True, mtime_s=OLD)


def _invalid(step: int, mtime_s: float = OLD) -> Candidate:
    return Candidate(step=step, path=f"step-{step}", valid=False, mtime_s=mtime_s)


RETENTION_TABLE = [
    # (name, candidates, keep_last, keep_every, in_flight_step, deleted steps)
    ("keeps the last three valid", [_valid(s) for s in range(1, 6)], 3, None, None, [2, 1]),
    ("keeps permanent ones every 4 steps",
     [_valid(s) for s in range(1, 11)], 3, 4, None, [7, 6, 5, 3, 2, 1]),
    ("deletes an old invalid one past grace and never counts it",
     [_valid(1), _valid(2), _valid(3), _invalid(4), _valid(5)], 3, None, None, [4, 1]),
    ("keeps an old invalid one within grace",
     [_valid(1), _valid(2), _valid(3), _invalid(4, FRESH), _valid(5)], 3, None, None, [1]),
    ("never touches an uncommitted one newer than the newest valid",
     [_valid(1), _valid(2), _valid(3), _invalid(4)], 3, None, None, []),
    ("deletes nothing when nothing is valid",
     [_invalid(1), _invalid(2)], 3, None, None, []),
    ("deletes nothing newer than the oldest kept while a save is in flight",
     [_valid(1), _valid(2), _invalid(3), _valid(4), _valid(5)], 3, None, 6, [1]),
    ("still deletes an invalid one older than the kept while a save is in flight",
     [_invalid(1), _valid(2), _valid(3), _valid(4), _valid(5)], 3, None, 6, [2, 1]),
    ("never deletes the in-flight directory itself",
     [_invalid(2), _valid(5), _valid(6), _valid(7)], 3, None, 2, []),
    ("keep_last 1 keeps only the newest valid",
     [_valid(1), _valid(2), _invalid(3)], 1, None, None, [1]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("candidates", "keep_last", "keep_every", "in_flight_step", "deleted"),
    [pytest.param(*row[1:], id=row[0]) for row in RETENTION_TABLE],
)
def test_plan_retention_table(
    candidates: list[Candidate],
    keep_last: int,
    keep_every: int | None,
    in_flight_step: int | None,
    deleted: list[int],
) -> None:
    plan = plan_retention(
        candidates,
        keep_last=keep_last,
        keep_every=keep_every,
        grace_s=GRACE_S,
        now_s=NOW,
        in_flight_step=in_flight_step,
    )
    assert [deletion.step for deletion in plan] == deleted
    by_step = {candidate.step: candidate for candidate in candidates}
    for deletion in plan:
        expected = (
            DeleteReason.BEYOND_KEEP_LAST
            if by_step[deletion.step].valid
            else DeleteReason.INVALID_PAST_GRACE
        )
        assert deletion.reason is expected and deletion.detail


def test_plan_retention_never_deletes_the_newest_valid_whatever_the_order_given() -> None:
    candidates = [_valid(9), _invalid(3), _valid(7), _valid(1)]
    plan = plan_retention(candidates, keep_last=1, grace_s=0.0, now_s=NOW)
    assert 9 not in [deletion.step for deletion in plan]
    assert [deletion.step for deletion in plan] == [7, 3, 1]


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": True}, "keep_last"),
        ({"keep_every_steps": 0}, "keep_every_steps"),
        ({"grace_s": -1.0}, "grace_s"),
        ({"grace_s": math.nan}, "grace_s"),
    ],
)
def test_retention_policy_rejects_bad_values_naming_the_field(
    settings: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError, match=field):
        RetentionPolicy(**settings)  # type: ignore[arg-type]


def test_after_ten_saves_with_keep_three_and_permanent_every_four_exactly_four_remain(
    tmp_path: Path,
) -> None:
    policy = RetentionPolicy(keep_last=3, keep_every_steps=4, grace_s=GRACE_S)
    for step in range(1, 11):
        make_committed_checkpoint(tmp_path, step, {"w": small_state(step)["model"]["w"]})
        apply_retention(tmp_path, policy, now_s=time.time(), in_flight_step=None)
    in_flight = save_plain_dcp(tmp_path / "step-11", {"w": small_state(11)["model"]["w"]})
    (in_flight / fmt.DCP_METADATA_NAME).rename(in_flight / fmt.DCP_METADATA_TMP_NAME)
    # Long past the grace period: the in-flight save is still newer than every valid one.
    apply_retention(tmp_path, policy, now_s=time.time() + 10 * GRACE_S, in_flight_step=11)
    assert sorted(entry.step for entry in list_checkpoints(tmp_path)) == [4, 8, 9, 10, 11]


def test_apply_retention_logs_a_failed_delete_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for step in range(1, 6):
        make_committed_checkpoint(tmp_path, step, {"w": small_state(step)["model"]["w"]})
    real_rmtree = shutil.rmtree

    def flaky_rmtree(path: str | os.PathLike[str]) -> None:
        if Path(path).name == "step-2":
            raise PermissionError(13, "Permission denied", str(path))
        real_rmtree(path)

    monkeypatch.setattr(shutil, "rmtree", flaky_rmtree)
    with caplog.at_level(logging.WARNING):
        deleted = apply_retention(tmp_path, RetentionPolicy(), now_s=NOW)
    assert [deletion.step for deletion in deleted] == [1]
    assert "step-2" in caplog.text
    assert sorted(entry.step for entry in list_checkpoints(tmp_path)) == [2, 3, 4, 5]


def test_list_checkpoints_orders_by_step_number_and_ignores_other_names(tmp_path: Path) -> None:
    make_committed_checkpoint(tmp_path, 9, stats=STATS)
    make_committed_checkpoint(tmp_path, 10)
    save_plain_dcp(tmp_path / "step-11", {"w": small_state(0)["model"]["w"]})
    for other in ("latest", "step-x", "step-3.tmp", "step--1"):
        (tmp_path / other).mkdir()
    (tmp_path / "step-12").write_text("a file, not a checkpoint")

    entries = list_checkpoints(tmp_path)
    assert [entry.step for entry in entries] == [11, 10, 9]
    assert [entry.committed for entry in entries] == [False, True, True]
    assert entries[2].stats == STATS and entries[1].stats is None
    nine = tmp_path / "step-9"
    assert entries[2].total_bytes == sum(child.stat().st_size for child in nine.iterdir())
    assert entries[2].mtime_s >= (nine / fmt.MARKER_NAME).stat().st_mtime


def test_list_checkpoints_of_a_missing_root_is_empty(tmp_path: Path) -> None:
    assert list_checkpoints(tmp_path / "not-yet") == []


def test_newest_valid_skips_a_newer_save_in_flight_and_says_why(tmp_path: Path) -> None:
    make_committed_checkpoint(tmp_path, 1)
    in_flight = save_plain_dcp(tmp_path / "step-2", small_state(2))
    (in_flight / fmt.DCP_METADATA_NAME).rename(in_flight / fmt.DCP_METADATA_TMP_NAME)
    found, rejected = newest_valid(tmp_path, Level.FULL)
    assert found is not None and found.step == 1
    assert len(rejected) == 1 and rejected[0].step == 2
    assert rejected[0].reason is not None and ".metadata.tmp" in rejected[0].reason


def test_newest_valid_with_nothing_valid_returns_none_and_every_rejection(
    tmp_path: Path,
) -> None:
    for step in (1, 2):
        (make_committed_checkpoint(tmp_path, step) / fmt.MARKER_NAME).unlink()
    found, rejected = newest_valid(tmp_path, Level.QUICK)
    assert found is None
    assert [report.step for report in rejected] == [2, 1]


def test_resuming_moves_newer_checkpoints_aside_and_keeps_older_ones(tmp_path: Path) -> None:
    for step in (4, 8, 12):
        make_committed_checkpoint(tmp_path, step)
    (tmp_path / "step-16").mkdir()  # an uncommitted leftover counts too

    moved = supersede_newer(tmp_path, 8, now_unix_s=1_700_000_000)

    assert sorted(path.name for path in moved) == [
        "step-12.superseded-1700000000",
        "step-16.superseded-1700000000",
    ]
    assert [entry.step for entry in list_checkpoints(tmp_path)] == [8, 4]
    assert (tmp_path / "step-12.superseded-1700000000" / fmt.MARKER_NAME).exists()
    make_committed_checkpoint(tmp_path, 12)  # the continuation saves there again
    assert supersede_newer(tmp_path, 12, now_unix_s=1_700_000_000) == []
    make_committed_checkpoint(tmp_path, 16)
    moved = supersede_newer(tmp_path, 12, now_unix_s=1_700_000_000)
    assert [path.name for path in moved] == ["step-16.superseded-1700000000-1"]


def test_the_newest_step_being_written_is_told_from_the_newest_committed(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert step_being_written(root) is None and newest_committed_step(root) is None
    make_committed_checkpoint(root, 100)
    assert step_being_written(root) is None and newest_committed_step(root) == 100
    (root / "step-200").mkdir()  # a save under way: no marker yet
    (root / "step-150.aborted-123").mkdir()  # set aside: no step directory
    assert step_being_written(root) == root / "step-200"
    assert newest_committed_step(root) == 100
    committed = make_committed_checkpoint(tmp_path / "other", 200)
    (root / "step-200").rmdir()
    shutil.copytree(committed, root / "step-200")
    assert step_being_written(root) is None and newest_committed_step(root) == 200
