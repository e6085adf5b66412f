"""``resurgo``'s entry point loads the named subcommand's module only (supervisor.cli.main)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from supervisor.cli.main import SUBCOMMANDS, build_parser


def loaded_after(*words: str) -> set[str]:
    """The modules a fresh ``resurgo WORDS`` process has imported when it ends."""
    code = (
        "import sys\n"
        "from supervisor.cli.main import main\n"
        f"try:\n    main({list(words)!r})\nexcept SystemExit:\n    pass\n"
        "print(' '.join(sys.modules), file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return set(done.stderr.split("\n")[-2].split())


def test_a_view_command_loads_neither_the_http_client_nor_another_commands_module(
    tmp_path: Path,
) -> None:
    modules = loaded_after("status", "--state-dir", str(tmp_path))
    assert "supervisor.cli.status" in modules
    assert not {"aiohttp", "supervisor.cli.submit", "supervisor.cli.simulate"} & modules


def test_the_top_level_help_and_an_unknown_word_still_know_every_command() -> None:
    for words in ([], ["stauts"]):
        parser = build_parser(words[0] if words else None)
        (choices,) = [a.choices for a in parser._actions if a.dest == "command"]
        assert set(SUBCOMMANDS) <= set(choices)
    (choices,) = [a.choices for a in build_parser("nodes")._actions if a.dest == "command"]
    assert "nodes" in choices and "submit" not in choices
