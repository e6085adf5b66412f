"""The pure modules import nothing that touches the OS, network, clock or database.

Decision and format code takes ``now`` and data as arguments; this keeps it
testable with a fixed clock and free of hidden effects (STYLE.md §2).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PURE_MODULES = (
    "agent/checkpoint/format.py",
    "agent/protocol.py",
    "agent/launch.py",
    "supervisor/slurm/parse.py",
    "agent/checkpoint/interval.py",
    "agent/train/sampler.py",
)
FORBIDDEN = {"subprocess", "socket", "sqlite3", "psutil", "time", "os", "shutil", "aiohttp"}


def imported_roots(source: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_nothing_effectful(module: str) -> None:
    roots = imported_roots((REPO / module).read_text())
    assert not roots & FORBIDDEN, f"{module} imports {sorted(roots & FORBIDDEN)}"


def test_agent_never_imports_supervisor() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "agent").rglob("*.py")
        if "supervisor" in imported_roots(path.read_text())
    ]
    assert offenders == []


def test_the_purity_check_sees_a_forbidden_import() -> None:
    assert "time" in imported_roots("import time\n")
    assert "subprocess" in imported_roots("from subprocess import run\n")
