"""`resurgo store backup DEST`: a consistent copy of the supervisor's store, while it runs.

Uses SQLite's online backup API (:meth:`supervisor.store.Store.backup`): the
copy is a complete, openable database even while the supervisor writes.
Restore (docs/operations.md): stop the supervisor, put the copy in place of
``resurgo.db`` (removing ``resurgo.db-wal`` and ``-shm``), start it; it
reconciles unfinished actions with Slurm at start.
"""

from __future__ import annotations

import argparse
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
    add_state_dir(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write the backup."""
    try:
        with open_store(args.state_dir) as store:
            store.backup(args.dest)
    except (StoreError, OSError) as error:
        return fail("store", f"backup to {args.dest} failed: {error}")
    print(f"store backed up to {args.dest}")
    return 0
