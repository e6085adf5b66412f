"""deploy/slurm/cluster: a second, throwaway cluster brought up and down for real."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_SCRIPT, cluster_conf

# One worker runs the whole module: its throwaway clusters use fixed ports.
pytestmark = [pytest.mark.slurm, pytest.mark.xdist_group("cluster-script")]

# Far from the session cluster's default ports (17000..17004).
PORT_BASE = 17100


def cluster(directory: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CLUSTER_SCRIPT), "--dir", str(directory), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def pids_of(directory: Path) -> list[int]:
    """Pids whose command line mentions ``directory``: the daemons of that cluster."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if str(directory).encode() in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture
def throwaway(tmp_path: Path) -> Iterator[Path]:
    directory = tmp_path / "cluster"
    yield directory
    cluster(directory, "down")


def test_up_is_idempotent_and_down_stops_exactly_its_daemons(throwaway: Path) -> None:
    if shutil.which("slurmctld") is None:
        pytest.fail("slurm-wlm is not installed: run deploy/setup")
    up = cluster(throwaway, "up", "--nodes", "2", "--port-base", str(PORT_BASE))
    assert up.returncode == 0, up.stderr
    assert "2 idle nodes" in up.stdout
    again = cluster(throwaway, "up", "--nodes", "2", "--port-base", str(PORT_BASE))
    assert again.returncode == 0, again.stderr
    assert "already up" in again.stdout

    status = cluster(throwaway, "status")
    assert status.returncode == 0
    assert "node1 idle" in status.stdout and "node2 idle" in status.stdout
    daemons = pids_of(throwaway)
    assert len(daemons) == 4  # munged, slurmctld, two slurmd

    session_cluster_before = pids_of(cluster_conf().parent)
    down = cluster(throwaway, "down")
    assert down.returncode == 0, down.stderr
    assert pids_of(throwaway) == []
    # The session's own cluster (if any) is untouched.
    assert pids_of(cluster_conf().parent) == session_cluster_before
    assert cluster(throwaway, "status").returncode == 3


def test_up_with_a_taken_port_says_which_and_what_to_do(throwaway: Path) -> None:
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", PORT_BASE + 2))
        squatter.listen()
        up = cluster(throwaway, "up", "--nodes", "2", "--port-base", str(PORT_BASE))
    assert up.returncode == 1
    lines = up.stderr.strip().splitlines()
    assert len(lines) == 1
    assert f"port {PORT_BASE + 2} is already in use" in lines[0]
    assert "--port-base" in lines[0]
    assert pids_of(throwaway) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_missing_slurm_as_non_root_prints_one_line_with_the_install_command() -> None:
    # A copy readable by 'nobody', and a PATH without /usr/sbin where slurmctld lives.
    public = Path(tempfile.mkdtemp(prefix="resurgo-nobody-", dir="/tmp"))
    public.chmod(0o777)
    script = public / "cluster"
    shutil.copy(CLUSTER_SCRIPT, script)
    script.chmod(0o755)
    done = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "env",
            "-i",
            "PATH=/usr/bin:/bin",
            "/usr/bin/python3",
            str(script),
            "--dir",
            str(public / "c"),
            "up",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    shutil.rmtree(public)
    assert done.returncode == 1
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "apt-get install -y slurm-wlm munge" in lines[0]


# Two clusters side by side, each with a node1: far from the session cluster (17000)
# and from the single throwaway cluster above (17100).
SIDE_BY_SIDE_PORTS = (18000, 18100)
DAEMONS = ("munged", "slurmctld", "slurmd")


def daemons_of(directory: Path) -> set[int]:
    """Pids of the munged, slurmctld and slurmd whose command line names ``directory``."""
    found = set()
    for pid in pids_of(directory):
        try:
            binary = (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]).decode()
        except OSError:
            continue
        if Path(binary).name in DAEMONS:
            found.add(pid)
    return found


