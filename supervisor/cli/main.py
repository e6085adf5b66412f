"""Entry point of ``resurgo``: builds the parser from the subcommand modules.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` to a callable taking the parsed namespace and returning the
exit status. Exit status 2 is reserved for usage errors, as in argparse.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from supervisor import __version__
from supervisor.cli import ckpt, events, interval, nodes, report, simulate, status, store, submit

SUBCOMMANDS = (submit, status, events, nodes, report, store, ckpt, interval, simulate)


def build_parser() -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="resurgo",
        description=(
            "Resurgo keeps multi-node PyTorch training alive on Slurm: it detects dead and "
            "hung ranks, drains the bad node, and resumes from the newest valid checkpoint."
        ),
    )
    parser.add_argument("--version", action="version", version=f"resurgo {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``resurgo`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    logging.basicConfig(level=logging.WARNING, format="resurgo: %(levelname)s: %(message)s")
    words = list(sys.argv[1:] if argv is None else argv)
    if words[:1] == ["submit"]:
        # sbatch's options pass through untouched: submit parses its own words.
        return submit.main(words[1:])
    parser = build_parser()
    args = parser.parse_args(words)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
