"""Where the store is when nobody said: the system path for root and the site-wide
service, the user's XDG state directory for a researcher who cannot use it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

import pytest

from supervisor.cli.common import add_state_dir
from supervisor.config import (
    DEFAULT_STATE_DIR,
    default_state_dir,
    load_config,
    this_users_state_dir,
)

USER = 1000
HOME = {"HOME": "/home/ada"}


@pytest.mark.parametrize(
    ("environ", "uid", "usable", "expected"),
    [
        # Root keeps today's default, whatever the environment says.
        ({**HOME, "XDG_STATE_HOME": "/x"}, 0, False, DEFAULT_STATE_DIR),
        ({**HOME}, 0, True, DEFAULT_STATE_DIR),
        # The site-wide unit's user (or an operator who may read the store) keeps it too.
        ({**HOME, "XDG_STATE_HOME": "/x"}, USER, True, DEFAULT_STATE_DIR),
        # A researcher who cannot use it gets their own directory.
        ({**HOME, "XDG_STATE_HOME": "/scr/ada"}, USER, False, "/scr/ada/resurgo"),
        ({**HOME}, USER, False, "/home/ada/.local/state/resurgo"),
        ({**HOME, "XDG_STATE_HOME": ""}, USER, False, "/home/ada/.local/state/resurgo"),
        # The XDG specification ignores a relative XDG_STATE_HOME.
        ({**HOME, "XDG_STATE_HOME": "state"}, USER, False, "/home/ada/.local/state/resurgo"),
        # No home to put it in: the system path, and its error names it.
        ({}, USER, False, DEFAULT_STATE_DIR),
        ({"HOME": "relative"}, USER, False, DEFAULT_STATE_DIR),
    ],
)
def test_the_default_state_dir_is_the_system_one_unless_this_user_cannot_use_it(
    environ: Mapping[str, str], uid: int, usable: bool, expected: str
) -> None:
    assert default_state_dir(environ, uid, system_dir_usable=usable) == expected


def test_an_explicit_state_dir_wins_over_the_per_user_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Whoever runs the tests: pretend to be a researcher with no usable system path.
    monkeypatch.setattr("supervisor.config.os.geteuid", lambda: USER)
    monkeypatch.setattr("supervisor.config.os.access", lambda path, mode: False)
    environ = {"XDG_STATE_HOME": "/home/ada/.local/state"}
    config, _ = load_config([], environ)
    assert config.state_dir == "/home/ada/.local/state/resurgo"
    config, _ = load_config([], {**environ, "RESURGO_STATE_DIR": "/srv/a"})
    assert config.state_dir == "/srv/a"
    config, _ = load_config([], {**environ, "RESURGO_SUPERVISOR_STATE_DIR": "/srv/b"})
    assert config.state_dir == "/srv/b"
    config, _ = load_config(["--state-dir", "/srv/c"], environ)
    assert config.state_dir == "/srv/c"


def test_root_running_the_supervisor_keeps_the_system_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("supervisor.config.os.geteuid", lambda: 0)
    config, _ = load_config([], {"XDG_STATE_HOME": "/root/.local/state"})
    assert config.state_dir == DEFAULT_STATE_DIR


def test_the_commands_look_in_the_researchers_own_state_dir_when_the_system_one_is_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("supervisor.config.os.geteuid", lambda: USER)
    monkeypatch.setattr("supervisor.config.os.access", lambda path, mode: False)
    monkeypatch.delenv("RESURGO_STATE_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", "/home/ada/.local/state")
    parser = argparse.ArgumentParser()
    add_state_dir(parser)
    assert parser.parse_args([]).state_dir == "/home/ada/.local/state/resurgo"
    monkeypatch.setenv("RESURGO_STATE_DIR", "/srv/a")
    parser = argparse.ArgumentParser()
    add_state_dir(parser)
    assert parser.parse_args([]).state_dir == "/srv/a"


def test_a_user_who_may_only_enter_the_system_dir_keeps_it_for_commands_not_for_a_supervisor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A site-wide supervisor's state dir at 0701/2751: users may enter it (to reach
    # <state_dir>/jobs for `resurgo submit`), not list or write it.
    monkeypatch.setattr("supervisor.config.os.geteuid", lambda: USER)
    monkeypatch.setattr("supervisor.config.os.path.isdir", lambda path: True)
    monkeypatch.setattr("supervisor.config.os.access", lambda path, mode: mode == os.X_OK)
    environ = {"XDG_STATE_HOME": "/home/ada/.local/state"}
    assert this_users_state_dir(environ, write=False) == DEFAULT_STATE_DIR
    assert this_users_state_dir(environ, write=True) == "/home/ada/.local/state/resurgo"