def tasks_of(conf: Path, node: str, command: bytes) -> set[int]:
    """Pids of processes running ``command`` as a task of ``conf``'s cluster on ``node``:
    the tasks themselves (``/usr/bin/sleep 300`` for ``sleep 300``), not the ``srun``
    naming them, nor the helper of the same command line that srun forks."""
    found = set()
    marks = {f"SLURM_CONF={conf}".encode(), f"SLURMD_NODENAME={node}".encode()}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            program, *args = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            environ = set((entry / "environ").read_bytes().split(b"\0"))
        except (OSError, ValueError):
            continue
        if b" ".join([Path(os.fsdecode(program)).name.encode(), *args]) == command and (
            marks <= environ
        ):
            found.add(int(entry.name))
    return found


def slurm(conf: Path, *argv: str) -> str:
    done = subprocess.run(
        list(argv),
        env=dict(os.environ, SLURM_CONF=str(conf)),
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.strip()


def wait_for(what: str, check: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.5)


@pytest.fixture
def two_clusters(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    first, second = tmp_path / "first", tmp_path / "second"
    yield first, second
    cluster(first, "down")
    cluster(second, "down")


def test_killing_a_node_of_one_cluster_leaves_the_other_clusters_job_running(
    two_clusters: tuple[Path, Path],
) -> None:
    if shutil.which("slurmctld") is None:
        pytest.fail("slurm-wlm is not installed: run deploy/setup")
    first, second = two_clusters
    # The cluster the rest of the suite runs on (CI keeps it up on 17000), if any.
    session = cluster_conf().parent
    session_daemons = daemons_of(session)
    for directory, port_base in zip(two_clusters, SIDE_BY_SIDE_PORTS, strict=True):
        # --dir after the action, as well as before it.
        up = subprocess.run(
            [sys.executable, str(CLUSTER_SCRIPT), "up", "--nodes", "2",
             "--port-base", str(port_base), "--dir", str(directory)],
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr
    for directory in two_clusters:
        for action in ("status", "env"):
            done = subprocess.run(
                [sys.executable, str(CLUSTER_SCRIPT), action, "--dir", str(directory)],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stderr
            assert str(directory) in done.stdout
    confs = [directory / "slurm.conf" for directory in two_clusters]
    command = b"sleep 300"
    for conf in confs:
        # One batch job per node, not one srun across both: a step's task on node2
        # belongs to the srun on node1, and dies with it when node1 is killed (seen
        # on a loaded machine, where the check came after node2's slurmstepd noticed).
        for node in ("node1", "node2"):
            slurm(conf, "sbatch", "-N1", f"--nodelist={node}", "-o", "/dev/null",
                  "--wrap", "sleep 300")  # fmt: skip
    for conf in confs:
        for node in ("node1", "node2"):
            wait_for(
                f"a task on {node} of {conf}", lambda c=conf, n=node: bool(tasks_of(c, n, command))
            )
    survivors = tasks_of(confs[1], "node1", command) | tasks_of(confs[1], "node2", command)
    second_daemons = daemons_of(second)

    killed = cluster(first, "kill-node", "node1")
    assert killed.returncode == 0, killed.stderr
    assert tasks_of(confs[0], "node1", command) == set()
    assert tasks_of(confs[0], "node2", command)  # a node of its own that was not killed
    # The first cluster's controller notices its node gone (SlurmdTimeout=10 s) ...
    wait_for(
        "the first cluster seeing node1 not responding",
        lambda: "*" in slurm(confs[0], "sinfo", "--noheader", "--nodes=node1", "--format=%t"),
    )
    # ... while the second cluster's jobs, and each of their processes, go on.
    assert slurm(confs[1], "squeue", "--noheader", "--format=%T").split() == ["RUNNING"] * 2
    assert "*" not in slurm(confs[1], "sinfo", "--noheader", "--format=%t")
    alive = tasks_of(confs[1], "node1", command) | tasks_of(confs[1], "node2", command)
    assert alive == survivors
    assert daemons_of(second) == second_daemons

    for directory in two_clusters:
        down = cluster(directory, "down")
        assert down.returncode == 0, down.stderr
        assert daemons_of(directory) == set()
    assert daemons_of(session) == session_daemons
