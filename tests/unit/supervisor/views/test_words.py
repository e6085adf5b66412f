"""Numbers, counts and stacks as the views print them."""

from __future__ import annotations

import pytest

from supervisor.core.failure_rules import DEFAULT_RULES, UNKNOWN, Evidence, classify
from supervisor.views import words


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [(0.011354302999990296, "11.4 ms"), (27.512, "27.5 s"), (66.0, "66 s"),
     (4.987, "4.99 s"), (300.0, "5.0 min"), (86400.0, "24.0 h")],
)  # fmt: skip
def test_seconds_read_to_three_significant_digits(seconds: float, shown: str) -> None:
    assert words.seconds(seconds) == shown


@pytest.mark.parametrize(
    ("count", "shown"), [(512, "512 B"), (183210, "183 kB"), (1_250_000_000, "1.25 GB")]
)
def test_bytes_read_in_decimal_units(count: int, shown: str) -> None:
    assert words.size(count) == shown


def test_a_missing_value_reads_none_and_a_unix_time_a_time_of_day() -> None:
    assert words.fields({"first_diverging_step": None}) == "first_diverging_step=none"
    assert "1700000034" not in words.value("exit_time_unix_s", 1_700_000_034.000125)


def test_one_of_a_count_is_singular() -> None:
    assert (words.plural(1, "rank"), words.plural(2, "rank")) == ("1 rank", "2 ranks")


def test_py_spy_dumps_are_read_innermost_first_on_the_main_thread() -> None:
    dump = (
        'Process 1: python t.py\nThread 9 (active): "loader"\n    get (queue.py:1)\n'
        'Thread 1 (idle): "MainThread"\n    all_gather_single (c10d.py:3)\n'
        "    <module> (t.py:426)"
    )
    assert words.innermost_frame(dump) == "all_gather_single (c10d.py:3)"


def test_tracebacks_are_read_innermost_last() -> None:
    traceback = (
        'Traceback (most recent call last):\n  File "t.py", line 426, in <module>\n'
        '    main()\n  File "t.py", line 188, in stall_forever\n    wait()\n'
    )
    assert words.innermost_frame(traceback) == "stall_forever (t.py:188)"


def test_a_failed_dump_reads_as_itself() -> None:
    assert words.innermost_frame("(no stack: py-spy not found)") == "(no stack: py-spy not found)"


def test_the_class_and_rule_are_read_back_from_the_cores_own_words() -> None:
    killed = Evidence(signal=9, oom_kill="Memory cgroup out of memory: Killed process 689")
    found = classify(killed, DEFAULT_RULES)
    explanation = f"oom: no node blamed: rank 0 on node2: {found.words()}; retry 1 of 1"
    assert words.failure_in(explanation) == ("oom", "kernel-oom-kill")
    # No rule matched (class unknown): the explanation names no class.
    assert words.failure_in(f"rank_signal: drain node2 ({UNKNOWN.words()})") is None


def test_failures_read_by_class_with_the_rules_that_named_them() -> None:
    counts = {"oom": 2, "hardware": 1, "unknown": 1}
    rules = {"oom": ["kernel-oom-kill"], "hardware": ["gpu-xid", "bad-hbm"]}
    assert words.failures(counts, rules) == (
        "hardware 1 (gpu-xid, bad-hbm), oom 2 (kernel-oom-kill), unknown 1"
    )
    assert words.failures({}) == "none"
