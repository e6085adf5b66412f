"""The flags generator refuses a docstring that would make a wrong --help.

``add_flags`` takes each flag's text from the bullet of its field in the
settings class's docstring; these are the docstrings it must not turn into
help (tests/unit/project/test_help_texts.py checks the help it does make).
"""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from agent.wire.settings import add_flags, field_help, plain_text


def flags_of(cls: type) -> dict[str, str]:
    parser = argparse.ArgumentParser()
    add_flags(parser, cls)
    return {action.dest: action.help or "" for action in parser._actions if action.dest != "help"}


def test_each_field_gets_its_own_bullets_sentence_and_its_default_once() -> None:
    @dataclasses.dataclass(frozen=True)
    class Settings:
        """Two settings.

        - ``base_s``: the first wait, doubled per retry (up to ``max_s``);
          at most 100% of it.
        - ``max_s``: the longest wait (:func:`~agent.wire.settings.convert`).
        """

        base_s: float = 10.0
        max_s: float = 600.0

    assert flags_of(Settings) == {
        "base_s": "the first wait, doubled per retry (up to max_s); at most 100%% of it. "
        "(default: 10)",
        "max_s": "the longest wait (convert). (default: 600)",
    }


def test_one_bullet_for_two_fields_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Settings:
        """- ``host`` / ``port``: where the API listens (port 0: any)."""

        host: str = "0.0.0.0"
        port: int = 8740

    with pytest.raises(ValueError, match="describes host and port in one bullet"):
        field_help(Settings)


def test_a_field_without_a_bullet_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Settings:
        """- ``told``: a setting the docstring describes."""

        told: int = 1
        untold: float = 2.5

    with pytest.raises(ValueError, match="no bullet for untold"):
        field_help(Settings)


def test_two_fields_with_one_sentence_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Settings:
        """- ``cpu_s``: what validating may take.
        - ``wall_s``: what validating may take.
        """

        cpu_s: float = 1.0
        wall_s: float = 2.0

    with pytest.raises(ValueError, match="the same of cpu_s and wall_s"):
        field_help(Settings)


def test_a_sentence_that_states_a_default_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Settings:
        """- ``log_json``: JSON lines (default: only when stderr is not a terminal)."""

        log_json: str = "auto"

    with pytest.raises(ValueError, match="bullet for log_json speaks of a default"):
        field_help(Settings)


def test_a_bullet_for_no_field_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Settings:
        """- ``kept``: still a field.
        - ``renamed``: a field that is gone.
        """

        kept: int = 1

    with pytest.raises(ValueError, match="describes no field of it: \\['renamed'\\]"):
        field_help(Settings)


@pytest.mark.parametrize(
    ("text", "plain"),
    [
        ("(:mod:`supervisor.core.stragglers`)", "(supervisor.core.stragglers)"),
        (":class:`~supervisor.core.anomaly.WatchPolicy`", "WatchPolicy"),
        (":py:func:`a.b`, ``x = 1``", "a.b, x = 1"),
        ("no markup: 10%", "no markup: 10%"),
    ],
)
def test_plain_text_drops_sphinx_roles_and_literal_quotes(text: str, plain: str) -> None:
    assert plain_text(text) == plain
