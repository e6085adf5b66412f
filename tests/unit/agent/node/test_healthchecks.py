"""The health gate's built-in checks on real parts: directories, the resolver, the kernel's
routes, and fake ``nvidia-smi`` / ``dmesg`` scripts put first on ``PATH``."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest

from agent.node.healthchecks import (
    GPUS,
    CheckResult,
    bounded,
    check_ckpt_root,
    check_gpus,
    check_rdzv_addr,
    gpus_needed,
    in_thread,
)

HEALTHY_ROWS = "0, 00000000:17:00.0, No, No\n1, 00000000:2A:00.0, No, No\n"


def ckpt_root(root: str, min_free_gb: float = 0.0) -> tuple[bool, str]:
    return asyncio.run(check_ckpt_root(root, min_free_gb, 10.0))


# -- the checkpoint root ------------------------------------------------------------------


def test_a_writable_root_passes_is_created_when_missing_and_keeps_no_probe(tmp_path: Path) -> None:
    root = tmp_path / "ckpt" / "job"
    ok, detail = ckpt_root(str(root), min_free_gb=0.001)
    assert ok, detail
    assert "writable" in detail and "GB free" in detail
    assert root.is_dir() and list(root.iterdir()) == []


def test_no_root_is_skipped_and_says_so() -> None:
    ok, detail = ckpt_root("")
    assert ok and detail.startswith("skipped")


def test_a_root_that_cannot_be_created_fails_naming_the_root_and_why() -> None:
    ok, detail = ckpt_root("/dev/null/ckpt")
    assert not ok
    assert "/dev/null/ckpt does not exist and cannot be created (Not a directory)" in detail


def test_a_root_that_takes_no_write_even_from_root_fails() -> None:
    ok, detail = ckpt_root("/proc")  # exists, a directory, and no file can be made in it
    assert not ok
    assert detail.startswith("checkpoint root /proc is not writable (")
    assert "permissions" in detail


def test_a_root_that_is_a_file_fails(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    ok, detail = ckpt_root(str(tmp_path / "file"))
    assert not ok and "is not a directory" in detail


def test_free_space_under_the_threshold_fails_and_zero_leaves_it_unchecked(tmp_path: Path) -> None:
    free_gb = shutil.disk_usage(tmp_path).free / 10**9
    ok, detail = ckpt_root(str(tmp_path), min_free_gb=free_gb * 2 + 1)
    assert not ok
    assert "GB free, under health_min_free_gb" in detail and "delete old checkpoints" in detail
    assert ckpt_root(str(tmp_path), min_free_gb=0.0)[0]


# -- the rendezvous address ---------------------------------------------------------------


def test_a_loopback_rendezvous_host_resolves_and_is_routed() -> None:
    ok, detail = asyncio.run(check_rdzv_addr("localhost", 29500, 10.0))
    assert ok, detail
    assert "resolves to" in detail and "routed via" in detail


def test_an_unresolvable_rendezvous_host_fails() -> None:
    result = asyncio.run(bounded("r", check_rdzv_addr("name.invalid", 29500, 5.0), 5.0, "x"))
    assert not result.ok
    # Either the resolver says so, or it never answers: a failure both ways.
    assert "name.invalid does not resolve" in result.detail or result.timed_out


def test_an_address_the_kernel_will_not_connect_to_fails_naming_it() -> None:
    # The broadcast address resolves everywhere, and no UDP connect to it is allowed
    # without SO_BROADCAST: "resolves, but no route", on any machine.
    ok, detail = asyncio.run(check_rdzv_addr("255.255.255.255", 29500, 10.0))
    assert not ok
    assert "255.255.255.255 resolves but has no route from this node (255.255.255.255:" in detail


# -- GPUs ---------------------------------------------------------------------------------


@pytest.fixture
def fake_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory first on PATH for fake nvidia-smi and dmesg; dmesg finds no Xid."""
    folder = tmp_path / "bin"
    folder.mkdir()
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    script(folder, "dmesg", "echo '[    0.000000] Linux version 6.1'")
    return folder


