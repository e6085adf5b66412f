"""`resurgo ckpt validate | newest | list`: output and exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.checkpoint import format as fmt
from agent.checkpoint.catalog import list_checkpoints
from agent.checkpoint.storage import FsKind, filesystem_of
from agent.checkpoint.validate import PLAIN_DCP_NOTE, Level, validate
from supervisor.cli import ckpt
from supervisor.cli.main import main
from tests.ckpt_helpers import data_files, make_committed_checkpoint, save_plain_dcp, small_state

RESURGO = Path(sys.executable).with_name("resurgo")
STATS = fmt.SaveStats(
    stall_s=0.25, write_s=2.0, total_bytes=8 << 20, filesystem="nfs", mode="async"
)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["ckpt", *argv])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """Steps 1 and 2 committed and valid; step 3 committed with a truncated shard."""
    make_committed_checkpoint(tmp_path, 1, stats=STATS)
    make_committed_checkpoint(tmp_path, 2)
    broken = make_committed_checkpoint(tmp_path, 3)
    shard = data_files(broken)[0]
    os.truncate(shard, shard.stat().st_size // 2)
    return tmp_path


def test_validate_valid_checkpoint_exits_0(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "validate", str(root / "step-2"), "--level", "load")
    assert status == 0
    assert out.startswith("valid: ") and "quick, full, load" in out


def test_validate_invalid_checkpoint_exits_1_and_prints_the_reason(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, "validate", str(root / "step-3"), "--level", "quick")
    assert status == 1
    assert out.startswith("invalid at quick: step-3: ")
    assert "truncated" in out


def test_validate_json_is_the_report(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "validate", str(root / "step-3"), "--json")
    document = json.loads(out)
    assert status == 1
    assert document["valid"] is False and document["failed_level"] == "quick"
    assert document["level"] == "full" and document["step"] == 3
    assert set(document) == {
        "path", "valid", "level", "checked", "failed_level", "reason", "step",
        "has_manifest", "skipped",
    }  # fmt: skip


def test_validate_plain_dcp_prints_what_was_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = save_plain_dcp(tmp_path / "step-5", small_state(5))
    status, out, _ = _run(capsys, "validate", str(directory))
    assert status == 0
    assert "note: no Resurgo manifest: checksums not checked" in out


def test_validate_missing_checkpoint_is_a_usage_error_saying_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _run(capsys, "validate", str(tmp_path / "nope"))
    assert status == 2 and out == ""
    assert "does not exist: pass one checkpoint (a step-N/ or checkpoint-N/ directory" in err
    (tmp_path / "notes.txt").write_text("x")
    status, out, _ = _run(capsys, "validate", str(tmp_path / "notes.txt"))
    assert status == 1 and "not a checkpoint of any known layout" in out


def test_newest_prints_the_path_and_each_newer_rejection(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _run(capsys, "newest", str(root), "--level", "quick")
    assert status == 0
    assert out == f"{root / 'step-2'}\n"
    assert err.startswith("rejected: invalid at quick: step-3: ")


def test_newest_json_lists_rejections_newest_first(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (root / "step-2" / fmt.MARKER_NAME).unlink()
    status, out, _ = _run(capsys, "newest", str(root), "--json")
    document = json.loads(out)
    assert status == 0
    assert document["newest"]["step"] == 1
    assert [report["step"] for report in document["rejected"]] == [3, 2]


def test_newest_exits_1_when_nothing_is_valid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = _run(capsys, "newest", str(tmp_path))
    assert status == 1 and out == ""
    assert "no valid checkpoint" in err


def test_list_shows_a_row_per_checkpoint_with_save_stats(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = _run(capsys, "list", str(root))
    lines = out.splitlines()
    assert status == 0
    assert lines[0].split() == [
        "CHECKPOINT", "LAYOUT", "STEP", "COMMITTED", "VALID(full)", "SIZE", "AGE", "STALL",
        "WRITE", "THROUGHPUT", "WHY",
    ]  # fmt: skip
    assert [line.split()[:5] for line in lines[1:4]] == [
        ["step-3", "resurgo", "3", "yes", "NO"], ["step-2", "resurgo", "2", "yes", "yes"],
        ["step-1", "resurgo", "1", "yes", "unchecked"],
    ]  # fmt: skip
    assert "truncated" in lines[1]
    assert lines[3].split()[-7:] == ["250", "ms", "2", "s", "4.19", "MB/s", "-"]
    assert lines[4].startswith("newest valid at full: step-2")
    assert lines[5].startswith("unchecked: ")
    assert lines[6] == f"filesystem: {filesystem_of(root).value}"
    assert len(lines) == 7  # a local filesystem: no storage warning


def test_list_calls_a_checkpoint_with_flipped_bytes_invalid_as_newest_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A quick check cannot see changed bytes; the default list checks as `newest` does."""
    make_committed_checkpoint(tmp_path, 1)
    shard = data_files(make_committed_checkpoint(tmp_path, 2))[0]
    data = bytearray(shard.read_bytes())
    data[100:104] = bytes(byte ^ 0xFF for byte in data[100:104])
    shard.write_bytes(bytes(data))
    _, out, _ = _run(capsys, "list", str(tmp_path))
    step_2, step_1 = out.splitlines()[1:3]
    assert step_2.split()[4] == "NO" and "checksum" in step_2 and str(tmp_path) not in step_2
    assert step_1.split()[4] == "yes"
    _, newest, _ = _run(capsys, "newest", str(tmp_path))
    assert newest.strip() == str(tmp_path / "step-1")
    _, out, _ = _run(capsys, "list", str(tmp_path), "--level", "quick")
    assert [line.split()[4] for line in out.splitlines()[1:3]] == ["yes", "yes"]


