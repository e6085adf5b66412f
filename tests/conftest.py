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
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# The fakes and helpers that test modules share assert as the tests do; pytest
# shows the values in a failed assert only in test modules and the modules named here.
pytest.register_assert_rewrite(
    "tests.fakes",
    "tests.unit.daemon_world",
    "tests.integration.agent_harness",
    "tests.e2e.jobs",
    "tests.e2e.time_limits",
)

REPO = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO / "deploy" / "slurm" / "cluster"
ENDED = frozenset({"COMPLETED", "FAILED", "CANCELLED"})


def in_ci() -> bool:
    """Whether this run is CI's: ``CI`` set to anything but empty, 0, false or no."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


_GPU_SKIPS: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker's processes all talk to the worker's own cluster: whatever a test
    starts without an explicit environment inherits it (see :func:`worker_cluster`)."""
    if worker_id() is not None:
        os.environ["SLURM_CONF"] = str(cluster_conf())
        os.environ["RESURGO_CLUSTER_DIR"] = str(worker_cluster())
        if config.getoption("loadgroup", False):
            config.pluginmanager.register(GroupingCheck(), "resurgo-grouping-check")


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


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that takes the live cluster is marked ``slurm``: the tiers select on it
    (``-m slurm`` for the live tier, ``-m "not slurm"`` for the rest); tests marked
    ``long`` run first. First among the hooks: ``-m`` deselects in pytest's own."""
    for item in items:
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and not item.get_closest_marker(
            "slurm"
        ):
            item.add_marker(pytest.mark.slurm)
    # Long tests go first: one worker's minutes then overlap the other workers' short
    # tests instead of being the tier's tail (a stable sort: the rest keep their
    # order; the tiers run xdist with --no-loadscope-reorder, which keeps it).
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


class GroupingCheck:
    """Under ``--dist loadgroup``, fail at once when xdist's grouping did not take.

    A module marked ``xdist_group`` holds something machine-wide (a local user,
    fixed ports); split across workers it fails in ways that look like flakes.
    xdist groups by suffixing node ids (``test_x@group``) in its own hook, which
    runs before this one; some pytest releases silently undo the suffix (pytest
    9.2: pytest-xdist issue 1386). The run then ends with an internal error.
    """

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        lost = [
            item.nodeid
            for item in items
            if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid
        ]
        if lost:
            raise pytest.UsageError(
                f"--dist loadgroup did not group {len(lost)} test(s), e.g. {lost[0]}: this "
                f"pytest ({pytest.__version__}) and pytest-xdist disagree on node ids; install "
                "the versions pyproject.toml pins (deploy/setup)"
            )


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
    def root(self) -> Path:
        """The cluster's folder (``deploy/slurm/cluster --dir``)."""
        return self.conf.parent

    @property
    def env(self) -> dict[str, str]:
        """The environment of a command on this cluster: Slurm's commands and
        ``deploy/slurm/cluster`` (kill-node, start-node) both act on it alone."""
        return dict(os.environ, SLURM_CONF=str(self.conf), RESURGO_CLUSTER_DIR=str(self.root))

    def ctld_lines(self, job_id: int, limit: int = 40) -> str:
        """slurmctld's last ``limit`` log lines that name ``job_id``: what a timed-out
        wait on a job shows, since the cluster's logs do not outlive a CI run."""
        log = self.root / "log" / "slurmctld.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        named = [line for line in lines if str(job_id) in line]
        return "\n".join(named[-limit:])

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

    def restore(self) -> None:
        """Cancel leftover jobs, bring killed nodes back, undo drains: four idle nodes.

        Every live test starts from this (the autouse ``clean_cluster`` fixture), so
        a test that left a node drained or a job running cannot fail the next test
        on the same worker, whichever test that is.
        """
        for job in self.json(["squeue", "--json"]).get("jobs", []):
            if job["job_state"] not in ENDED:
                self.run(["scancel", str(job["job_id"])])
        for name, node in self.nodes().items():
            flags = node.get("state_flags", [])
            if node["state"] != "idle" or "DRAIN" in flags or "NOT_RESPONDING" in flags:
                # start-node starts a dead slurmd, resumes the node and waits for idle.
                subprocess.run(
                    [str(CLUSTER_SCRIPT), "start-node", name],
                    env=self.env, capture_output=True, timeout=120, check=False,
                )  # fmt: skip

    def wait_job_state(
        self, job_id: int, states: AbstractSet[str], timeout_s: float = 60.0
    ) -> dict:
        def reached() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if job is not None and job["job_state"] in states else None

        return self.wait_for(f"job {job_id} in {sorted(states)}", reached, timeout_s)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for a server a test starts)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def worker_id() -> str | None:
    """This pytest-xdist worker's name (``gw0``, ``gw1``, ...), or None outside xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER") or None


def worker_cluster() -> Path:
    """The folder of the local cluster this test process runs on.

    One cluster per xdist worker, so live tests on different workers never share
    nodes, jobs or drains: worker ``gwN`` runs on ``.cluster-gwN``, which
    ``deploy/slurm/cluster --worker gwN`` manages (its ports too). Without xdist,
    the default cluster, or the one ``SLURM_CONF`` names.
    """
    worker = worker_id()
    if worker is not None:
        return REPO / f".cluster-{worker}"
    configured = os.environ.get("SLURM_CONF")
    return Path(configured).parent if configured else REPO / ".cluster"


def cluster_conf() -> Path:
    """The slurm.conf of this test process's cluster (see :func:`worker_cluster`)."""
    return worker_cluster() / "slurm.conf"


