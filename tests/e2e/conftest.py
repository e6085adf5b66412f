"""The supervisor the e2e tests run against (test_outage and test_time_limit have their own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import LiveCluster
from tests.e2e.jobs import AGENTS, DAEMON, POLICY
from tests.supervisor_harness import SupervisorProcess


@pytest.fixture
def supervisor(
    slurm_cluster: LiveCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[SupervisorProcess]:
    """The supervisor under test; ``@pytest.mark.policy(name=value)`` changes its policy,
    ``@pytest.mark.daemon_env(NAME=value)`` its settings."""
    marker = request.node.get_closest_marker("policy")
    policy = POLICY | (marker.kwargs if marker else {})
    settings = request.node.get_closest_marker("daemon_env")
    env = AGENTS | DAEMON | (settings.kwargs if settings else {})
    process = SupervisorProcess(slurm_cluster, tmp_path / "state", policy, env)
    process.start()
    try:
        yield process
    finally:
        process.stop()
        slurm_cluster.restore()
