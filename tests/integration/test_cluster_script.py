"""deploy/slurm/cluster: a second, throwaway cluster brought up and down for real."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import CLUSTER_SCRIPT

pytestmark = pytest.mark.slurm

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

    session_cluster_before = pids_of(CLUSTER_SCRIPT.parents[2] / ".cluster")
    down = cluster(throwaway, "down")
    assert down.returncode == 0, down.stderr
    assert pids_of(throwaway) == []
    # The session's own cluster (if any) is untouched.
    assert pids_of(CLUSTER_SCRIPT.parents[2] / ".cluster") == session_cluster_before
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
