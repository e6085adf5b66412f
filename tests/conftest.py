"""Shared fixtures: the live local Slurm cluster.

Tests that need Slurm take the ``slurm_cluster`` fixture. Locally, when no
cluster is up, they are skipped with a reason that says how to start one.

In CI (any truthy ``CI``: ``true``, ``1``, ``yes``) no skip can hide: a test
that skips fails instead, whatever the reason (no cluster, no promtool, not
root), so a green run means every path really ran. The one exception is a
test marked ``gpu`` on a machine without CUDA; those are counted and printed
at the end of the run.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "deploy" / "slurm" / "cluster"


def in_ci() -> bool:
    """Whether this run is CI's: ``CI`` set to anything but empty, 0, false or no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


_GPU_SKIPS: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or not in_ci() or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    reason = reason.removeprefix("Skipped: ")
    if item.get_closest_marker("gpu") is not None:
        _GPU_SKIPS.append(f"{item.nodeid}: {reason}")
        return
    report.outcome = "failed"
    report.longrepr = f"skipped in CI, which must run every test: {reason}"


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if _GPU_SKIPS:
        terminalreporter.write_sep("=", f"{len(_GPU_SKIPS)} GPU test(s) not run (no CUDA device)")
        for line in _GPU_SKIPS:
            terminalreporter.write_line(line)


@dataclass(frozen=True)
class LiveCluster:
    """Handle on the running local cluster: runs Slurm commands against its slurm.conf."""

    conf: Path

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(
        self, argv: Sequence[str], timeout: float = 30.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm command (``env`` adds variables); raise with its stderr when it fails."""
        done = subprocess.run(
            list(argv),
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr}")
        return done

    def json(self, argv: Sequence[str]) -> Any:
        return json.loads(self.run(argv).stdout)

    def nodes(self) -> dict[str, dict[str, Any]]:
        """Node name -> node record from ``sinfo --json``."""
        return {node["name"]: node for node in self.json(["sinfo", "--json"])["nodes"]}

    def job(self, job_id: int) -> dict[str, Any] | None:
        """The job's record from ``squeue --json``, or None once Slurm forgot it."""
        # Slurm 22.05's `squeue --json` ignores --jobs and every other filter and
        # prints all jobs it knows: select client-side.
        jobs = self.json(["squeue", "--json"]).get("jobs", [])
        return next((job for job in jobs if job["job_id"] == job_id), None)

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> int:
        """Submit with ``sbatch --parsable``; return the job id."""
        done = self.run(["sbatch", "--parsable", *args], env=env)
        return int(done.stdout.strip().split(";")[0])

    def wait_for(self, what: str, predicate: Callable[[], Any], timeout_s: float = 60.0) -> Any:
        """Poll ``predicate`` until it returns a truthy value; fail naming ``what``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")

    def wait_job_state(self, job_id: int, states: set[str], timeout_s: float = 60.0) -> dict:
        def reached() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job is not None and job["job_state"] in states else None

        return self.wait_for(f"job {job_id} in {sorted(states)}", reached, timeout_s)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server a test starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cluster_conf() -> Path:
    configured = os.environ.get("SLURM_CONF")
    return Path(configured) if configured else REPO / ".cluster" / "slurm.conf"


@pytest.fixture(scope="session")
def slurm_cluster() -> LiveCluster:
    """The live local cluster; fails in CI and skips locally when it is not reachable."""
    conf = _cluster_conf()
    problem = None
    if not conf.exists():
        problem = f"no slurm.conf at {conf}"
    else:
        try:
            done = subprocess.run(
                ["sinfo", "--json"],
                env=dict(os.environ, SLURM_CONF=str(conf)),
                capture_output=True,
                text=True,
                timeout=15,
                check=False,
            )
            if done.returncode != 0:
                problem = f"sinfo failed: {done.stderr.strip()}"
            elif not json.loads(done.stdout).get("nodes"):
                problem = "sinfo lists no nodes"
        except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as error:
            problem = f"sinfo did not answer: {error}"
    if problem is not None:
        message = f"live Slurm cluster not reachable ({problem}): run `deploy/slurm/cluster up`"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return LiveCluster(conf=conf)
