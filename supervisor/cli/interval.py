"""`resurgo interval`: filled in with the checkpoint issue."""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add the `interval` subcommand to `subparsers`."""
    parser: argparse.ArgumentParser = subparsers.add_parser("interval", help="(not yet available)")
    parser.set_defaults(func=lambda _args: 2)
