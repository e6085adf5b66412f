"""One Slurm interface: the client implements it, and nobody keeps a copy of it.

Users of Slurm depend on :mod:`supervisor.slurm.interface` by type so that
tests pass small fakes; the Protocols live there only, and
:class:`~supervisor.slurm.client.SlurmClient` must answer every call with the
same signature (a fake written from the Protocol then fits the real thing).
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any, Generic, Protocol

import pytest

from supervisor.slurm.client import SlurmClient
from supervisor.slurm.interface import Slurm
from tests.paths import REPO

SUPERVISOR = REPO / "supervisor"
SLURM_PACKAGE = SUPERVISOR / "slurm"
INTERFACE = SLURM_PACKAGE / "interface.py"


def interface_calls() -> dict[str, Callable[..., Any]]:
    """Every call of the Slurm interface, from all its roles, by name."""
    calls: dict[str, Callable[..., Any]] = {}
    for cls in Slurm.__mro__:
        if cls in (Protocol, Generic, object):
            continue
        for name, value in vars(cls).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                calls.setdefault(name, value)
    return calls


CALLS = interface_calls()


def supervisor_modules(leaving_out: Path) -> list[Path]:
    """The supervisor's modules, less ``leaving_out`` (a module or a package)."""
    return sorted(path for path in SUPERVISOR.rglob("*.py") if not path.is_relative_to(leaving_out))


def is_protocol_class(node: ast.ClassDef) -> bool:
    """Whether ``node`` lists ``Protocol`` (or ``typing.Protocol``) among its bases."""
    for base in node.bases:
        target = base.value if isinstance(base, ast.Subscript) else base
        if isinstance(target, ast.Name) and target.id == "Protocol":
            return True
        if isinstance(target, ast.Attribute) and target.attr == "Protocol":
            return True
    return False


def test_the_interface_has_the_calls_its_users_make() -> None:
    assert {"jobs", "job", "nodes", "drain", "resume", "requeue_smaller", "cancel"} <= set(CALLS)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_slurm_client_answers_each_call_with_the_interfaces_signature(name: str) -> None:
    implemented = getattr(SlurmClient, name, None)
    assert implemented is not None, f"SlurmClient has no {name}() of the Slurm interface"
    assert inspect.iscoroutinefunction(implemented), f"SlurmClient.{name} is not async"
    wanted = inspect.signature(CALLS[name], eval_str=True)
    found = inspect.signature(implemented, eval_str=True)
    assert found == wanted, f"SlurmClient.{name}{found} differs from the interface's {wanted}"


def test_every_public_call_of_slurm_client_is_in_the_interface() -> None:
    public = {
        name
        for name, value in vars(SlurmClient).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }
    assert public - set(CALLS) == set(), "add these calls to supervisor/slurm/interface.py"


def test_no_module_but_the_interface_declares_a_slurm_protocol() -> None:
    copies = []
    for path in supervisor_modules(leaving_out=INTERFACE):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ClassDef) or not is_protocol_class(node):
                continue
            methods = {
                item.name
                for item in node.body
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            }
            if shared := methods & set(CALLS):
                copies.append(f"{path.relative_to(REPO)}: {node.name} {sorted(shared)}")
    assert copies == [], "use supervisor.slurm.interface instead of a copy: " + "; ".join(copies)


def test_users_of_slurm_name_the_interface_not_the_client_class() -> None:
    annotated = []
    for path in supervisor_modules(leaving_out=SLURM_PACKAGE):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            annotations: list[ast.expr | None] = []
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                arguments = node.args
                every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
                every += [a for a in (arguments.vararg, arguments.kwarg) if a is not None]
                annotations += [argument.annotation for argument in every]
                annotations.append(node.returns)
            elif isinstance(node, ast.AnnAssign):
                annotations.append(node.annotation)
            for annotation in annotations:
                if annotation is not None and "SlurmClient" in ast.unparse(annotation):
                    annotated.append(f"{path.relative_to(REPO)}:{annotation.lineno}")
    hint = "annotate with supervisor.slurm.Slurm or one of its roles: "
    assert annotated == [], hint + ", ".join(annotated)
