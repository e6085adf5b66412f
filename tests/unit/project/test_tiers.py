"""The test tiers cover the whole suite: every test lands in exactly the tier meant for it.

deploy/test runs ``tests/unit``, then ``tests/integration`` and ``tests/e2e``
without the live cluster (``-m "not slurm"``), then every test marked ``slurm``
on one cluster per worker. tests/conftest.py marks a test ``slurm`` when it
takes the ``slurm_cluster`` fixture, so no live test can fall into a tier
without a cluster, and puts tests marked ``long`` first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.paths import TESTS as TEST_TREE

pytest_plugins = ["pytester"]

TESTS_DIR = TEST_TREE
CONFTEST = TESTS_DIR / "conftest.py"

SUITE = """
import pytest

def test_pure():
    pass

def test_on_the_cluster(slurm_cluster):
    pass

@pytest.mark.slurm
def test_marked_by_hand():
    pass

@pytest.mark.long
def test_minutes_long():
    pass
"""


def _collect(pytester: pytest.Pytester, *args: str) -> list[str]:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slurm: live\n    long: minutes\n    gpu: cuda\n")
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("--collect-only", "-q", *args)
    return [line.split("::")[1] for line in result.outlines if "::" in line]


def test_a_test_that_takes_the_cluster_is_in_the_live_tier_and_no_other(
    pytester: pytest.Pytester,
) -> None:
    assert _collect(pytester, "-m", "slurm") == ["test_on_the_cluster", "test_marked_by_hand"]


def test_the_local_tier_holds_every_test_without_the_cluster_long_ones_first(
    pytester: pytest.Pytester,
) -> None:
    assert _collect(pytester, "-m", "not slurm") == ["test_minutes_long", "test_pure"]


def test_every_test_module_lies_in_a_tier_folder() -> None:
    tiers = {TESTS_DIR / "unit", TESTS_DIR / "integration", TESTS_DIR / "e2e"}
    outside = [
        str(path.relative_to(TESTS_DIR))
        for path in TESTS_DIR.rglob("test_*.py")
        if not any(tier in path.parents for tier in tiers)
        and "fixtures" not in path.relative_to(TESTS_DIR).parts
    ]
    assert outside == [], f"no tier runs these: {outside} (deploy/test, docs/testing.md)"


def test_no_unit_test_needs_the_live_cluster() -> None:
    """The unit tier runs before any cluster is up."""
    needing = [
        path.name
        for path in (TESTS_DIR / "unit").rglob("test_*.py")
        if path != Path(__file__).resolve() and "slurm_cluster" in path.read_text()
    ]
    assert needing == []
