"""The three console scripts exist and answer --help."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = ("resurgo", "resurgo-supervisor", "resurgo-agent")


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help_exits_zero(script: str) -> None:
    path = Path(sys.executable).parent / script
    executable = str(path) if path.exists() else shutil.which(script)
    assert executable, f"{script} is not installed: run deploy/setup"
    done = subprocess.run(
        [executable, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert f"usage: {script}" in done.stdout


def test_resurgo_without_a_command_prints_help_and_exits_two() -> None:
    from supervisor.cli.main import main

    assert main([]) == 2
