"""Entry point of ``resurgo``: builds the parser from the subcommand modules.

Each subcommand module exposes ``register(subparsers)``, which adds its parser
and sets ``func`` to a callable taking the parsed namespace and returning the
exit status. Exit status 2 is reserved for usage errors, as in argparse.

A usage error prints argparse's form: the usage of the command that was
mistyped (``resurgo ckpt list``'s, not the top level's) and one line
``resurgo ckpt list: error: ...``; every other error is one line.
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
from collections.abc import Iterator, Sequence

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
    for command in _commands(parser):
        # The deepest command parsed sets it last: its parser reports a stray word.
        command.set_defaults(command_parser=command)
    return parser


def _commands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every subcommand's parser under ``parser``, nested ones (``ckpt list``) included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in dict.fromkeys(action.choices.values()):
                yield command
                yield from _commands(command)


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
    # A stray word reaches the top level, which would print the top level's usage:
    # the command it was meant for says it instead, with its own usage.
    args, stray = parser.parse_known_args(words)
    if stray:
        owner: argparse.ArgumentParser = getattr(args, "command_parser", parser)
        owner.error(f"unrecognized arguments: {' '.join(stray)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
