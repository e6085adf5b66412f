"""The pure modules import nothing that touches the OS, network, clock or database.

Decision and format code takes ``now`` and data as arguments; this keeps it
testable with a fixed clock and free of hidden effects (STYLE.md §2). A pure
module may import other project modules only if those are pure too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PURE_MODULES = (
    "agent/errors.py",
    "agent/checkpoint/format.py",
    "agent/checkpoint/report.py",
    "agent/checkpoint/interval.py",
    "agent/protocol.py",
    "agent/launch.py",
    "agent/hang.py",
    "agent/timelimit.py",
    "agent/train/sampler.py",
    "supervisor/errors.py",
    "supervisor/slurm/parse.py",
    "supervisor/model.py",
    "supervisor/observations.py",
    "supervisor/intents.py",
    "supervisor/blame.py",
    "supervisor/recovery.py",
    "supervisor/policy.py",
    "supervisor/follow_slurm.py",
    "supervisor/goodput.py",
    "supervisor/probation.py",
    "supervisor/verify.py",
    "supervisor/sbatch.py",
    "supervisor/planned_stop.py",
    "supervisor/silence.py",
    "supervisor/simulate.py",
    "supervisor/stragglers.py",
    "supervisor/store/rows.py",
    "supervisor/text.py",
    "agent/steps.py",
)
# Project modules a pure module may import although they are not pure
# themselves: agent.train.heartbeat's message types (the hang verdicts read
# them; the module's socket code is never run by the pure one).
PURE_ENOUGH = {"agent.train.heartbeat"}
FORBIDDEN = {
    "subprocess", "socket", "sqlite3", "psutil", "time", "os", "shutil", "aiohttp",
    "datetime", "random", "threading", "asyncio",
}  # fmt: skip


def imported_roots(source: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def project_imports(source: str) -> set[str]:
    """Project modules imported, as dotted names (``from agent import x`` -> ``agent.x``)."""
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: set[str] = set()
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            bare = node.module in ("agent", "supervisor", "agent.checkpoint", "agent.train")
            names = {f"{node.module}.{a.name}" for a in node.names} if bare else {node.module}
        modules |= {name for name in names if name.split(".")[0] in ("agent", "supervisor")}
    return modules


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_nothing_effectful(module: str) -> None:
    roots = imported_roots((REPO / module).read_text())
    assert not roots & FORBIDDEN, f"{module} imports {sorted(roots & FORBIDDEN)}"


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_only_pure_project_modules(module: str) -> None:
    pure = {path[:-3].replace("/", ".") for path in PURE_MODULES} | PURE_ENOUGH
    impure = project_imports((REPO / module).read_text()) - pure
    assert not impure, f"{module} imports effectful project modules {sorted(impure)}"


def test_agent_never_imports_supervisor() -> None:
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "agent").rglob("*.py")
        if "supervisor" in imported_roots(path.read_text())
    ]
    assert offenders == []


def test_the_purity_check_sees_a_forbidden_or_impure_import() -> None:
    assert "time" in imported_roots("import time\n")
    assert "subprocess" in imported_roots("from subprocess import run\n")
    assert project_imports("from agent.checkpoint import validate\n") == {
        "agent.checkpoint.validate"
    }
