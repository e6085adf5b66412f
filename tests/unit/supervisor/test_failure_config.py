"""The operator's ``[[failure_rules]]`` (supervisor.failure_config): parsed, checked, listed."""

from __future__ import annotations

import signal
import tomllib

import pytest

from agent.wire.errors import ConfigError
from supervisor.core.failure_rules import DEFAULT_RULES, Action, Evidence, FailureClass, classify
from supervisor.failure_config import in_force, parse_rules, rules_table

SITE = """
[[failure_rules]]
name = "bad-hbm"
class = "hardware"
match_log = "HBM uncorrectable error on bank [0-9]+"

[[failure_rules]]
name = "flaky-import"
class = "unknown"
match_exception = "ImportError"
match_log = "libcudart"

[[failure_rules]]
name = "scratch-full"
class = "storage"
match_errno = ["ENOSPC", 122]
match_signal = ["SIGABRT", 6]
"""


def _rules(text: str) -> tuple:  # type: ignore[type-arg]
    return parse_rules(tomllib.loads(text)["failure_rules"], "site.toml")


def test_site_rules_come_first_and_name_themselves_in_the_verdict() -> None:
    rules = in_force(_rules(SITE))
    assert rules[3:] == DEFAULT_RULES
    found = classify(Evidence(exit_code=1, stderr_tail="step 7\nHBM uncorrectable error on bank 3"),
                     rules)  # fmt: skip
    assert (found.failure_class, found.action, found.rule, found.operator) == (
        FailureClass.HARDWARE, Action.BLAME_NODE, "bad-hbm", True,
    )  # fmt: skip
    assert found.evidence == "HBM uncorrectable error on bank 3"


def test_a_site_rule_overrides_a_default_it_matches_first() -> None:
    at_start = Evidence(exit_code=1, raised="ImportError", at_start=True,
                        message="libcudart.so.12: cannot open shared object file")  # fmt: skip
    assert classify(at_start, DEFAULT_RULES).action is Action.STOP
    assert classify(at_start, in_force(_rules(SITE))).rule == "flaky-import"


def test_names_of_errnos_and_signals_are_numbers() -> None:
    scratch = _rules(SITE)[2]
    assert (scratch.errnos, scratch.signals) == (frozenset({28, 122}), frozenset({signal.SIGABRT}))
    assert (scratch.action, scratch.budget) == (Action.WAIT_STORAGE, 0)


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ('name = "x"\nclass = "hardware"', "must match something"),
        ('name = "x"\nclass = "disk"\nmatch_log = "a"', "class must be one of"),
        ('name = "x"\nclass = "preempted"\nmatch_log = "a"', "class must be one of"),
        ('name = "x"\nclass = "oom"\naction = "reboot"\nmatch_log = "a"', "action must be one of"),
        ('name = "x"\nclass = "oom"\nmatch_log = "(unclosed"', "is no regular expression"),
        ('name = "x"\nclass = "oom"\nmatch_errno = ["ENOTHING"]', "not a number this key knows"),
        ('name = "x"\nclass = "oom"\nmatch_signal = ["SIGWHAT"]', "not a number this key knows"),
        ('name = "x"\nclass = "oom"\nbudget = -1\nmatch_log = "a"', "budget must be"),
        ('name = "x"\nclass = "oom"\nconfidence = 2\nmatch_log = "a"', "confidence must be"),
        ('name = "x"\nclass = "oom"\nmatch_lg = "a"', "unknown key(s) ['match_lg']"),
        ('name = "no spaces"\nclass = "oom"\nmatch_log = "a"', "name must be"),
        ('class = "oom"\nmatch_log = "a"', "name must be"),
    ],
)  # fmt: skip
def test_each_mistake_names_the_rule_the_key_and_what_is_allowed(table: str, words: str) -> None:
    with pytest.raises(ConfigError) as raised:
        _rules(f"[[failure_rules]]\n{table}\n")
    assert words in str(raised.value)
    assert str(raised.value).startswith("site.toml: [[failure_rules]] #1")


def test_two_rules_of_one_name_and_a_table_that_is_no_array_are_refused() -> None:
    twice = '[[failure_rules]]\nname = "a"\nclass = "oom"\nmatch_log = "x"\n' * 2
    with pytest.raises(ConfigError, match="given twice: \\['a'\\]"):
        _rules(twice)
    with pytest.raises(ConfigError, match="must be an array of tables"):
        parse_rules({"name": "a"}, "site.toml")


def test_the_listing_shows_every_rule_in_the_order_tried() -> None:
    table = rules_table(in_force(_rules(SITE))).splitlines()
    assert table[0].split() == ["#", "RULE", "CLASS", "ACTION", "BUDGET", "MATCHES"]
    assert len(table) == 1 + 3 + len(DEFAULT_RULES)
    assert table[1].split()[:4] == ["1", "bad-hbm", "hardware", "blame_node"]
    assert table[1].endswith("(operator)")
    assert "signal SIGABRT; errno ENOSPC,EDQUOT" in table[3]
    assert "kernel OOM kill" in table[4] and "before the first step" in "\n".join(table)