def test_list_warns_when_many_ranks_wrote_shards_to_nfs(tmp_path: Path) -> None:
    stats = fmt.SaveStats(
        stall_s=0.1, write_s=4.0, total_bytes=40_000_000, filesystem="nfs", mode="async"
    )
    make_committed_checkpoint(tmp_path, 5, stats=stats, world_size=16)
    reports = [(entry, validate(entry.path, Level.QUICK)) for entry in list_checkpoints(tmp_path)]
    [warning] = ckpt._storage_warnings(FsKind.NFS, reports)
    assert "16 ranks" in warning and "10.0 MB/s" in warning and "Lustre" in warning
    assert ckpt._storage_warnings(FsKind.LUSTRE, reports) == []


def test_list_json_rows_carry_throughput(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = _run(capsys, "list", str(root), "--json")
    rows = json.loads(out)["checkpoints"]
    assert status == 0
    assert [row["step"] for row in rows] == [3, 2, 1]
    assert rows[0]["valid_quick"] is False and rows[0]["quick_reason"]
    assert [row["valid"] for row in rows] == [False, True, None]
    assert [row["newest_valid"] for row in rows] == [False, True, False]
    assert rows[2]["stats"]["throughput_bytes_per_s"] == (8 << 20) / 2.0
    assert rows[1]["stats"] is None


def test_cli_level_names_are_the_validation_levels() -> None:
    assert tuple(level.value for level in Level) == ckpt.LEVELS


def test_resurgo_help_does_not_import_torch() -> None:
    probe = "import sys; from supervisor.cli import main; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "False"


def test_ckpt_without_a_command_names_the_commands_and_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["ckpt"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "validate" in err.splitlines()[-1]


def test_installed_resurgo_validate_exit_codes(root: Path, tmp_path: Path) -> None:
    def exit_code(path: Path) -> int:
        return subprocess.run(
            [str(RESURGO), "ckpt", "validate", "--level", "quick", str(path)],
            capture_output=True,
            check=False,
            timeout=120,
        ).returncode

    assert [exit_code(root / "step-2"), exit_code(root / "step-3"), exit_code(root / "no")] == [
        0,
        1,
        2,
    ]


def _own_checkpoints(out: Path) -> tuple[Path, Path]:
    """A script's own checkpoints: an older good one, and a newer one cut short."""
    import torch

    good, cut = out / "ckpt-old.pt", out / "ckpt.pt"
    torch.save({"model": {"w": torch.ones(256)}, "iter_num": 30}, good)
    torch.save({"model": {"w": torch.ones(256)}, "iter_num": 40}, cut)
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    os.utime(good, (1_700_000_000, 1_700_000_000))
    os.utime(cut, (1_700_000_100, 1_700_000_100))
    return good, cut


def test_newest_picks_the_scripts_own_older_file_and_says_why_the_newer_one_is_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good, cut = _own_checkpoints(tmp_path)
    code, out, err = _run(capsys, "newest", str(tmp_path))
    assert (code, out.strip()) == (0, str(good))
    # Cut short, its step cannot be read: being the newer file, it is tried (and refused) first.
    assert "rejected: invalid at quick: ckpt.pt: not a whole zip archive" in err
    code, out, _ = _run(capsys, "newest", str(tmp_path), "--json", "--level", "load")
    document = json.loads(out)
    assert document["newest"]["step"] == 30 and document["newest"]["checked"] == [
        "quick", "full", "load",
    ]  # fmt: skip
    assert [bad["path"] for bad in document["rejected"]] == [str(cut)]


def test_list_shows_the_scripts_own_files_with_their_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _own_checkpoints(tmp_path)
    code, out, _ = _run(capsys, "list", str(tmp_path))
    rows = [line.split()[:5] for line in out.splitlines()[1:3]]
    assert code == 0 and rows == [
        ["ckpt.pt", "torch_save", "?", "no", "NO"],
        ["ckpt-old.pt", "torch_save", "30", "yes", "yes"],
    ]  # fmt: skip


def test_a_file_still_being_written_and_an_empty_one_are_rejected_in_plain_words(
    tmp_path: Path,
) -> None:
    from agent.checkpoint import layouts

    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "fresh.pt").write_bytes(b"x" * 10)  # legacy format: no zip end to look for
    assert "empty" in str(layouts.check(tmp_path / "empty.pt", Level.LOAD).reason)
    fresh = layouts.check(tmp_path / "fresh.pt", Level.LOAD)
    assert not fresh.valid and "still be writing" in str(fresh.reason)


def test_a_scripts_own_dcp_step_directories_are_listed_as_plain_and_the_newest_complete_wins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script's own ``dcp.save`` into ``step-N`` (no manifest, no marker): checked at the
    levels that apply; one without ``.metadata`` is a save that never finished."""
    save_plain_dcp(tmp_path / "step-10", small_state(10))
    unfinished = save_plain_dcp(tmp_path / "step-20", small_state(20))
    (unfinished / fmt.DCP_METADATA_NAME).unlink()
    status, out, err = _run(capsys, "newest", str(tmp_path), "--level", "load")
    assert status == 0 and out.strip() == str(tmp_path / "step-10")
    assert "rejected: invalid at quick: step-20" in err
    status, out, _ = _run(capsys, "newest", str(tmp_path), "--json")
    newest = json.loads(out)["newest"]
    assert newest["step"] == 10 and newest["checked"] == ["quick"], newest
    assert newest["has_manifest"] is False and PLAIN_DCP_NOTE in newest["skipped"]
    status, out, _ = _run(capsys, "list", str(tmp_path))
    assert [line.split()[:5] for line in out.splitlines()[1:3]] == [
        ["step-20", "dcp", "20", "no", "NO"], ["step-10", "dcp", "10", "plain", "yes"],
    ]  # fmt: skip
    _, out, _ = _run(capsys, "list", str(tmp_path), "--json")
    rows = json.loads(out)["checkpoints"]
    assert [(r["step"], r["committed"], r["has_manifest"]) for r in rows] == [
        (20, False, False), (10, False, False),
    ]  # fmt: skip
