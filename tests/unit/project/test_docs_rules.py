"""docs/operations.md's "Failure classes and rules" lists the built-in rules as the code does."""

from __future__ import annotations

from supervisor.core.failure_rules import DEFAULT_RULES, Action
from supervisor.failure_config import CLASS_ACTIONS
from tests.paths import REPO

OPERATIONS = REPO / "docs" / "operations.md"
SECTION = "## Failure classes and rules"


def section_tables(text: str) -> list[list[list[str]]]:
    """Every table of the section, as rows of cells (backticks stripped), headers left out."""
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    tables: list[list[list[str]]] = []
    rows: list[list[str]] | None = None
    for line in section.splitlines():
        if not line.startswith("|"):
            rows = None
            continue
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        if rows is None:
            rows = []
            tables.append(rows)
        elif not set("".join(cells)) <= set("- "):
            rows.append(cells)
    return tables


def test_the_rule_table_lists_every_default_rule_in_order_with_its_class_and_action() -> None:
    _, rules = section_tables(OPERATIONS.read_text())
    shown = [tuple(row[:4]) for row in rules]
    code = [
        (rule.name, rule.failure_class.value, rule.action.value,
         str(rule.budget) if rule.action is Action.RETRY else "-")
        for rule in DEFAULT_RULES
    ]  # fmt: skip
    assert shown == code, "the table must list DEFAULT_RULES in the order they are tried"


def test_the_class_table_gives_each_class_its_default_action() -> None:
    classes, _ = section_tables(OPERATIONS.read_text())
    code = [(failure.value, action.value) for failure, action in CLASS_ACTIONS.items()]
    assert [(row[0], row[1]) for row in classes] == code
