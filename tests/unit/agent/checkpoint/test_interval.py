"""Young/Daly interval math and `resurgo interval`."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest

import agent.checkpoint.interval as interval_module
from agent.checkpoint.interval import (
    WRITE_HEADROOM,
    advise,
    daly_interval_s,
    expected_overhead_fraction,
    recommended_interval_s,
    young_interval_s,
)
from supervisor.cli.main import main

HOUR = 3600.0
MINUTE = 60.0


def test_daly_matches_design_check_value_for_one_day_mtbf_and_five_minute_save() -> None:
    assert daly_interval_s(5 * MINUTE, 24 * HOUR) / MINUTE == pytest.approx(116.7, abs=0.05)


def test_llama3_numbers_give_about_26_minutes() -> None:
    young = young_interval_s(2 * MINUTE, 3 * HOUR) / MINUTE
    daly = daly_interval_s(2 * MINUTE, 3 * HOUR) / MINUTE
    assert young == pytest.approx(26.83, abs=0.01)
    assert daly == pytest.approx(25.5, abs=0.05)


def test_young_is_the_minimum_of_the_seeds_cost_model() -> None:
    save, mtbf = 90.0, 4 * HOUR
    best = young_interval_s(save, mtbf)
    at_best = expected_overhead_fraction(best, save, mtbf)
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert expected_overhead_fraction(best * factor, save, mtbf) > at_best


def test_daly_is_mtbf_when_a_save_costs_at_least_two_mtbf() -> None:
    assert daly_interval_s(2 * HOUR, 1 * HOUR) == 1 * HOUR
    assert daly_interval_s(5 * HOUR, 1 * HOUR) == 1 * HOUR


def test_a_free_save_gives_a_zero_interval_and_zero_overhead() -> None:
    advice = advise(0.0, 3 * HOUR)
    assert (advice.young_s, advice.daly_s, advice.recommended_s) == (0.0, 0.0, 0.0)
    assert advice.recommended_overhead == 0.0


@pytest.mark.parametrize(
    ("save", "mtbf", "message"),
    [
        (10.0, 0.0, "MTBF"),
        (10.0, -1.0, "MTBF"),
        (10.0, math.inf, "MTBF"),
        (-1.0, HOUR, "save cost"),
        (math.nan, HOUR, "save cost"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_input(
    save: float, mtbf: float, message: str
) -> None:
    for function in (young_interval_s, daly_interval_s):
        with pytest.raises(ValueError, match=message):
            function(save, mtbf)


def test_overhead_rejects_a_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="interval"):
        expected_overhead_fraction(0.0, 10.0, HOUR)


def test_recommended_is_daly_when_the_background_write_is_short() -> None:
    daly = daly_interval_s(8.0, 3 * HOUR)
    assert recommended_interval_s(8.0, 60.0, 3 * HOUR) == daly


def test_recommended_exceeds_a_long_background_write_so_one_save_is_in_flight() -> None:
    # An 8 s stall alone would give ~7 min, but the write takes 40 min.
    assert recommended_interval_s(8.0, 40 * MINUTE, 3 * HOUR) == WRITE_HEADROOM * 40 * MINUTE


def test_recommended_rejects_a_negative_write_time() -> None:
    with pytest.raises(ValueError, match="background write"):
        recommended_interval_s(8.0, -1.0, HOUR)


def test_advice_is_frozen_and_bundles_every_interval() -> None:
    advice = advise(120.0, 3 * HOUR, background_write_s=30.0)
    assert advice.young_s == young_interval_s(120.0, 3 * HOUR)
    assert advice.daly_overhead == expected_overhead_fraction(advice.daly_s, 120.0, 3 * HOUR)
    with pytest.raises(AttributeError):
        advice.daly_s = 1.0  # type: ignore[misc]


def test_interval_module_imports_nothing_that_touches_the_os_or_clock() -> None:
    tree = ast.parse(Path(interval_module.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"time", "os", "subprocess", "socket", "sqlite3", "psutil"}


def test_cli_prints_young_and_daly_in_minutes_with_overhead(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["interval", "--save-stall-s", "300", "--mtbf-h", "24"]) == 0
    out = capsys.readouterr().out
    assert "Young        120.0 min (7200 s)" in out
    assert "Daly         116.7 min (7001 s)" in out
    assert "expected overhead 8.3%" in out


def test_cli_json_has_inputs_young_daly_and_recommended(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # --save-s: the old spelling of --save-stall-s, kept for scripts.
    assert main(["interval", "--save-s", "8", "--write-s", "2400", "--mtbf-h", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["young_s"] == pytest.approx(young_interval_s(8.0, 3 * HOUR))
    assert data["daly_s"] == pytest.approx(daly_interval_s(8.0, 3 * HOUR))
    assert data["recommended_s"] == pytest.approx(WRITE_HEADROOM * 2400)
    assert (data["stall_s"], data["background_write_s"], data["mtbf_s"]) == (8.0, 2400.0, 3 * HOUR)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--save-stall-s", "-1", "--mtbf-h", "3"], "--save-stall-s"),
        (["--save-stall-s", "abc", "--mtbf-h", "3"], "--save-stall-s"),
        (["--save-stall-s", "10", "--mtbf-h", "0"], "--mtbf-h"),
        (["--save-stall-s", "10", "--mtbf-h", "nan"], "--mtbf-h"),
        (["--save-stall-s", "10", "--mtbf-h", "3", "--write-s", "-5"], "--write-s"),
    ],
)
def test_cli_bad_input_is_one_stderr_line_and_exit_2(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["interval", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1
    assert flag in lines[0]
