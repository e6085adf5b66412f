"""Checkpointer with real ranks: torchrun, gloo, CPU (no Slurm).

The behaviours that need a process group run in ONE torchrun launch of
tests/workers/save_worker.py (torch start-up per rank dominates the cost); the
tests below assert on what each rank reported and on the files it left.
The crash tests launch their own jobs and kill them mid-write.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint import files
from agent.checkpoint import format as fmt
from agent.checkpoint.catalog import list_checkpoints, newest_valid
from agent.checkpoint.validate import Level, validate

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "workers" / "save_worker.py"
RANKS = 2
LAUNCH_TIMEOUT_S = 120.0


def _torchrun(*args: str, **popen: Any) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={RANKS}",
        str(WORKER),
        *args,
    ]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **popen)


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Run the suite scenario once; return the checkpoint root and each rank's report."""
    base = tmp_path_factory.mktemp("async_save")
    root, out = base / "root", base / "out"
    out.mkdir()
    job = _torchrun("suite", str(root), str(out))
    output, _ = job.communicate(timeout=LAUNCH_TIMEOUT_S)
    assert job.returncode == 0, output.decode(errors="replace")[-4000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(RANKS)]
    return root, reports


def _assert_committed(path: Path) -> fmt.Manifest:
    """The directory is committed and its manifest lists exactly its files, with true checksums."""
    manifest_data = (path / fmt.MANIFEST_NAME).read_bytes()
    fmt.check_marker((path / fmt.MARKER_NAME).read_bytes(), manifest_data)
    manifest = fmt.manifest_from_bytes(manifest_data)
    on_disk = set(os.listdir(path)) - {fmt.MANIFEST_NAME, fmt.MARKER_NAME}
    assert {entry.path for entry in manifest.files} == on_disk
    for entry in manifest.files:
        assert files.checksum_file(path / entry.path) == (entry.bytes, entry.checksum)
    assert validate(path, Level.LOAD).valid
    return manifest


def _assert_not_committed(path: Path) -> None:
    marker = path / fmt.MARKER_NAME
    manifest = path / fmt.MANIFEST_NAME
    if marker.exists() and manifest.exists():
        with pytest.raises(fmt.CheckpointInvalid):
            fmt.check_marker(marker.read_bytes(), manifest.read_bytes())
    report = validate(path, Level.QUICK)
    assert not report.valid, report


def test_async_save_commits_a_manifest_listing_exactly_the_files_on_disk(suite):
    root, reports = suite
    manifest = _assert_committed(root / "main" / "step-1")
    assert manifest.step == 1
    assert manifest.world_size == RANKS
    assert manifest.contents == (fmt.StateKind.MODEL, fmt.StateKind.OPTIMIZER, fmt.StateKind.EXTRA)
    assert manifest.user == {"run": "suite"}
    assert {f"__{rank}_0.distcp" for rank in range(RANKS)} <= {e.path for e in manifest.files}
    assert manifest.stats is not None and manifest.stats.mode == "async"
    assert manifest.stats.filesystem != ""
    for report in reports:
        assert report["first"]["mode"] == "async"
        assert report["last_committed"] == [1, str(root / "main" / "step-1")]


def test_save_returns_after_staging_and_training_runs_while_writing(suite):
    _, reports = suite
    for report in reports:
        assert report["busy_after_return"], report
        assert report["steps_while_writing"] > 0, report
        assert report["first"]["stall_s"] < report["first_stats"]["write_s"], report


def test_mutating_live_tensors_after_save_returns_does_not_change_the_checkpoint(suite):
    _, reports = suite
    for report in reports:
        assert report["live_differs_from_snapshot"], "the test must really mutate the state"
        assert report["loaded_equals_snapshot"], report


def test_uncommitted_leftover_is_renamed_aside_and_the_save_lands_in_a_fresh_dir(suite):
    root, reports = suite
    aside = [p for p in (root / "main").iterdir() if p.name.startswith("step-5.aborted-")]
    assert len(aside) == 1
    assert fmt.parse_step_dir_name(aside[0].name) is None
    assert (aside[0] / ".metadata").read_bytes() == b"stale metadata from a crashed save"
    _assert_committed(root / "main" / "step-5")
    assert all(report["leftover"]["mode"] == "async" for report in reports)


