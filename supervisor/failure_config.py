"""The operator's failure rules: ``[[failure_rules]]`` tables of the supervisor's TOML.

Each table is one rule (:class:`supervisor.core.failure_rules.Rule`), tried in
the file's order before the built-in rules, so a site can add a signature the
defaults miss or override one::

    [[failure_rules]]
    name = "bad-hbm"                     # shown in verdicts, events, drain reasons
    class = "hardware"                   # user_error, oom, storage, network, hardware, unknown
    match_log = "HBM uncorrectable"      # a regular expression over the evidence's lines
    # optional: action (stop, retry, wait_storage, blame_node, default; the class's own
    # by default), budget (retries, for retry), confidence (0-1, default 0.9),
    # match_exit_code, match_signal (numbers or names), match_exception (type names),
    # match_errno (numbers or names such as "ENOSPC"), at_start (only before the first step)

Every rule is checked at start; a mistake stops the supervisor with a message
naming the rule, the key and what is allowed. ``resurgo-supervisor
--print-rules`` lists the rules in force, the operator's first.
"""

from __future__ import annotations

import errno as errnos
import re
import signal as signals
from collections.abc import Sequence
from typing import Any

from agent.wire.errors import ConfigError
from supervisor.core.failure_rules import DEFAULT_RULES, Action, FailureClass, Rule

# The action a class takes when a rule names none, and the budget of a retry.
CLASS_ACTIONS = {
    FailureClass.USER_ERROR: Action.STOP,
    FailureClass.OOM: Action.RETRY,
    FailureClass.STORAGE: Action.WAIT_STORAGE,
    FailureClass.NETWORK: Action.DEFAULT,
    FailureClass.HARDWARE: Action.BLAME_NODE,
    FailureClass.UNKNOWN: Action.DEFAULT,
}
RETRY_BUDGET = 1
KEYS = frozenset({
    "name", "class", "action", "budget", "confidence", "match_exit_code", "match_signal",
    "match_exception", "match_errno", "match_log", "at_start",
})  # fmt: skip
MATCH_KEYS = ("match_exit_code", "match_signal", "match_exception", "match_errno", "match_log")


def parse_rules(tables: object, source: str) -> tuple[Rule, ...]:
    """The operator's rules from the ``failure_rules`` array of ``source``; ConfigError
    naming the rule and key on any mistake."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"{source}: failure_rules must be an array of tables ([[failure_rules]])")
    rules = tuple(_rule(table, f"{source}: [[failure_rules]] #{i + 1}")
                  for i, table in enumerate(tables))  # fmt: skip
    names = [rule.name for rule in rules]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ConfigError(f"{source}: failure rule names must differ; given twice: {twice}")
    return rules


def in_force(operator: Sequence[Rule]) -> tuple[Rule, ...]:
    """The rules the supervisor classifies with: the operator's first, then the defaults."""
    return (*operator, *DEFAULT_RULES)


def _rule(table: dict[str, Any], where: str) -> Rule:
    unknown = sorted(set(table) - KEYS)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(KEYS)}")
    name = table.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise ConfigError(f"{where}: name must be 1-64 letters, digits, '-', '_' or '.'")
    where = f"{where} ({name})"
    failure_class = _choice(table.get("class"), FailureClass, "class", where,
                            allowed=tuple(CLASS_ACTIONS))  # fmt: skip
    action = (
        _choice(table["action"], Action, "action", where, allowed=tuple(Action))
        if "action" in table
        else CLASS_ACTIONS[failure_class]
    )
    budget = table.get("budget", RETRY_BUDGET if action is Action.RETRY else 0)
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= 100:
        raise ConfigError(f"{where}: budget must be a whole number from 0 to 100")
    confidence = table.get("confidence", 0.9)
    if isinstance(confidence, bool) or not isinstance(confidence, int | float) \
            or not 0 <= confidence <= 1:  # fmt: skip
        raise ConfigError(f"{where}: confidence must be a number from 0 to 1")
    at_start = table.get("at_start", False)
    if not isinstance(at_start, bool):
        raise ConfigError(f"{where}: at_start must be true or false")
    if not any(key in table for key in MATCH_KEYS):
        raise ConfigError(
            f"{where}: a rule must match something, or it would classify every failure: "
            f"give at least one of {', '.join(MATCH_KEYS)}"
        )
    return Rule(
        name=name,
        failure_class=failure_class,
        action=action,
        budget=budget,
        confidence=float(confidence),
        exit_codes=_numbers(table, "match_exit_code", where, lambda v: None),
        signals=_numbers(table, "match_signal", where, _signal_number),
        exceptions=_names(table, "match_exception", where),
        errnos=_numbers(table, "match_errno", where, _errno_number),
        pattern=_pattern(table, where),
        at_start=at_start,
        operator=True,
    )


