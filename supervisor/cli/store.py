"""`resurgo store backup DEST`: a consistent copy of the supervisor's store, while it runs.

Uses SQLite's online backup API (:meth:`supervisor.store.Store.backup`): the
copy is a complete, openable database even while the supervisor writes, with
the store's own permission bits. An existing DEST is kept unless ``--force``.
Restore (docs/operations.md): stop the supervisor, put the copy in place of
``resurgo.db`` (removing ``resurgo.db-wal`` and ``-shm``), start it; it
reconciles unfinished actions with Slurm at start.
"""

from __future__ import annotations

import argparse
import sqlite3
from pathlib import Path
from typing import Any

from supervisor.cli.common import add_state_dir, fail, open_store
from supervisor.errors import StoreError


def register(subparsers: Any) -> None:
    """Add the `store` subcommand."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "store",
        help="back up the supervisor's SQLite store while it runs",
        description="store backup DEST writes a consistent, openable copy of the supervisor's "
        "store (SQLite's online backup) even while the supervisor writes to it. To restore, "
        "see docs/operations.md.",
    )
    parser.add_argument("action", choices=["backup"])
    parser.add_argument("dest", type=Path, metavar="DEST", help="the backup file to write")
    parser.add_argument("--force", action="store_true", help="replace DEST if it exists")
    add_state_dir(parser)
    parser.set_defaults(func=run)


def refusal(dest: Path, *, force: bool) -> str | None:
    """Why ``dest`` cannot take the backup, in words; None when it can."""
    if dest.is_dir():
        return f"{dest} is a directory: name the file to write, e.g. {dest / 'resurgo-backup.db'}"
    if not dest.parent.is_dir():
        return f"the folder {dest.parent} does not exist: create it first, or pick another DEST"
    if dest.exists() and not force:
        return f"{dest} exists: pick another DEST, or pass --force to replace it"
    return None


def run(args: argparse.Namespace) -> int:
    """Write the backup."""
    problem = refusal(args.dest, force=args.force)
    if problem is not None:
        return fail("store", f"nothing written: {problem}", 2)
    try:
        with open_store(args.state_dir) as store:
            store.backup(args.dest)
    except StoreError as error:
        return fail("store", f"backup to {args.dest} failed: {error}")
    except (OSError, sqlite3.Error) as error:
        return fail("store", f"backup to {args.dest} failed ({error}): check DEST is writable")
    print(f"store backed up to {args.dest}")
    return 0
