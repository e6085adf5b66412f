"""What counts as a decision outside the core (STYLE.md §5), read from a module's AST.

Shared by ``test_decisions_in_core.py``. A module outside ``supervisor/core/``
may observe (turn what it hears into values), persist, act on what the core
decided, and format; it may not decide. :func:`decisions` reports each place
in a module's source that decides anyway, by three rules:

- **intent**: a call that constructs an intent class of
  :mod:`supervisor.core.intents` (``DrainNode(...)``, ``RelaunchStep(...)``, ...):
  what to do to a job or the cluster is the core's to say;
- **record**: a call that constructs a ``JobRecord``, or ``replace(...)`` /
  ``dataclasses.replace(...)`` whose first argument names a record (a name or
  attribute ``record``, ``before`` or ``after``): a job's record changes only
  in the core;
- **branch**: a test (of ``if``, ``elif``, ``while``, a conditional
  expression, or a comprehension's ``if``), or a comparison anywhere else
  (``waiting = record.state in (...)``), that reads a job's state or a
  driver's question (an attribute of ``JobState`` or ``DriverPhase``, or a
  string constant equal to one of their values), or that orders
  (``<``, ``<=``, ``>``, ``>=``) anything against a ``policy`` attribute or
  against arithmetic on the clock (``now``, ``now_s``, or a call to
  ``clock()``, ``time.time()`` or ``time.monotonic()``): the core's thresholds
  and deadlines.

A test that only reads whether a state is terminal (``state.terminal``),
compares a verdict the core returned, or orders values that are not the
clock's or the policy's is not a decision: that is how the components filter
what they observe and act on what they were told.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from dataclasses import dataclass

from agent.wire.protocol import DriverPhase
from supervisor.core import intents
from supervisor.core.model import JobState

# Every intent class the core emits.
INTENT_NAMES = frozenset(
    name
    for name, value in vars(intents).items()
    if inspect.isclass(value)
    and issubclass(value, intents._Action)
    and value is not intents._Action
)
# Enums whose members are the core's to branch on, and their values as text.
STATE_ENUMS = frozenset({"JobState", "DriverPhase"})
STATE_TEXTS = frozenset(
    {member.value for member in JobState} | {member.value for member in DriverPhase}
)
RECORD_NAMES = frozenset({"record", "before", "after"})
CLOCK_NAMES = frozenset({"now", "now_s"})
CLOCK_CALLS = frozenset({"clock", "time", "monotonic"})
_ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


@dataclass(frozen=True)
class Finding:
    """One decision outside the core: the rule, the line, and the enclosing function."""

    rule: str
    line: int
    function: str
    text: str


def decisions(source: str) -> list[Finding]:
    """Every place ``source`` decides what the core should (see the module docstring)."""
    tree = ast.parse(source)
    found: list[Finding] = []
    in_tests = {
        id(inner)
        for _, node in _walk(tree, "<module>")
        if isinstance(node, _Test)
        for inner in ast.walk(node.test)
    }
    for function, node in _walk(tree, "<module>"):
        if isinstance(node, ast.Compare) and id(node) in in_tests:
            continue  # judged with the test it is part of
        if isinstance(node, ast.Compare):
            node = _Test(node)
        rule = _rule(node)
        if rule is not None:
            shown = node.test if isinstance(node, _Test) else node
            found.append(Finding(rule, node.lineno, function, ast.unparse(shown)[:120]))
    return found


def _walk(node: ast.AST, function: str) -> Iterator[tuple[str, ast.expr]]:
    """Each call, test expression and comparison, with the name of the function it is in."""
    for child in ast.iter_child_nodes(node):
        inner = function
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            inner = child.name
        if isinstance(child, ast.Call | ast.Compare):
            yield inner, child
        if isinstance(child, ast.If | ast.While | ast.IfExp):
            yield inner, _Test(child.test)
        if isinstance(child, ast.comprehension):
            for test in child.ifs:
                yield inner, _Test(test)
        yield from _walk(child, inner)


class _Test(ast.expr):
    """A branch's test, marked so :func:`_rule` reads it as one."""

    def __init__(self, test: ast.expr) -> None:
        super().__init__()
        self.test = test
        self.lineno = test.lineno


def _rule(node: ast.expr) -> str | None:
    if isinstance(node, _Test):
        return "branch" if _decides(node.test) else None
    assert isinstance(node, ast.Call)
    name = _called(node.func)
    if name in INTENT_NAMES:
        return "intent"
    if name == "JobRecord":
        return "record"
    if name == "replace" and node.args and _names_record(node.args[0]):
        return "record"
    return None


def _called(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _names_record(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in RECORD_NAMES
    return isinstance(node, ast.Attribute) and node.attr in RECORD_NAMES


def _decides(test: ast.expr) -> bool:
    for node in ast.walk(test):
        owner = node.value if isinstance(node, ast.Attribute) else None
        if isinstance(owner, ast.Name) and owner.id in STATE_ENUMS:
            return True
        if isinstance(node, ast.Constant) and node.value in STATE_TEXTS:
            return True
        if isinstance(node, ast.Compare) and any(isinstance(op, _ORDERING) for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(_reads_policy(each) or _clock_arithmetic(each) for each in operands):
                return True
    return False


def _reads_policy(node: ast.expr) -> bool:
    for each in ast.walk(node):
        if not isinstance(each, ast.Attribute):
            continue
        owner = each.value
        if isinstance(owner, ast.Name) and owner.id == "policy":
            return True
        if isinstance(owner, ast.Attribute) and owner.attr == "policy":
            return True
    return False


def _clock_arithmetic(node: ast.expr) -> bool:
    for each in ast.walk(node):
        if isinstance(each, ast.BinOp) and any(_is_clock(side) for side in (each.left, each.right)):
            return True
    return False


def _is_clock(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in CLOCK_NAMES
    return isinstance(node, ast.Call) and _called(node.func) in CLOCK_CALLS
