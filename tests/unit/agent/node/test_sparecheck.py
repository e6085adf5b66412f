"""An idle hot spare's health check (agent.node.sparecheck): the gate run alone, one
verdict line per node, read back by the driver from srun's merged output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node.sparecheck import MARK, main, parse_verdicts
from tests.paths import REPO


def check_on(
    node: str, ckpt_root: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """Run the check as srun would on ``node`` (its Slurm environment set by the
    caller); its printed lines."""
    assert os.environ["SLURMD_NODENAME"] == node
    argv = [
        "--ckpt-root", str(ckpt_root), "--master-addr", "127.0.0.1", "--master-port", "22",
        "--health-check", command, "--health-min-free-gb", "0", "--", "torchrun", "t.py",
    ]  # fmt: skip
    assert main(argv) == 0
    return capsys.readouterr().out.splitlines()


def test_a_healthy_spare_prints_one_verdict_with_every_checks_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURMD_NODENAME", "node5")
    (line,) = check_on("node5", tmp_path, "true", capsys)
    verdict = parse_verdicts(line, ["node5"])["node5"]
    assert verdict.healthy
    names = [text.split()[1] for text in verdict.lines]
    assert sorted(names) == ["builtin:ckpt_root", "builtin:gpus", "builtin:rdzv_addr", "true"]


def test_a_spare_whose_checkpoint_root_or_command_fails_says_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setenv("SLURMD_NODENAME", "node6")
    missing = tmp_path / "file"
    missing.write_text("not a directory")
    (line,) = check_on("node6", missing / "ckpt", "sh -c 'echo broken mount; exit 3'", capsys)
    verdict = parse_verdicts(line, ["node6"])["node6"]
    assert not verdict.healthy
    failures = verdict.failures()
    assert "FAIL builtin:ckpt_root" in failures and "exit status 3: broken mount" in failures
    assert "ok builtin:rdzv_addr" not in failures  # the passing checks stay out of the report


def test_only_well_formed_verdicts_of_the_spares_asked_about_are_read() -> None:
    output = "\n".join([
        "srun: error: node7: task 1: Exited with exit code 1",
        f'{MARK}{{"node":"node5","healthy":true,"lines":["ok a"]}}',
        f'0: {MARK}{{"node":"node6","healthy":false,"lines":["ok a","FAIL b"]}}',  # srun --label
        f'{MARK}{{"node":"node9","healthy":false,"lines":["FAIL c"]}}',  # not asked about
        f'{MARK}{{"node":"node7","healthy":"no","lines":[]}}',
        f'{MARK}{{"node":"node8"}}',
        f"{MARK}not json",
    ])  # fmt: skip
    found = parse_verdicts(output, ["node5", "node6", "node7", "node8"])
    assert sorted(found) == ["node5", "node6"]
    assert found["node5"].healthy and not found["node6"].healthy
    assert found["node6"].failures() == "FAIL b"


def test_the_check_imports_no_torch_so_a_spare_idles_cheaply() -> None:
    probe = "import sys, agent.node.sparecheck; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False"


def test_bad_flags_say_what_is_wrong_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert main(["--ckpt-root", "/c", "--", "x"]) == 2
    assert "no job id" in capsys.readouterr().err
