"""The three console scripts exist and answer --help and --version; a module run as a program
(``python -m agent.driver``) has its ``__main__`` block last, since anything
defined after it does not exist yet when main() runs."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from agent.wire.protocol import PROTOCOL_VERSION
from tests.paths import REPO

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


@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_version_names_itself_and_the_release(script: str) -> None:
    path = Path(sys.executable).parent / script
    executable = str(path) if path.exists() else shutil.which(script)
    assert executable, f"{script} is not installed: run deploy/setup"
    done = subprocess.run(
        [executable, "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    release = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{script} {release} (wire protocol {PROTOCOL_VERSION})\n"


def test_resurgo_without_a_command_prints_help_and_exits_two() -> None:
    from supervisor.cli.main import main

    assert main([]) == 2


MODULES = sorted(
    path
    for package in ("agent", "supervisor", "bench")
    for path in (REPO / package).rglob("*.py")
    if "__main__" in path.read_text()
)


def _is_main_block(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_main_block_comes_last(path: Path) -> None:
    body = ast.parse(path.read_text()).body
    mains = [index for index, node in enumerate(body) if _is_main_block(node)]
    if mains:
        after = body[mains[0] + 1 :]
        assert not after, f"{path.name}: defined after the __main__ block, line {after[0].lineno}"


@pytest.mark.parametrize(
    "module",
    ["agent.node.agent", "agent.driver.loop", "agent.node.rankexec", "supervisor.cli.main"],
)
def test_what_starts_each_attempt_does_not_import_torch(module: str) -> None:
    """The driver and every node's agent start on each attempt, on CPUs the ranks
    also need: importing torch there cost ~10 s of a 2-core node's restart."""
    code = f"import sys, {module}; print([m for m in sys.modules if m.split('.')[0] == 'torch'])"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"{module} imports torch: {done.stdout}"
