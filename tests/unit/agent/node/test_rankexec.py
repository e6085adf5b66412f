"""The rank's parent (agent.node.rankexec): the exit record, and the worker's last words."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from agent.node import rankexec
from tests.paths import REPO


def shim(code: str, exit_dir: Path) -> subprocess.CompletedProcess[bytes]:
    """``python -m agent.node.rankexec -c CODE`` as rank 2, as torchrun starts it."""
    return subprocess.run(
        [sys.executable, "-m", "agent.node.rankexec", "-c", code],
        cwd=REPO,
        env={**os.environ, "RESURGO_EXIT_DIR": str(exit_dir), "RANK": "2", "LOCAL_RANK": "0"},
        capture_output=True,
        timeout=60,
        check=False,
    )


def record(exit_dir: Path) -> dict[str, object]:
    document: dict[str, object] = json.loads((exit_dir / "rank-2.json").read_text())
    return document


def test_a_traceback_passes_through_and_its_last_lines_are_recorded(tmp_path: Path) -> None:
    done = shim("import sys; print('step 1', file=sys.stderr); import no_such_module", tmp_path)
    assert done.returncode == 1
    assert b"ModuleNotFoundError: No module named 'no_such_module'" in done.stderr  # as usual
    tail = str(record(tmp_path)["stderr_tail"])
    assert tail.startswith("step 1\nTraceback (most recent call last):")
    assert tail.endswith("ModuleNotFoundError: No module named 'no_such_module'")


def test_a_worker_killed_by_a_signal_leaves_what_it_wrote_before(tmp_path: Path) -> None:
    done = shim(
        "import os, signal, sys\n"
        "sys.stderr.write('NCCL WARN socket closed\\n'); sys.stderr.flush()\n"
        "os.kill(os.getpid(), signal.SIGKILL)",
        tmp_path,
    )
    assert done.returncode == -signal.SIGKILL  # the shim ends as its worker did
    assert (record(tmp_path)["signal"], record(tmp_path)["stderr_tail"]) == (
        signal.SIGKILL,
        "NCCL WARN socket closed",
    )


def test_the_tail_is_bounded_in_lines_and_characters() -> None:
    many = "\n".join(f"line {i}" for i in range(100))
    assert rankexec.last_lines(many).split("\n") == [f"line {i}" for i in range(80, 100)]
    wide = "\n".join("y" * 500 for _ in range(10))
    assert len(rankexec.last_lines(wide)) == rankexec.TAIL_CHARS
    assert rankexec.last_lines("a\r\n\n\nb\rc\n") == "a\nb\nc"
