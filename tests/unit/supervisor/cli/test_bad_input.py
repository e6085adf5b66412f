"""Every `resurgo` command, given bad input, fails in words and loses nothing.

One row per (command, bad input, words the message must hold). A row passes when
the command exits non-zero without raising (no traceback), the store in
``--state-dir`` is byte for byte as it was, and stderr is one of two forms:

- one line, ``resurgo COMMAND: ...``, holding the row's words (what was wrong and
  what to do);
- argparse's form, for input the parser itself refuses (an unknown flag or
  command, a missing argument, a value its ``type=`` rejects): the usage of the
  command that was mistyped (its first line ``usage: resurgo COMMAND``, wrapped
  lines indented), then one line ``resurgo COMMAND: error: ...`` holding the
  words. The usage says what to do; the error line says what was wrong.

Commands run in-process through :func:`supervisor.cli.main.main`; one row runs the
installed ``resurgo`` to show the real entry point behaves the same.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor.cli import interval
from supervisor.cli.main import main

RESURGO = Path(sys.executable).with_name("resurgo")
# A wrapped usage line is indented; the error line names the command that refused.
_USAGE = re.compile(r"^usage: resurgo\b")
_ERROR = re.compile(r"^resurgo( [a-z]+)*: error: ")


@dataclass(frozen=True)
class Case:
    """One bad input: ``argv`` after ``resurgo`` (placeholders filled in by
    :func:`_argv`), and the words its one line of stderr must hold."""

    argv: tuple[str, ...]
    words: tuple[str, ...]
    argparse_form: bool = False


def case(argv: str, *words: str, argparse_form: bool = False) -> Case:
    return Case(tuple(argv.split()), words, argparse_form)


# Placeholders: {state} the store's --state-dir, {tmp} an empty folder, {file} a
# plain file, {dirstore} a --state-dir whose resurgo.db is a directory, {script}
# an existing training script, {backup} an existing backup file.
ROWS = [
    # submit: Resurgo's own options (everything else goes to sbatch)
    case("submit -N 2 --ckpt-root {tmp} --dry-run --unit-nodes 0 -- torchrun {script}",
         "--unit-nodes", "must divide"),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --unit 3 -- torchrun {script}",
         "--unit-nodes 3", "must divide"),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --procs-per-node 0 -- torchrun {script}",
         "--procs-per-node", "1 or more"),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --spares -1 -- torchrun {script}",
         "--spares", ">= 0"),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --min-nodes 1e308 -- torchrun {script}",
         "--min-nodes", "invalid int", argparse_form=True),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --register-wait-s nan -- torchrun {script}",
         "--register-wait-s", "seconds > 0", argparse_form=True),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --register-wait-s -1 -- torchrun {script}",
         "--register-wait-s", "seconds > 0", argparse_form=True),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --script {tmp} -- torchrun {script}",
         "--script", "is a directory"),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --script {tmp}/none -- torchrun {script}",
         "--script", "no such file"),
    case("submit -N 2 --ckpt-root {tmp} --dry-run --", "no training command"),
    case("submit -N 2 --dry-run -- torchrun {script}", "--ckpt-root"),
    case("submit -N 2 --ckpt-root {tmp} --dry-run -- torchrun {tmp}/none.py",
         "none.py", "not found"),
    # status
    case("status --state-dir {tmp}/none", "no resurgo store", "--state-dir"),
    case("status --state-dir {dirstore}", "is a directory", "--state-dir"),
    case("status --state-dir {state}/resurgo.db", "is a file", "pass the directory"),
    case("status --state-dir {state} --bogus", "resurgo status: error", "--bogus",
         argparse_form=True),
    # events
    case("events 999 --state-dir {state}", "job 999", "not known", "resurgo status"),
    case("events 4711 --state-dir {tmp}/none", "no resurgo store", "--state-dir"),
    case("events 4711 --state-dir {dirstore}", "is a directory"),
    case("events --state-dir {state}", "resurgo events: error", "job", argparse_form=True),
    case("events 4711 --stakcs --state-dir {state}", "resurgo events: error", "--stakcs",
         argparse_form=True),
    # nodes (none of these reaches Slurm)
    case("nodes undrain --state-dir {state}", "which node", "undrain node"),
    case("nodes --wrong --state-dir {state}", "--wrong goes with undrain"),
    case("nodes --state-dir {dirstore}", "is a directory"),
    case("nodes frobnicate --state-dir {state}", "'frobnicate' is not an action",
         "resurgo nodes undrain frobnicate"),
    # report
    case("report 999 -o {tmp}/r.html --state-dir {state}", "job 999", "not known"),
    case("report 4711 -o {tmp}/r.html --state-dir {tmp}/none", "no resurgo store"),
    case("report 4711 --state-dir {state}", "resurgo report: error", "-o", argparse_form=True),
    # store backup
    case("store backup {tmp}/none/b.db --state-dir {state}", "{tmp}/none", "does not exist",
         "create it"),
    case("store backup {tmp} --state-dir {state}", "is a directory", "name the file"),
    case("store backup {backup} --state-dir {state}", "exists", "--force"),
    case("store backup {tmp}/b.db --state-dir {tmp}/none", "no resurgo store"),
    case("store backup {tmp}/b.db --state-dir {dirstore}", "is a directory"),
    case("store restore {tmp}/b.db --state-dir {state}", "invalid choice", "restore",
         argparse_form=True),
    # ckpt
    case("ckpt validate {tmp}/none", "does not exist", "pass one checkpoint"),
    case("ckpt newest {tmp}/none", "does not exist", "checkpoint root"),
    case("ckpt list {file}", "is not a directory", "checkpoint root"),
    case("ckpt list {tmp} --level extreme", "resurgo ckpt list: error", "extreme",
         argparse_form=True),
    case("ckpt list {tmp} --bogus", "resurgo ckpt list: error", "--bogus", argparse_form=True),
    case("ckpt quarantined {tmp}/none", "does not exist"),
    case("ckpt release {tmp} step-1", "step-1"),
    case("ckpt", "which command", "validate", argparse_form=True),
    case("ckpt frobnicate", "invalid choice", "frobnicate", argparse_form=True),
    # interval
    case("interval --save-stall-s 0 --mtbf-h 3", "--save-stall-s", "positive"),
    case("interval --save-stall-s -1 --mtbf-h 3", "--save-stall-s", "positive"),
    case("interval --save-stall-s abc --mtbf-h 3", "--save-stall-s", "positive"),
    case("interval --save-stall-s 1e308 --mtbf-h 3", "--save-stall-s", "at most"),
    case("interval --save-stall-s 1e9 --mtbf-h 1e-9", "--save-stall-s", "at most"),
    case("interval --save-stall-s 10 --mtbf-h nan", "--mtbf-h", "positive"),
    case("interval --save-stall-s 10 --mtbf-h 1e308", "--mtbf-h", "at most"),
    case("interval --save-stall-s 10 --mtbf-h 3 --write-s -1", "--write-s"),
    case("interval --save-stall-s 36000 --mtbf-h 3", "cannot keep up", "async saves"),
    case("interval --save-s 1 --mtbf-h 1e-9", "cannot keep up", "over 1000%"),
    case("interval --mtbf-h 3", "--save-stall-s", "required"),
    case("interval --save-stall-s 10 --mtbf-h 3 --bogus", "resurgo interval: error", "--bogus",
         argparse_form=True),
    # simulate (all refused before the simulation runs)
    case("simulate --gpus 0", "--gpus", "from 1"),
    case("simulate --gpus 1e308", "--gpus", "whole number"),
    case("simulate --days 1e308", "--days", "at most"),
    case("simulate --days nan", "--days", "positive"),
    case("simulate --gpu-mtbf-h 1e-320", "--gpu-mtbf-h", "at least"),
    case("simulate --save-stall-s -1", "--save-stall-s"),
    case("simulate --idle-nodes -1", "--idle-nodes"),
    case("simulate --spares 1e308", "--spares"),
    case("simulate --mix cosmic=1", "--mix", "cosmic", "components"),
    case("simulate --plot {tmp}/g.jpg", "--plot", ".svg"),
    case("simulate --plot {tmp}/none/g.png", "--plot", "does not exist"),
    case("simulate --plot {tmp}", "--plot", "is a directory"),
    case("simulate --sweep-points 3 --plot {tmp}/g.png", "--sweep-points", "from 4"),
    case("simulate --interval-policy sometimes", "invalid choice", "sometimes",
         argparse_form=True),
    case("simulate --unit-nodse 2", "resurgo simulate: error", "--unit-nodse",
         argparse_form=True),
    # the top level
    case("frobnicate", "invalid choice", "frobnicate", argparse_form=True),
    case("--bogus", "resurgo: error", "--bogus", argparse_form=True),
]  # fmt: skip


@dataclass(frozen=True)
class World:
    """The paths the placeholders stand for."""

    state: Path
    tmp: Path
    file: Path
    dirstore: Path
    script: Path
    backup: Path

    def fill(self, text: str) -> str:
        return text.format(**{name: str(path) for name, path in vars(self).items()})


@pytest.fixture
def world(state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> World:
    monkeypatch.delenv("RESURGO_CKPT_ROOT", raising=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    dirstore = tmp_path / "dirstore"
    (dirstore / "resurgo.db").mkdir(parents=True)
    plain = tmp_path / "plain.txt"
    plain.write_text("not a checkpoint root\n")
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    backup = tmp_path / "old-backup.db"
    backup.write_bytes(b"an older backup")
    return World(state_dir, empty, plain, dirstore, script, backup)


def _snapshot(world: World) -> dict[str, str]:
    """Every file under the folders the rows name, by content; but SQLite's ``-shm``, and an
    empty ``-wal``: a reader of a WAL store makes them, and they hold no data."""
    files = {}
    for folder in (world.state, world.tmp, world.dirstore, world.backup.parent):
        for path in sorted(folder.rglob("*")):
            scratch = path.name.endswith("-shm") or (
                path.name.endswith("-wal") and path.stat().st_size == 0
            )
            if path.is_file() and not scratch:
                files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def problems(status: int | None, stderr: str, row: Case, words: tuple[str, ...]) -> list[str]:
    """What is wrong with a command's failure, in words; [] when it failed as promised.
    ``status`` None: the command raised."""
    found = []
    if status is None:
        found.append("raised instead of failing in words")
    elif status == 0:
        found.append("exited 0")
    lines = stderr.rstrip("\n").splitlines()
    if "Traceback" in stderr:
        found.append("printed a traceback")
    if row.argparse_form:
        usage = [line for line in lines[:-1] if not line.startswith(" ")]
        if not lines or not _USAGE.match(lines[0]) or len(usage) != 1:
            found.append(f"not argparse's usage block then one line: {lines}")
        if not lines or not _ERROR.match(lines[-1]):
            found.append(f"last line is not `resurgo COMMAND: error: ...`: {lines[-1:]}")
    elif len(lines) != 1 or not lines[0].startswith(f"resurgo {row.argv[0]}"):
        found.append(f"not one line `resurgo {row.argv[0]}: ...`: {lines}")
    last = lines[-1].lower() if lines else ""
    found.extend(f"does not say {word!r}" for word in words if word.lower() not in last)
    return found


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | None, str]:
    try:
        status: int | None = main(argv)
    except SystemExit as exited:
        status = exited.code if isinstance(exited.code, int) else 1
    except Exception:  # a traceback for the user: the checker reports it
        status = None
    return status, capsys.readouterr().err


@pytest.mark.parametrize("row", ROWS, ids=[" ".join(row.argv) for row in ROWS])
def test_bad_input_fails_in_one_line_and_leaves_the_store_as_it_was(
    row: Case, world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [world.fill(word) for word in row.argv]
    before = _snapshot(world)
    status, stderr = _run(argv, capsys)
    assert problems(status, stderr, row, tuple(world.fill(w) for w in row.words)) == [], stderr
    assert _snapshot(world) == before


@pytest.mark.parametrize("period", ["-1", "nan", "0"])
def test_status_refuses_a_watch_period_that_is_not_seconds(
    period: str, world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    row = case(f"status --watch {period} --state-dir {{state}}", "--watch", argparse_form=True)
    status, stderr = _run([world.fill(word) for word in row.argv], capsys)
    assert problems(status, stderr, row, row.words) == [], stderr


def test_the_checker_catches_a_command_that_raises(
    world: World, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planted defect: `interval` raising as it did on a save longer than the MTBF."""

    def broken(_args: object) -> int:
        raise ValueError("MTBF must be a positive, finite number of seconds, got inf")

    monkeypatch.setattr(interval, "run", broken)
    row = case("interval --save-stall-s 10 --mtbf-h 3", "--save-stall-s")
    status, stderr = _run(list(row.argv), capsys)
    assert problems(status, stderr, row, row.words) == [
        "raised instead of failing in words",
        "not one line `resurgo interval: ...`: []",
        "does not say '--save-stall-s'",
    ]


def test_the_checker_catches_a_traceback_and_a_second_line() -> None:
    row = case("store backup x", "exists")
    traceback = "Traceback (most recent call last):\n  ...\nsqlite3.OperationalError: x\n"
    assert "printed a traceback" in problems(1, traceback, row, row.words)
    two = "resurgo store: x exists\nresurgo store: and more\n"
    assert problems(1, two, row, row.words) != []
    assert problems(0, "resurgo store: x exists\n", row, row.words) == ["exited 0"]


def test_the_installed_command_fails_in_one_line_too(world: World) -> None:
    done = subprocess.run(
        [str(RESURGO), "status", "--state-dir", str(world.dirstore)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    row = case("status", "is a directory")
    assert problems(done.returncode, done.stderr, row, row.words) == [], done.stderr
