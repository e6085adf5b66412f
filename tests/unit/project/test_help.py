"""Every flag of the daemons says in --help what it sets and what its default is."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from agent.node import config as agent_config
from agent.wire.settings import add_flags, show_default
from supervisor import config as supervisor_config
from supervisor.core.policy import Policy

PARSERS = {
    "resurgo-supervisor": supervisor_config.build_parser,
    "resurgo-agent": agent_config.build_parser,
}
DEFAULT = re.compile(r"\(default: [^)]+\)$")


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action
        for action in parser._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction | argparse._VersionAction)
    ]


@pytest.mark.parametrize("program", sorted(PARSERS))
def test_every_flag_has_a_sentence_and_its_default_in_help(program: str) -> None:
    parser = PARSERS[program]()
    flags = options(parser)
    assert len(flags) > 10
    for action in flags:
        flag = action.option_strings[0]
        text = action.help or ""
        assert DEFAULT.search(text), f"{program} {flag}: no default in its help {text!r}"
        sentence = DEFAULT.sub("", text).strip()
        assert len(sentence.split()) >= 3, f"{program} {flag}: no sentence in its help {text!r}"
    # argparse renders it: a stray % in a sentence would break --help itself.
    assert "default: " in parser.format_help()


def test_the_default_shown_is_the_fields_own() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, Policy, "policy-")
    shown = {action.dest: action.help for action in options(parser)}
    for field in dataclasses.fields(Policy):
        expected = f"(default: {show_default(field.default)})"
        assert shown[f"policy_{field.name}"].endswith(expected)
    assert shown["policy_max_drain_share_per_hour"].endswith("(default: 0.1)")
    assert shown["policy_lemon_window_s"].endswith("(default: 604800)")
    assert shown["policy_validation_level"].endswith("(default: full)")
    assert shown["policy_grow_back"].endswith("(default: true)")
