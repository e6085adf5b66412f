"""Entry point of ``resurgo``: builds the parser from the subcommand modules.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` to a callable taking the parsed namespace and returning the
exit status. Exit status 2 is reserved for usage errors, as in argparse.
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
from collections.abc import Sequence

from agent.wire.settings import add_version
from supervisor.cli import ckpt, events, interval, nodes, report, simulate, status, store, submit
from supervisor.logs import TextFormatter

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
    add_version(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``resurgo`` with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    handler = logging.StreamHandler()
    handler.setFormatter(TextFormatter("resurgo: %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    # The views escape stored text themselves; this is for anything they do not
    # reach: a lone surrogate never ends a command in UnicodeEncodeError.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
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