def test_a_committed_checkpoint_is_never_overwritten(suite):
    root, reports = suite
    for report in reports:
        assert "already a committed checkpoint" in (report["overwrite_error"] or ""), report
    _assert_committed(root / "main" / "step-5")


def test_skip_returns_without_saving_while_a_save_is_in_flight(suite):
    root, reports = suite
    for report in reports:
        assert report["skip_first"]["mode"] == "async"
        assert report["skip_second"]["mode"] == "skipped"
        assert "still being written" in report["skip_second"]["reason"]
        assert report["skip_committed"] == 10
    _assert_committed(root / "skip" / "step-10")
    assert not (root / "skip" / "step-11").exists()


def test_wait_blocks_until_the_in_flight_save_committed(suite):
    root, reports = suite
    for report in reports:
        # after_commit of step 20 was held for 1 s on rank 0: every rank waited.
        assert report["wait_second"]["mode"] == "async"
        assert report["wait_second"]["stall_s"] >= 0.9, report
        assert report["wait_committed"] == 21
    _assert_committed(root / "wait" / "step-20")
    _assert_committed(root / "wait" / "step-21")


def test_no_host_memory_for_staging_falls_back_to_a_synchronous_save(suite):
    root, reports = suite
    for report in reports:
        assert report["memory"]["mode"] == "sync"
        assert "host memory" in report["memory"]["reason"]
        assert report["memory_committed"] == 7
    manifest = _assert_committed(root / "mem" / "step-7")
    assert manifest.stats is not None and manifest.stats.mode == "sync"


def _kill_job(job: subprocess.Popen[bytes], out: Path) -> None:
    """Leave nothing running: every rank that reported its pid, then torchrun."""
    for marker in out.glob("saved.*"):
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(marker.read_text()), signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)


def _start_crash_job(tmp_path: Path) -> tuple[subprocess.Popen[bytes], Path, Path]:
    """A job saving 256 MiB per rank: long enough a write to be killed in the middle."""
    root, out = tmp_path / "root", tmp_path / "out"
    out.mkdir()
    job = _torchrun("crash", str(root), str(out), "256", start_new_session=True)
    step_dir = root / "step-4"
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline:
        saved = all((out / f"saved.{rank}").exists() for rank in range(RANKS))
        if saved and step_dir.exists() and any(p.suffix == ".distcp" for p in step_dir.iterdir()):
            break
        assert job.poll() is None, job.communicate()[0].decode(errors="replace")[-4000:]
        time.sleep(0.005)
    else:
        _kill_job(job, out)
        pytest.fail("the crash job never started writing")
    # The kill must land mid-write for this test to mean anything.
    assert not (step_dir / fmt.MARKER_NAME).exists(), "the write finished before the kill"
    return job, step_dir, out


def _rank_pids(out: Path) -> list[int]:
    return [int((out / f"saved.{rank}").read_text()) for rank in range(RANKS)]


def test_killing_the_whole_job_mid_write_leaves_no_valid_marker(tmp_path):
    job, step_dir, out = _start_crash_job(tmp_path)
    # torchrun starts every rank in a session of its own: kill each of them, as
    # a node losing power would, not just torchrun's process group.
    for pid in _rank_pids(out):
        os.kill(pid, signal.SIGKILL)
    os.killpg(job.pid, signal.SIGKILL)
    job.communicate(timeout=LAUNCH_TIMEOUT_S)
    _assert_not_committed(step_dir)
    _assert_previous_checkpoints_survive(step_dir.parent)


def test_killing_one_rank_mid_write_leaves_no_valid_marker(tmp_path):
    job, step_dir, out = _start_crash_job(tmp_path)
    os.kill(_rank_pids(out)[1], signal.SIGKILL)
    try:
        # torchrun sees rank 1 die and tears down rank 0, whose commit can never
        # complete without rank 1's report.
        job.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        _kill_job(job, out)
    assert job.returncode != 0
    _assert_not_committed(step_dir)
    _assert_previous_checkpoints_survive(step_dir.parent)


def _assert_previous_checkpoints_survive(root: Path) -> None:
    """Retention kept 2 (steps 2 and 3); the killed step-4 costs neither of them."""
    committed = [entry.step for entry in list_checkpoints(root) if entry.committed]
    assert committed == [3, 2]
    newest, rejected = newest_valid(root, Level.FULL)
    assert newest is not None and newest.step == 3
    assert [report.step for report in rejected] == [4]
    assert rejected[0].failed_level is Level.QUICK
