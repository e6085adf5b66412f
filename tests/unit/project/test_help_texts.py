"""Every ``--help`` of every entry point and subcommand reads right to an operator.

The parsers are walked as argparse builds them, subcommands recursively
(``resurgo ckpt list``), and each is held to four rules:

- no two arguments of one parser share a help text (their defaults aside):
  a flag's help says what that flag sets;
- no reStructuredText markup (``:mod:`x```, double backquotes): ``--help``
  is read in a terminal, not rendered by Sphinx;
- a default is shown once: an argument whose default is not None says
  "default" in its help (the convention is "(default: X)"), and none says it
  twice;
- every parser has a description, and every subcommand a line in its
  parent's list.

``test_help.py`` holds the daemons' flags to their settings' defaults; the
generator's own refusals are tested with it (tests/unit/agent/wire/).
Each rule is shown to fail on a parser planted with its defect.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent.node import config as agent_config
from supervisor import config as supervisor_config
from supervisor.cli import main as resurgo_main
from supervisor.cli import submit

# `resurgo submit` parses its own words (sbatch's pass through), with a parser of its own.
ENTRY_POINTS: dict[str, Callable[[], argparse.ArgumentParser]] = {
    "resurgo": resurgo_main.build_parser,
    "resurgo submit": submit.build_parser,
    "resurgo-supervisor": supervisor_config.build_parser,
    "resurgo-agent": agent_config.build_parser,
}
MARKUP = re.compile(r":[a-z]+(?::[a-z]+)?:`|``")
DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)
SHOWN_DEFAULT = re.compile(r"\s*\(default[: ][^)]*\)", re.IGNORECASE)
# Their default is what leaving them out means, not a value to show.
SELF_EVIDENT = (
    argparse._HelpAction,
    argparse._VersionAction,
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._StoreConstAction,
    argparse._CountAction,
    argparse._SubParsersAction,
)


def walk(
    name: str, parser: argparse.ArgumentParser, listed: str | None = None
) -> Iterator[tuple[str, argparse.ArgumentParser, str | None]]:
    """(command, parser, its line in the parent's list) for ``parser`` and every
    subcommand; the line is None for an entry point (no parent), "" when missing."""
    yield name, parser, listed
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            lines = {choice.dest: choice.help for choice in action._choices_actions}
            for command, child in action.choices.items():
                yield from walk(f"{name} {command}", child, lines.get(command) or "")


def every_parser() -> dict[str, tuple[argparse.ArgumentParser, str | None]]:
    """Each command's parser and its line in its parent's list."""
    found: dict[str, tuple[argparse.ArgumentParser, str | None]] = {}
    for root, build in ENTRY_POINTS.items():
        for name, parser, listed in walk(root, build()):
            # `resurgo --help` lists `resurgo submit`; its own parser prints its --help.
            earlier = found.get(name)
            found[name] = (parser, listed if earlier is None else earlier[1])
    return found


def helps(parser: argparse.ArgumentParser) -> Iterator[tuple[argparse.Action, str]]:
    """Each argument with a help text, as ``--help`` prints it (``%(default)s`` expanded)."""
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help and action.help is not argparse.SUPPRESS:
            yield action, formatter._expand_help(action)


def label(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


def shared_texts(parser: argparse.ArgumentParser) -> list[str]:
    """Arguments whose help, its shown default aside, is another argument's."""
    first: dict[str, str] = {}
    problems = []
    for action, text in helps(parser):
        sentence = SHOWN_DEFAULT.sub("", text).strip()
        if sentence in first:
            problems.append(f"{label(action)} says what {first[sentence]} says: {sentence!r}")
        first.setdefault(sentence, label(action))
    return problems


def markup(parser: argparse.ArgumentParser, listed: str | None) -> list[str]:
    """Sphinx roles or literal quotes in the description, the list line or a help."""
    texts = [("description", parser.description or ""), ("listed", listed or "")]
    texts += [(label(action), text) for action, text in helps(parser)]
    return [f"{where}: {text!r}" for where, text in texts if MARKUP.search(text)]


def defaults_shown(parser: argparse.ArgumentParser) -> list[str]:
    """Arguments that show a default twice, or have one and do not show it."""
    problems = []
    for action in parser._actions:
        if isinstance(action, SELF_EVIDENT):
            continue
        text = dict(helps(parser)).get(action, "")
        said = len(DEFAULT.findall(text))
        if said > 1:
            problems.append(f"{label(action)} shows its default {said} times: {text!r}")
        elif said == 0 and action.default not in (None, argparse.SUPPRESS):
            problems.append(f"{label(action)} hides its default {action.default!r}: {text!r}")
    return problems


def undescribed(name: str, parser: argparse.ArgumentParser, listed: str | None) -> list[str]:
    """No description under ``usage``, or (a subcommand) no line in the parent's list."""
    problems = [] if parser.description else [f"{name}: no description"]
    if listed == "":
        problems.append(f"{name}: no line in its parent's list of commands")
    return problems


def problems_of(name: str, parser: argparse.ArgumentParser, listed: str | None) -> list[str]:
    return [
        *shared_texts(parser),
        *markup(parser, listed),
        *defaults_shown(parser),
        *undescribed(name, parser, listed),
    ]


def test_the_walk_reaches_every_entry_point_and_nested_subcommand() -> None:
    names = set(every_parser())
    assert {"resurgo-supervisor", "resurgo-agent", "resurgo submit", "resurgo status"} <= names
    assert {"resurgo ckpt list", "resurgo ckpt release", "resurgo simulate"} <= names
    assert len(names) >= 17


@pytest.mark.parametrize("name", sorted(every_parser()))
def test_every_help_says_each_thing_once_plainly_and_describes_its_command(name: str) -> None:
    parser, listed = every_parser()[name]
    assert problems_of(name, parser, listed) == []
    parser.format_help()  # a stray % in any text would break --help itself


# The planted defects: each parser breaks one rule, and only that rule's check sees it.


def planted(**kwargs: Any) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(**{"prog": "planted", "description": "A parser.", **kwargs})


def test_two_flags_with_one_text_fail_even_with_different_defaults() -> None:
    parser = planted()
    parser.add_argument("--backoff-base-s", help="the wait before a relaunch (default: 10)")
    parser.add_argument("--backoff-max-s", help="the wait before a relaunch (default: 600)")
    assert shared_texts(parser) == [
        "--backoff-max-s says what --backoff-base-s says: 'the wait before a relaunch'"
    ]
    assert problems_of("planted", parser, None) == shared_texts(parser)


def test_a_sphinx_role_or_literal_quotes_fail_wherever_they_are() -> None:
    parser = planted(description="See ``resurgo status``.")
    parser.add_argument("--factor", help="a straggler (:mod:`supervisor.core.stragglers`)")
    parser.add_argument("--model", help="the class (:class:`~a.B`)")
    found = markup(parser, "a listed line with :func:`f`")
    assert [problem.split(":")[0] for problem in found] == [
        "description",
        "listed",
        "--factor",
        "--model",
    ]
    assert problems_of("planted", parser, "a listed line with :func:`f`") == found


def test_a_default_shown_twice_or_not_at_all_fails() -> None:
    parser = planted()
    parser.add_argument(
        "--log-json", help="JSON lines (default: when stderr is no terminal) (default: auto)"
    )
    parser.add_argument("--unit", type=int, default=1, help="the world size is a multiple of it")
    twice = planted(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    twice.add_argument("--seed", default=0, help="random seed (default: 0)")
    found = defaults_shown(parser) + defaults_shown(twice)
    assert [problem.split(" ")[0:3] for problem in found] == [
        ["--log-json", "shows", "its"],
        ["--unit", "hides", "its"],
        ["--seed", "shows", "its"],
    ]
    assert problems_of("planted", parser, None) + problems_of("planted", twice, None) == found


def test_a_default_shown_once_or_a_flag_without_one_passes() -> None:
    parser = planted()
    parser.add_argument("--unit", type=int, default=1, help="a multiple of it (default: 1)")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--job", help="the job (default: all)")
    parser.add_argument("--name", help="the name")
    assert problems_of("planted", parser, None) == []


def test_a_command_without_a_description_or_a_line_in_its_parents_list_fails() -> None:
    parser = planted()
    commands = parser.add_subparsers()
    commands.add_parser("bare")
    commands.add_parser("told", help="a line in the list", description="What it does.")
    found = {name: problems_of(name, child, line) for name, child, line in walk("planted", parser)}
    assert found == {
        "planted": [],
        "planted bare": [
            "planted bare: no description",
            "planted bare: no line in its parent's list of commands",
        ],
        "planted told": [],
    }
