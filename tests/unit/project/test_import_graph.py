"""No import circles anywhere in the project.

Every import statement counts: at module level, inside functions, and under
``TYPE_CHECKING``. A late import inside a function hides a circle from the
interpreter, not from a reader following the code. ``from package import
name`` is an edge to the module ``package.name`` when there is one, else to
the package's ``__init__``. A submodule's implicit import of its own package
is not an edge: that is how Python loads packages, and a package's
``__init__`` that re-exports its modules is no circle.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGES = ("agent", "supervisor", "bench", "tests")


def modules_under(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the packages."""
    found = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            dotted = ".".join(path.relative_to(root).with_suffix("").parts)
            found[dotted.removesuffix(".__init__")] = path
    return found


def _imported(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The project modules one import statement names (absolute or relative)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            parts = module.split(".") if is_package else module.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, *([node.module] if node.module else [])])
        targets = [
            f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
            for alias in node.names
        ]
    else:
        return []
    edges = []
    for target in targets:
        while target and target not in known:  # ``import a.b.c`` of a name inside a.b
            target = target.rpartition(".")[0]
        if target and target != module:
            edges.append(target)
    return edges


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    known = modules_under(root, packages)
    graph: dict[str, set[str]] = {module: set() for module in known}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            graph[module].update(_imported(node, module, path.name == "__init__.py", known))
    return graph


def circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle (its modules, sorted), or [] when there is none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return sorted(set(error.args[1]))
    return []


