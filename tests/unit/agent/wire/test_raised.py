"""A rank's uncaught exception, noted when it reaches the top (agent.wire.raised)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.wire import raised
from tests.paths import REPO


def rank_that_runs(code: str, exit_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a rank of a Resurgo launch (rank 3), the hook installed as the bootstrap
    installs it."""
    program = f"from agent.wire import raised\nraised.install()\n{code}\n"
    return subprocess.run(
        [sys.executable, "-c", program],
        cwd=REPO,
        env={**os.environ, "RESURGO_EXIT_DIR": str(exit_dir), "RANK": "3", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_uncaught_exception_is_noted_before_the_traceback_as_usual(tmp_path: Path) -> None:
    done = rank_that_runs("raise RuntimeError('rank 3 fails in iter 15')", tmp_path)
    assert done.returncode == 1
    assert "RuntimeError: rank 3 fails in iter 15" in done.stderr  # the usual traceback
    kind, when = raised.read(tmp_path, 3) or ("", 0.0)
    assert kind == "RuntimeError" and when > 0
    assert [p.name for p in tmp_path.iterdir()] == ["raised-rank-3.json"]  # no temporary left


@pytest.mark.parametrize(
    ("code", "env"),
    [
        ("import sys; sys.exit(1)", {}),  # an exit status, not an exception
        ("raise KeyboardInterrupt", {}),  # a person's interrupt
        ("class ChildFailedError(Exception): pass\n"
         "ChildFailedError.__module__ = 'torch.distributed.elastic.multiprocessing.errors'\n"
         "raise ChildFailedError()", {}),  # torchrun's own: a rank failed below it
        ("raise RuntimeError('x')", {"RANK": ""}),  # not a rank
    ],
)  # fmt: skip
def test_what_is_no_ranks_own_exception_is_not_noted(
    tmp_path: Path, code: str, env: dict[str, str]
) -> None:
    rank_that_runs(code, tmp_path, **env)
    assert raised.read(tmp_path, 3) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("raised")] == []


@pytest.mark.parametrize(
    ("code", "ended"),
    [
        ("print('trained')", True),
        # Its atexit handlers run after the note: one that crashes cannot hide the end.
        ("import atexit, os; atexit.register(os.abort)", True),
        ("raise RuntimeError('x')", False),
        ("raise KeyboardInterrupt", False),
        ("import os; os._exit(0)", False),
        # A DataLoader's workers are forked children that end long before the script.
        (
            "import multiprocessing as mp, os\n"
            "child = mp.get_context('fork').Process(target=print)\n"
            "child.start(); child.join(); os._exit(0)",
            False,
        ),
        ("import os; os.abort()", False),
    ],
)
def test_a_script_that_ran_to_its_end_is_noted_before_its_teardown(
    tmp_path: Path, code: str, ended: bool
) -> None:
    rank_that_runs(code, tmp_path)
    assert raised.ended(tmp_path, 3) is ended


@pytest.mark.parametrize(
    "text", ["", "{", json.dumps({"type": 3, "time_unix_s": 1.0}), json.dumps({"type": "E"}),
             json.dumps({"type": "E", "time_unix_s": True}), json.dumps([1])],
)  # fmt: skip
def test_a_note_that_cannot_be_read_is_no_note(tmp_path: Path, text: str) -> None:
    raised.path_of(tmp_path, 0).write_text(text)
    assert raised.read(tmp_path, 0) is None


def test_the_note_keeps_the_messages_start_and_an_os_errors_errno(tmp_path: Path) -> None:
    rank_that_runs(
        "import errno, os\n"
        "raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), '/ckpt/step-30/shard-0')",
        tmp_path,
    )
    found = raised.read_note(tmp_path, 3)
    assert found is not None
    assert (found.type, found.errno) == ("OSError", 28)
    assert found.message == "[Errno 28] No space left on device: '/ckpt/step-30/shard-0'"


def test_a_long_message_is_cut_and_a_plain_exception_has_no_errno(tmp_path: Path) -> None:
    rank_that_runs("raise ModuleNotFoundError('x' * 5000)", tmp_path)
    found = raised.read_note(tmp_path, 3)
    assert found is not None and found.errno is None
    assert found.message == "x" * raised.MESSAGE_CHARS


def test_a_note_of_an_older_agent_without_message_still_reads(tmp_path: Path) -> None:
    raised.path_of(tmp_path, 3).write_text(json.dumps({"type": "RuntimeError", "time_unix_s": 5}))
    assert raised.read_note(tmp_path, 3) == raised.Note("RuntimeError", 5.0, "", None)
