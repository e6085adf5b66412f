"""In CI no skip can hide (tests/conftest.py): a skip fails, except a GPU test without CUDA."""

from __future__ import annotations

import pytest

from tests.paths import TESTS as TEST_TREE

pytest_plugins = ["pytester"]

CONFTEST = TEST_TREE / "conftest.py"

TESTS = """
import pytest

def test_needs_a_tool():
    pytest.skip("promtool is missing")

@pytest.mark.gpu
def test_needs_cuda():
    pytest.skip("no CUDA device")

def test_runs():
    pass
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str) -> pytest.RunResult:
    monkeypatch.setenv("CI", ci)
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    pytester.makepyfile(test_skips=TESTS)
    return pytester.runpytest_subprocess("-rs")


@pytest.mark.parametrize("ci", ["true", "1", "yes", "True"])
def test_in_ci_a_skip_fails_and_a_gpu_skip_is_counted(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    result = _run(pytester, monkeypatch, ci)
    result.assert_outcomes(passed=1, failed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*skipped in CI, which must run every test: promtool is missing*",
            "*1 GPU test(s) not run (no CUDA device)*",
            "*test_needs_cuda*",
        ]
    )


@pytest.mark.parametrize("ci", ["", "0", "false"])
def test_outside_ci_a_skip_stays_a_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: str
) -> None:
    result = _run(pytester, monkeypatch, ci)
    result.assert_outcomes(passed=1, skipped=2)
