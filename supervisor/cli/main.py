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
import importlib
import io
import logging
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType

from agent.wire.settings import add_version
from supervisor.logs import TextFormatter

# The subcommands' modules, in help order. A command imports its own module only:
# ``resurgo status`` has no use for the HTTP client ``submit`` loads, and every
# command's start-up is paid by scripts that poll it.
SUBCOMMANDS = ("submit", "status", "events", "nodes", "report", "store", "ckpt", "interval",
               "simulate")  # fmt: skip


def subcommand_modules(first_word: str | None = None) -> list[ModuleType]:
    """The module of the subcommand ``first_word`` names, or every one's (none named, or
    a word that is no subcommand's name: the full parser says what is wrong)."""
    names = [first_word] if first_word in SUBCOMMANDS else SUBCOMMANDS
    return [importlib.import_module(f"supervisor.cli.{name}") for name in names]


def build_parser(first_word: str | None = None) -> argparse.ArgumentParser:
    """Return the top-level parser with every subcommand registered (or only the one
    ``first_word`` names)."""
    parser = argparse.ArgumentParser(
        prog="resurgo",
        description=(
            "Resurgo keeps multi-node PyTorch training alive on Slurm: it detects dead and "
            "hung ranks, drains the bad node, and resumes from the newest valid checkpoint."
        ),
    )
    add_version(parser)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in subcommand_modules(first_word):
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
        from supervisor.cli import submit

        return submit.main(words[1:])
    parser = build_parser(words[0] if words else None)
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