def _choice(value: object, kind: Any, key: str, where: str, allowed: tuple[Any, ...]) -> Any:
    words = [member.value for member in allowed]
    if not isinstance(value, str) or value not in words:
        raise ConfigError(f"{where}: {key} must be one of {words}, got {value!r}")
    return kind(value)


def _listed(table: dict[str, Any], key: str) -> list[object]:
    value = table.get(key, [])
    return value if isinstance(value, list) else [value]


def _numbers(table: dict[str, Any], key: str, where: str, by_name: Any) -> frozenset[int]:
    found = set()
    for item in _listed(table, key):
        number = by_name(item) if isinstance(item, str) else item
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number < 1 << 16:
            raise ConfigError(f"{where}: {key} holds {item!r}, not a number this key knows")
        found.add(number)
    return frozenset(found)


def _signal_number(name: str) -> int | None:
    try:
        return int(signals.Signals[name if name.startswith("SIG") else f"SIG{name}"])
    except KeyError:
        return None


def _errno_number(name: str) -> int | None:
    number = getattr(errnos, name, None)
    return number if isinstance(number, int) and name.startswith("E") else None


def _names(table: dict[str, Any], key: str, where: str) -> frozenset[str]:
    names = _listed(table, key)
    if not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ConfigError(f"{where}: {key} holds exception type names, such as 'OSError'")
    return frozenset(str(n) for n in names)


def _pattern(table: dict[str, Any], where: str) -> re.Pattern[str] | None:
    if "match_log" not in table:
        return None
    text = table["match_log"]
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: match_log must be a regular expression (a string)")
    try:
        return re.compile(text)
    except re.error as error:
        raise ConfigError(
            f"{where}: match_log {text!r} is no regular expression: {error}"
        ) from None


def rules_table(rules: Sequence[Rule]) -> str:
    """The rules as ``--print-rules`` shows them: one line each, in the order tried."""
    lines = [f"{'#':>3}  {'RULE':<26}{'CLASS':<12}{'ACTION':<14}{'BUDGET':<8}MATCHES"]
    for number, rule in enumerate(rules, 1):
        source = "" if not rule.operator else "  (operator)"
        lines.append(
            f"{number:>3}  {rule.name:<26}{rule.failure_class.value:<12}{rule.action.value:<14}"
            f"{rule.budget if rule.action is Action.RETRY else '-':<8}{_matches(rule)}{source}"
        )
    return "\n".join(lines)


def _matches(rule: Rule) -> str:
    parts = []
    if rule.exit_codes:
        parts.append(f"exit {sorted(rule.exit_codes)}")
    if rule.signals:
        parts.append("signal " + ",".join(_signal_name(number) for number in sorted(rule.signals)))
    if rule.exceptions:
        parts.append("exception " + ",".join(sorted(rule.exceptions)))
    if rule.errnos:
        names = (errnos.errorcode.get(number, str(number)) for number in sorted(rule.errnos))
        parts.append("errno " + ",".join(names))
    if rule.oom_kill:
        parts.append("kernel OOM kill")
    if rule.xid:
        parts.append("GPU Xid")
    if rule.pattern is not None:
        parts.append(f"log /{rule.pattern.pattern}/")
    if rule.at_start:
        parts.append("before the first step")
    return "; ".join(parts)


def _signal_name(number: int) -> str:
    try:
        return signals.Signals(number).name
    except ValueError:
        return str(number)