def _cluster_problem(conf: Path) -> str | None:
    """None when the cluster of ``conf`` answers ``sinfo`` with nodes; else what is wrong."""
    if not conf.exists():
        return f"no slurm.conf at {conf}"
    try:
        done = subprocess.run(
            ["sinfo", "--json"],
            env=dict(os.environ, SLURM_CONF=str(conf)),
            capture_output=True,
            text=True,
            timeout=15,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"sinfo did not answer: {error}"
    if done.returncode != 0:
        return f"sinfo failed: {done.stderr.strip()}"
    try:
        if not json.loads(done.stdout).get("nodes"):
            return "sinfo lists no nodes"
    except json.JSONDecodeError as error:
        return f"sinfo did not answer: {error}"
    return None


def _bring_up(worker: str) -> str | None:
    """Start ``worker``'s cluster with deploy/slurm/cluster; None on success, else why not."""
    try:
        done = subprocess.run(
            [str(CLUSTER_SCRIPT), "up", "--worker", worker],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`deploy/slurm/cluster up --worker {worker}` did not finish: {error}"
    if done.returncode != 0:
        return done.stderr.strip() or done.stdout.strip()
    return None


@pytest.fixture(scope="session")
def slurm_cluster() -> LiveCluster:
    """The live local cluster of this test process; fails in CI, skips locally when unreachable.

    An xdist worker brings its own cluster up when it is not up yet (CI starts
    them ahead, beside the unit tier); ``deploy/slurm/cluster down --all`` stops
    them all.
    """
    conf = cluster_conf()
    problem = _cluster_problem(conf)
    worker = worker_id()
    if problem is not None and worker is not None:
        problem = _bring_up(worker) or _cluster_problem(conf)
    if problem is not None:
        message = f"live Slurm cluster not reachable ({problem}): run `deploy/slurm/cluster up`"
        if in_ci():
            pytest.fail(message)
        pytest.skip(message)
    return LiveCluster(conf=conf)


@pytest.fixture(autouse=True)
def clean_cluster(request: pytest.FixtureRequest) -> None:
    """Before each test that takes the live cluster: four idle nodes, no job left over."""
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_cluster").restore()