def script(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def smi_rows(folder: Path, rows: str) -> None:
    script(folder, "nvidia-smi", f"cat <<'EOF'\n{rows}EOF")


def gpus(needed: int | None = None, timeout_s: float = 10.0) -> CheckResult:
    return asyncio.run(bounded(GPUS, check_gpus(needed, timeout_s, None), timeout_s, "stuck"))


def test_healthy_gpus_pass_with_their_count(fake_bin: Path) -> None:
    smi_rows(fake_bin, HEALTHY_ROWS)
    result = gpus(needed=2)
    assert result.ok, result.detail
    assert result.detail.startswith("2 GPU(s), no pending retired pages")
    assert result.detail.endswith("no Xid error in the kernel log since boot")


def test_pending_retired_pages_fail_naming_the_gpu(fake_bin: Path) -> None:
    smi_rows(fake_bin, "0, 00000000:17:00.0, No, No\n1, 00000000:2A:00.0, Yes, No\n")
    result = gpus()
    assert not result.ok
    assert "GPU 1 (00000000:2A:00.0) has retired pages pending" in result.detail
    assert "GPU 0" not in result.detail


def test_a_failed_row_remapping_fails(fake_bin: Path) -> None:
    smi_rows(fake_bin, "0, 00000000:17:00.0, No, Yes\n")
    result = gpus()
    assert not result.ok and "GPU 0 (00000000:17:00.0) failed a row remapping" in result.detail


def test_fields_not_supported_are_no_failure(fake_bin: Path) -> None:
    smi_rows(fake_bin, "0, 00000000:17:00.0, [N/A], [N/A]\n1, 00000000:2A:00.0, N/A, N/A\n")
    result = gpus(needed=2)
    assert result.ok, result.detail


def test_fewer_gpus_than_the_ranks_need_fail(fake_bin: Path) -> None:
    smi_rows(fake_bin, HEALTHY_ROWS)
    result = gpus(needed=4)
    assert not result.ok and "nvidia-smi lists 2 GPU(s), this node's ranks need 4" in result.detail


def test_no_gpu_listed_fails_even_when_the_need_is_unclear(fake_bin: Path) -> None:
    smi_rows(fake_bin, "")
    result = gpus(needed=None)
    assert not result.ok and "nvidia-smi lists no GPU" in result.detail


def test_a_failing_nvidia_smi_fails_with_its_words(fake_bin: Path) -> None:
    script(fake_bin, "nvidia-smi", "echo 'Unable to determine the device handle for GPU3'; exit 15")
    result = gpus()
    assert not result.ok
    assert "nvidia-smi failed (exit status 15: Unable to determine the device handle" in (
        result.detail
    )


def test_a_hung_nvidia_smi_times_out_and_is_killed_with_its_children(
    fake_bin: Path, tmp_path: Path
) -> None:
    pid_file = tmp_path / "sleep.pid"
    script(fake_bin, "nvidia-smi", f"sleep 60 & echo $! > {pid_file}; wait")
    start = time.monotonic()
    result = gpus(timeout_s=1.0)
    assert time.monotonic() - start < 5
    assert not result.ok and result.timed_out
    assert result.detail.startswith("timed out: nvidia-smi gave no answer within 1 s (killed)")
    assert gone(int(pid_file.read_text()))


def gone(pid: int) -> bool:
    """No such process, or a zombie waiting for a reaper that is not ours."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "\nState:\tZ" in status:
            return True
        time.sleep(0.05)
    return False


def test_an_xid_in_the_kernel_log_fails(fake_bin: Path) -> None:
    smi_rows(fake_bin, HEALTHY_ROWS)
    script(
        fake_bin,
        "dmesg",
        "echo '[ 12.5] NVRM: Xid (PCI:0000:2a:00): 79, pid=0, GPU has fallen off the bus.'",
    )
    result = gpus()
    assert not result.ok
    assert "1 Xid error(s) in the kernel log since boot" in result.detail
    assert "79, pid=0, GPU has fallen off the bus" in result.detail


def test_xids_an_application_causes_do_not_fail_the_node(fake_bin: Path) -> None:
    smi_rows(fake_bin, HEALTHY_ROWS)
    script(
        fake_bin,
        "dmesg",
        "echo '[ 9.1] NVRM: Xid (PCI:0000:2a:00): 13, pid=4242, Graphics Exception'; "
        "echo '[ 9.2] NVRM: Xid (PCI:0000:2a:00): 43, pid=4242, Ch 00000008'",
    )
    result = gpus()
    assert result.ok, result.detail


def test_a_refused_dmesg_leaves_xid_unchecked_and_passes(fake_bin: Path) -> None:
    smi_rows(fake_bin, HEALTHY_ROWS)
    script(fake_bin, "dmesg", "echo 'dmesg: read kernel buffer failed: Operation not permitted'"
           "; exit 1")  # fmt: skip
    result = gpus()
    assert result.ok, result.detail
    assert "Xid not checked: dmesg exit status 1: dmesg: read kernel buffer failed" in (
        result.detail
    )


def test_without_nvidia_smi_on_path_the_gpu_check_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = gpus()
    assert result.ok and result.detail == "skipped: nvidia-smi is not on PATH"


@pytest.mark.parametrize(
    ("gpus_on_node", "local_ranks", "needed"),
    [(None, 8, None), ("0", 8, None), ("eight", 8, None), ("8", 8, 8), ("8", 4, 4),
     ("4", 8, 4), ("4", None, 4)],
)  # fmt: skip
def test_the_gpus_needed_are_the_ranks_within_what_slurm_gave(
    gpus_on_node: str | None, local_ranks: int | None, needed: int | None
) -> None:
    environ = {} if gpus_on_node is None else {"SLURM_GPUS_ON_NODE": gpus_on_node}
    assert gpus_needed(environ, local_ranks) == needed


# -- bounds -------------------------------------------------------------------------------


def test_a_blocking_call_is_abandoned_at_its_timeout() -> None:
    async def main() -> None:
        with pytest.raises(TimeoutError, match=r"no answer within 0\.2 s"):
            await in_thread(lambda: time.sleep(3), 0.2)

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 1.5  # nor did the loop's end wait for the thread


def test_a_check_that_raises_is_a_failure_with_its_words() -> None:
    async def broken() -> tuple[bool, str]:
        raise OSError(5, "Input/output error")

    result = asyncio.run(bounded("builtin:x", broken(), 1.0, "stuck"))
    assert not result.ok and "Input/output error" in result.detail


def test_a_result_line_is_one_clipped_line() -> None:
    line = CheckResult("builtin:x", False, "a\nb\r\n" + "c" * 2000, 0.5).line()
    assert line.startswith("FAIL builtin:x (0.50 s): a b c")
    assert "\n" not in line and len(line) == 500 and line.endswith("...")
