"""docs/operations.md states the same defaults as the code, so the two cannot drift."""

from __future__ import annotations

import dataclasses
import re
import tomllib
from typing import Any

from agent.node.config import AgentConfig
from agent.wire.settings import show_default
from supervisor.config import SupervisorConfig
from supervisor.core.policy import Policy
from tests.paths import REPO

OPERATIONS = REPO / "docs" / "operations.md"
UNITS = {"s": 1, "min": 60, "h": 3600, "d": 86400, "day": 86400, "days": 86400}


def defaults(cls: type) -> dict[str, Any]:
    return {field.name: field.default for field in dataclasses.fields(cls)}


def policy_table(text: str) -> dict[str, str]:
    """setting -> default, from the table under "### Policy settings"."""
    section = text.split("### Policy settings", 1)[1]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1]
        elif rows and not line.startswith("|"):
            break
    return rows


def test_the_policy_table_lists_every_setting_with_the_codes_default() -> None:
    table = policy_table(OPERATIONS.read_text())
    code = defaults(Policy)
    assert list(table) == list(code), "the table must list every policy setting, in order"
    for name, shown in table.items():
        assert shown == show_default(code[name]), f"{name}: docs say {shown}, code {code[name]!r}"


def test_the_policy_defaults_in_the_example_toml_are_the_codes() -> None:
    text = OPERATIONS.read_text()
    block = re.search(r"```toml\n(.*?)```", text, re.S)
    assert block is not None and "these are the defaults" in block.group(1)
    policy = tomllib.loads(block.group(1))["policy"]
    code = defaults(Policy)
    for name, value in policy.items():
        expected = getattr(code[name], "value", code[name])
        assert value == expected, f"[policy] {name} = {value!r}, the code's default is {expected!r}"


def test_every_default_the_prose_names_is_the_codes() -> None:
    """`name` (..., default 30 s): each such mention of a setting, wherever it is."""
    text = " ".join(OPERATIONS.read_text().split())
    known = {**defaults(AgentConfig), **defaults(SupervisorConfig), **defaults(Policy)}
    mentions = re.findall(
        r"`(\w+)`[^|.;]{0,60}?default (\d+(?:\.\d+)?)(?: (s|min|h|d|days?)\b)?", text
    )
    checked = 0
    for name, number, unit in mentions:
        if name not in known:
            continue
        value = float(number) * UNITS.get(unit, 1)
        assert value == float(known[name]), f"docs: {name} default {number} {unit}".strip()
        checked += 1
    assert checked >= 8  # the mentions this guide has: none may slip out of the pattern
