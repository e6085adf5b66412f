"""A real ``resurgo-supervisor`` process for live tests: start, SIGKILL, restart, read its store."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from agent.node.procs import shim_worker
from supervisor.jobs import JobSpec, submit
from supervisor.slurm import SlurmClient
from supervisor.store import Store
from tests.conftest import REPO, LiveCluster, cluster_conf, free_port

# The node agents of test jobs report quickly, so recoveries fit in a test.
AGENT_ENV = {
    "RESURGO_AGENT_HEARTBEAT_REPORT_S": "1",
    "RESURGO_AGENT_STOP_GRACE_S": "5",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": str(REPO),
}
TOY = REPO / "deploy" / "demo" / "train_toy.py"

TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1")


@dataclass(frozen=True)
class LocalUser:
    """A local Linux user without Slurm rights, and the Python it can run Resurgo with.

    The venv's interpreter may lie where others cannot read (a pyenv build
    under /root); then Debian's python3 of the same version runs with the
    venv's packages on ``PYTHONPATH``.
    """

    name: str
    python: str
    pythonpath: str

    def popen(self) -> dict[str, Any]:
        """Popen's arguments that run a process as this user, without root's groups."""
        return {"user": self.name, "group": self.name, "extra_groups": []}

    def env(self, home: Path) -> dict[str, str]:
        return {"USER": self.name, "LOGNAME": self.name, "HOME": str(home),
                "PYTHONPATH": self.pythonpath}  # fmt: skip


class SupervisorProcess:
    """``python -m supervisor.daemon`` on a fixed port, its log in ``state_dir/supervisor.log``."""

    def __init__(
        self,
        cluster: LiveCluster,
        state_dir: Path,
        policy: dict[str, str],
        extra_env: dict[str, str] | None = None,
        user: LocalUser | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        """``extra_env`` reaches the daemon and, through ``resurgo submit``, the job;
        ``user`` runs the daemon and every ``resurgo`` command as that local user,
        with the interpreter it can run (the test runs as root); ``args`` are the
        daemon's command-line arguments (``--config FILE``)."""
        self.extra_env = dict(extra_env or {})
        self.args = args
        self.user = user
        self.python = sys.executable if user is None else user.python
        self.cluster = cluster
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.policy = policy
        self.log_path = state_dir / "supervisor.log"
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self.user is not None:
            shutil.chown(self.state_dir, self.user.name, self.user.name)
        env = {
            **self.cluster.env,
            "RESURGO_SUPERVISOR_STATE_DIR": str(self.state_dir),
            "RESURGO_SUPERVISOR_LISTEN_HOST": "127.0.0.1",
            "RESURGO_SUPERVISOR_LISTEN_PORT": str(self.port),
            "RESURGO_SUPERVISOR_URL": self.url,
            "RESURGO_SUPERVISOR_POLL_S": "0.5",
            "RESURGO_SUPERVISOR_TICK_S": "0.5",
            "RESURGO_SUPERVISOR_RECONCILE_S": "2",
            "RESURGO_SUPERVISOR_LOG_JSON": "no",
            "PYTHONPATH": str(REPO),
            **{f"RESURGO_POLICY_{key.upper()}": value for key, value in self.policy.items()},
            **self.extra_env,
        }
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [self.python, "-m", "supervisor.daemon", *self.args],
            env={**env, **self._user_env()},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            **self._as_user(),
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"supervisor exited at start:\n{self.log()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/healthz", timeout=2),
            ):
                return
            time.sleep(0.2)
        raise AssertionError(f"supervisor did not answer /healthz:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, whatever it was doing."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def store(self) -> Store:
        """A second connection to the daemon's store (WAL: reads while it writes)."""
        return Store.open(self.state_dir / "resurgo.db")

    def cli_env(self) -> dict[str, str]:
        """The environment ``resurgo`` commands run with: this supervisor, this cluster."""
        return {
            **self.cluster.env,
            **AGENT_ENV,
            "RESURGO_STATE_DIR": str(self.state_dir),
            "RESURGO_URL": self.url,
            **self.extra_env,
        }

    def resurgo(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Run ``resurgo ARGS`` as a user would (a separate process); ``env`` adds to its
        environment (and so, through ``submit``, to the job's)."""
        return subprocess.run(
            [self.python, "-m", "supervisor.cli.main", *args],
            env={**self.cli_env(), **self._user_env(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            **self._as_user(),
        )

    def _as_user(self) -> dict[str, Any]:
        """Popen's arguments that run a process as :attr:`user` (none for the test's own)."""
        return {} if self.user is None else {**self.user.popen(), "cwd": self.state_dir}

    def _user_env(self) -> dict[str, str]:
        return {} if self.user is None else self.user.env(self.state_dir)

    def submit(self, spec: JobSpec, extra_env: dict[str, str] | None = None) -> int:
        """Submit ``spec`` as `resurgo submit` does; return the Slurm job id."""
        env = {**AGENT_ENV, "SLURM_CONF": str(self.cluster.conf), **(extra_env or {})}
        client = SlurmClient(env=env)
        return int(asyncio.run(submit(spec, self.state_dir / "jobs", client)))


def toy_spec(
    name: str, nodes: int, ckpt_root: Path, output: Path, url: str, *toy_args: str, **kw: int
) -> JobSpec:
    """A JobSpec running the toy training job with one rank per node."""
    return JobSpec(
        name=name,
        nodes=nodes,
        command=(*TORCHRUN, str(TOY), *toy_args),
        ckpt_root=str(ckpt_root),
        supervisor_url=url,
        sbatch_options=(f"--output={output}",),
        min_nodes=kw.get("min_nodes"),
    )


def rank_pids(node: str, marker: str = "train_toy.py", conf: Path | None = None) -> list[int]:
    """Pids of training ranks (not their shims or torchrun) running as Slurm node ``node``
    of the cluster whose slurm.conf is ``conf`` (default: this test process's cluster):
    every local cluster has a node1, so the node name alone would take another's ranks.

    Found through their shims (``python -m agent.node.rankexec`` with the script's name),
    as the agent finds them: a rank forked by the node's warm pool shows the pool's
    command line and environment, not its own (agent.node.warmpool)."""
    cluster = str(conf or cluster_conf())
    found = []
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "agent.node.rankexec" not in cmdline or not any(
            part.endswith(marker) for part in cmdline
        ):
            continue
        try:
            environ = process.environ()
            if (
                environ.get("SLURMD_NODENAME") == node
                and environ.get("SLURM_CONF") == cluster
                and "RANK" in environ
                and (worker := shim_worker(process)) is not None
            ):
                found.append(worker)
        except psutil.Error:
            continue
    return found


def kill_rank_on(node: str, conf: Path | None = None) -> int:
    pids = rank_pids(node, conf=conf)
    assert pids, f"no toy rank runs on {node}"
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def render_in_chromium(page: Path, png: Path) -> Path:
    """Screenshot ``page`` with headless Chromium (installed by deploy/setup); return the PNG."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "chromium is not installed: run deploy/setup (it installs Debian's chromium)"
    done = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         "--window-size=1200,2000", f"--screenshot={png}", page.resolve().as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert png.exists(), f"chromium wrote no screenshot: {done.stderr[-2000:]}"
    return png
