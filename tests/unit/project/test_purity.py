"""The pure modules import nothing that touches the OS, network, clock or database.

Decision and format code takes ``now`` and data as arguments; this keeps it
testable with a fixed clock and free of hidden effects (STYLE.md §2). A pure
module may import other project modules only if those are pure too.

The supervisor's decision core is pure by folder: every module in
``supervisor/core/`` is checked, including one added tomorrow. Pure modules
elsewhere (formats, parsers, text) are listed by name.
"""

from __future__ import annotations

import ast

import pytest

from tests.paths import REPO
from tests.unit.purity_rules import FORBIDDEN, imported_roots

PURE_FOLDERS = ("supervisor/core", "agent/wire/protocol")
PURE_FILES = (
    "agent/wire/errors.py",
    "agent/wire/datagram.py",
    "agent/wire/environ.py",
    "agent/checkpoint/format.py",
    "agent/checkpoint/report.py",
    "agent/checkpoint/interval.py",
    "agent/node/launch.py",
    "agent/node/hang.py",
    "agent/timelimit.py",
    "agent/skips.py",
    "agent/train/sampler.py",
    "supervisor/errors.py",
    "supervisor/slurm/parse.py",
    "supervisor/sbatch.py",
    "supervisor/store/rows.py",
    "supervisor/text.py",
    "agent/node/steps.py",
)
PURE_MODULES = tuple(
    sorted(
        {
            str(path.relative_to(REPO))
            for folder in PURE_FOLDERS
            for path in (REPO / folder).rglob("*.py")
        }
        | set(PURE_FILES)
    )
)


def _is_module(dotted: str) -> bool:
    path = REPO / dotted.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def project_imports(source: str) -> set[str]:
    """Project modules imported, as dotted names (``from agent import x`` -> ``agent.x``).

    ``from package import name`` names the module ``package.name`` when there
    is one, else the package itself (its ``__init__``).
    """
    modules: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: set[str] = set()
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = {
                f"{node.module}.{a.name}" if _is_module(f"{node.module}.{a.name}") else node.module
                for a in node.names
            }
        modules |= {name for name in names if name.split(".")[0] in ("agent", "supervisor")}
    return modules


def _dotted(path: str) -> str:
    """``supervisor/core/model.py`` -> ``supervisor.core.model``; a package by its folder's name."""
    return path[:-3].replace("/", ".").removesuffix(".__init__")


def test_the_core_folder_holds_the_decision_modules() -> None:
    core = {path for path in PURE_MODULES if path.startswith("supervisor/core/")}
    assert {"supervisor/core/policy.py", "supervisor/core/recovery.py"} <= core
    assert len(core) >= 15


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_nothing_effectful(module: str) -> None:
    roots = imported_roots((REPO / module).read_text())
    assert not roots & FORBIDDEN, f"{module} imports {sorted(roots & FORBIDDEN)}"


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_module_imports_only_pure_project_modules(module: str) -> None:
    pure = {_dotted(path) for path in PURE_MODULES}
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
    assert project_imports("from supervisor.act import executor\n") == {"supervisor.act.executor"}
    assert project_imports("from supervisor.store import Store\n") == {"supervisor.store"}