def test_the_project_has_no_import_circle() -> None:
    found = circle(import_graph(REPO, PACKAGES))
    assert found == [], (
        f"import circle: {' <-> '.join(found)}: move what they share to a module below them"
    )


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # the circle the decision core had: a late import inside a function
        (
            {
                "pkg/__init__.py": "",
                "pkg/policy.py": "from pkg import recovery\n",
                "pkg/recovery.py": "def f():\n    from pkg.policy import Decision\n",
            },
            ["pkg.policy", "pkg.recovery"],
        ),
        # under TYPE_CHECKING, and around a ring of three
        (
            {
                "pkg/__init__.py": "",
                "pkg/a.py": "import pkg.b\n",
                "pkg/b.py": "from . import c\n",
                "pkg/c.py": (
                    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import X\n"
                ),
            },
            ["pkg.a", "pkg.b", "pkg.c"],
        ),
        # a package re-exporting its modules, which import each other downward: none
        (
            {
                "pkg/__init__.py": "from pkg.store import Store\nfrom pkg.rows import Row\n",
                "pkg/store.py": "from pkg.rows import Row\nfrom pkg import rows\n",
                "pkg/rows.py": "import json\n",
            },
            [],
        ),
    ],
)
def test_the_check_finds_a_circle_however_it_is_imported(
    tmp_path: Path, files: dict[str, str], expected: list[str]
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert circle(import_graph(tmp_path, ("pkg",))) == expected


def imports_of_test_modules(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a test module (a ``test_*.py`` file), as ``importer -> imported``."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if target.rpartition(".")[2].startswith("test_")
    )


def test_no_module_imports_a_test_module() -> None:
    found = imports_of_test_modules(import_graph(REPO, ("tests",)))
    assert found == [], (
        f"test modules imported: {', '.join(found)}: move what is shared to tests/fakes/ "
        "(a fake) or to a module of the test folder whose name does not start with test_"
    )


@pytest.mark.parametrize(
    "text",
    [
        "from tests.unit.test_a import helper\n",
        "from tests.unit import test_a\n",
        "def f():\n    import tests.unit.test_a\n",
        "from .test_a import helper\n",
    ],
    ids=["a-name-from-it", "it-from-its-package", "late-inside-a-function", "relatively"],
)
def test_the_check_finds_a_test_module_imported_however_it_is_imported(
    tmp_path: Path, text: str
) -> None:
    files = {
        "tests/__init__.py": "",
        "tests/unit/__init__.py": "",
        "tests/unit/test_a.py": "def helper(): ...\n",
        "tests/unit/world.py": "",
        "tests/unit/test_b.py": "from tests.unit.world import x\n" + text,
    }
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    graph = import_graph(tmp_path, ("tests",))
    assert imports_of_test_modules(graph) == ["tests.unit.test_b -> tests.unit.test_a"]


# The agent's layers, bottom up: what every side shares (``agent.wire``: the wire
# protocol, the rank -> agent datagram, the environment the agent sets); the
# in-rank library (``agent.checkpoint``, then ``agent.train`` above it, started by
# ``agent.bootstrap``); the node agent (``agent.node``). A rule: (importer, what it
# must not import); each a package and everything in it.
LAYER_RULES = (
    ("agent.wire", ("agent.node", "agent.train", "agent.checkpoint", "agent.bootstrap")),
    ("agent.train", ("agent.node",)),
    ("agent.checkpoint", ("agent.node", "agent.train")),
    ("agent.bootstrap", ("agent.node",)),
)
# The one edge across: the bootstrap also starts in the torchrun that a wrapper
# script runs (not a rank), and fits it to the job with the node's launch code
# before that torchrun starts any rank.
ALLOWED_ACROSS = {("agent.bootstrap.sitecustomize", "agent.node.torchrunshim")}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_breaches(graph: dict[str, set[str]]) -> list[str]:
    """Each import that crosses the agent's layers the wrong way, as ``importer -> imported``."""
    return sorted(
        f"{module} -> {target}"
        for importer, forbidden in LAYER_RULES
        for module, targets in graph.items()
        if _within(module, importer)
        for target in targets
        if any(_within(target, package) for package in forbidden)
        and (module, target) not in ALLOWED_ACROSS
    )


def test_the_agent_layers_import_only_downward() -> None:
    found = layer_breaches(import_graph(REPO, ("agent",)))
    assert found == [], (
        f"imports across the agent's layers: {', '.join(found)}: move what both sides "
        "need into agent/wire (or agent/checkpoint, for agent/train)"
    )


@pytest.mark.parametrize(
    ("importer", "text", "expected"),
    [
        ("agent/wire/codec.py", "from agent.node.launch import X\n", "agent.node.launch"),
        (
            "agent/wire/codec.py",
            "def f():\n    import agent.train.heartbeat\n",
            "agent.train.heartbeat",
        ),
        ("agent/wire/codec.py", "from agent.checkpoint import files\n", "agent.checkpoint.files"),
        ("agent/train/session.py", "from agent.node import launch\n", "agent.node.launch"),
        (
            "agent/checkpoint/save.py",
            "from agent.train.heartbeat import X\n",
            "agent.train.heartbeat",
        ),
        ("agent/checkpoint/save.py", "from agent.node.launch import X\n", "agent.node.launch"),
        (
            "agent/bootstrap/sitecustomize.py",
            "from agent.node import launch\n",
            "agent.node.launch",
        ),
    ],
)
def test_the_layer_check_finds_an_import_the_wrong_way(
    tmp_path: Path, importer: str, text: str, expected: str
) -> None:
    for name in (
        "agent/__init__.py", "agent/wire/__init__.py", "agent/wire/codec.py",
        "agent/node/__init__.py", "agent/node/launch.py", "agent/train/__init__.py",
        "agent/train/heartbeat.py", "agent/train/session.py", "agent/checkpoint/__init__.py",
        "agent/checkpoint/files.py", "agent/checkpoint/save.py", "agent/bootstrap/sitecustomize.py",
    ):  # fmt: skip
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    graph = import_graph(tmp_path, ("agent",))
    assert layer_breaches(graph) == []
    (tmp_path / importer).write_text(text)
    module = importer.removesuffix(".py").replace("/", ".")
    assert layer_breaches(import_graph(tmp_path, ("agent",))) == [f"{module} -> {expected}"]
