"""What the ``resurgo`` subcommands share: tables, durations, JSON, the store, errors."""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from supervisor.config import DEFAULT_STATE_DIR, this_users_state_dir
from supervisor.errors import StoreError
from supervisor.store import Store
from supervisor.text import one_line

ENV_STATE_DIR = "RESURGO_STATE_DIR"
ENV_JOBS_DIR = "RESURGO_JOBS_DIR"


class BadInput(Exception):
    """One flag's value is unusable; the message names the flag and what is valid."""


def number(
    flag: str, text: str, *, positive: bool, least: float | None = None, most: float | None = None
) -> float:
    """``text`` as a finite number, >0 when ``positive`` else >=0, and from ``least`` to
    ``most`` where given; BadInput otherwise."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (value <= 0 if positive else value < 0):
        wanted = "a positive number" if positive else "a number >= 0"
        raise BadInput(f"{flag} must be {wanted}, got {text!r}")
    if least is not None and value < least:
        raise BadInput(f"{flag} must be at least {least:g}, got {text!r}")
    if most is not None and value > most:
        raise BadInput(f"{flag} must be at most {most:g}, got {text!r}")
    return value


def watch_seconds(text: str) -> float:
    """An argparse ``type=`` for a redraw period (``status --watch S``): a finite number of
    seconds, at least 0.1 (a tighter loop only burns the store's readers' CPU)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0.1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a redraw period: give seconds, at least 0.1 (e.g. --watch 2)"
        )
    return value


def fine_duration(value: float) -> str:
    """An interval for people, precise at every size: 26.8 min (1608 s), 42.5 s, 4.6 ms."""
    if value >= 60:
        return f"{value / 60:.1f} min ({value:.0f} s)"
    if value >= 1 or value == 0:
        return f"{value:.3g} s"
    return f"{value * 1000:.3g} ms"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: bool = False) -> str:
    """Columns padded to their widest cell, two spaces apart, trailing blanks trimmed;
    ``right`` aligns right (columns of numbers)."""
    cells = [list(headers), *[list(row) for row in rows]]
    widths = [max(len(line[column]) for line in cells) for column in range(len(headers))]
    return "\n".join(
        "  ".join(
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width in zip(line, widths, strict=True)
        ).rstrip()
        for line in cells
    )


def duration(seconds: float) -> str:
    """Seconds for people: 42s, 17m, 3.5h, 2.0d."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def print_json(document: dict[str, Any]) -> None:
    """The stable ``--json`` form: sorted keys, one space indent."""
    print(json.dumps(document, sort_keys=True, indent=1))


def fail(command: str, message: str, status: int = 1) -> int:
    """One line on stderr saying what to do; returns ``status`` for the caller to exit with.

    The message may quote another program's output (Slurm's stderr) or stored
    text: it is written as one line, with visible escapes."""
    print(f"resurgo {command}: {one_line(message.strip())}", file=sys.stderr)
    return status


def add_state_dir(parser: argparse.ArgumentParser) -> None:
    """``--state-dir`` (default ``$RESURGO_STATE_DIR``, else the supervisor's default as
    this user's supervisor would resolve it: :func:`supervisor.config.default_state_dir`)."""
    parser.add_argument(
        "--state-dir",
        default=os.environ.get(ENV_STATE_DIR) or this_users_state_dir(os.environ, write=False),
        help=(
            f"the supervisor's state directory (default ${ENV_STATE_DIR}, else "
            f"{DEFAULT_STATE_DIR}, or $XDG_STATE_HOME/resurgo for a user shut out of that)"
        ),
    )


def jobs_dir(state_dir: str, explicit: str | None) -> Path:
    """The jobs directory: ``explicit`` (``--jobs-dir``), ``$RESURGO_JOBS_DIR``, else
    ``<state_dir>/jobs`` (as the supervisor resolves it)."""
    chosen = explicit or os.environ.get(ENV_JOBS_DIR)
    return Path(chosen) if chosen else Path(state_dir) / "jobs"


def open_store(state_dir: str, *, write: bool = False) -> Store:
    """The supervisor's store, never created here; StoreError saying where to look.

    Read-only unless ``write`` and this user may write it (``store.read_only``
    tells which): a view never writes, and a user who may only read the store
    (an operator in the supervisor's ``state_group``) can still use every view.
    """
    path = Path(state_dir) / "resurgo.db"
    if Path(state_dir).is_file():
        raise StoreError(
            f"--state-dir {state_dir} is a file: pass the directory holding resurgo.db "
            f"({Path(state_dir).parent}, if that file is the store)"
        )
    if path.is_dir():
        raise StoreError(
            f"{path} is a directory, not a Resurgo store: pass the supervisor's --state-dir "
            f"(the directory holding its resurgo.db file)"
        )
    try:
        if not path.exists():
            raise StoreError(
                f"no Resurgo store at {path}: pass the supervisor's --state-dir or set "
                f"{ENV_STATE_DIR}"
            )
        writable = write and all(os.access(p, os.W_OK) for p in (path, path.parent))
        return Store.open(path, create=False, read_only=not writable)
    except PermissionError as error:
        raise StoreError(
            f"cannot read the store at {path} ({error.strerror}): run as the supervisor's "
            "user, or as a member of its state_group"
        ) from error
    except (OSError, sqlite3.Error) as error:
        # Store.open turns damage into StoreCorrupt; what is left is the OS or SQLite
        # refusing the file itself (a special file, a full disk, an I/O error).
        raise StoreError(
            f"cannot open the store at {path} ({error}): check the path is the supervisor's "
            "resurgo.db file"
        ) from error
