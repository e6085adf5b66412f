"""The rendezvous port: chosen by the OS on the master node and held until torchrun binds it."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import stat
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from agent import ports

SRUN_PRINTING = """#!/bin/sh
echo "$@" >> "$FAKE_LOG"
echo "srun: some chatter"
echo 40123
"""
SRUN_FAILING = """#!/bin/sh
echo "srun: error: Unable to create step" >&2
exit 1
"""


@pytest.mark.parametrize(
    ("text", "port"),
    [("40123\n", 40123), ("srun: warning\n  40123  \n", 40123), ("", None), ("0\n", None),
     ("65536\n", None), ("port 5\n", None), ("-1\n", None), ("40123\nboom\n", None)],
)  # fmt: skip
def test_the_probe_output_is_a_port_on_its_last_line_or_none(text: str, port: int | None) -> None:
    assert ports.parse_probe_output(text) == port


def test_the_probe_runs_in_the_drivers_process_only_on_the_master_node_itself() -> None:
    assert ports.probes_here("node1", {"SLURMD_NODENAME": "node1"})
    assert not ports.probes_here("node2", {"SLURMD_NODENAME": "node1"})
    assert not ports.probes_here("node1", {})


def test_the_remote_probe_is_one_overlapping_task_on_the_master_node() -> None:
    argv = ports.probe_argv("node3", "/venv/bin/python")
    assert argv[0] == "srun"
    assert {"--nodes=1", "--ntasks=1", "--overlap", "--nodelist=node3"} <= set(argv)
    assert argv[-3:] == ["/venv/bin/python", "-m", "agent.ports"]


def test_the_fallback_is_the_derived_port_which_collides_500_ids_apart() -> None:
    assert ports.derived_port("12", 3) == 29500 + 120 + 3
    assert ports.derived_port("12", 1) == ports.derived_port("512", 1)


def test_a_reserved_port_is_free_for_torchs_store_and_refused_to_a_plain_bind() -> None:
    from torch.distributed import TCPStore

    for libuv in (True, False):
        port = ports.reserve_port()
        plain = socket.socket()
        with pytest.raises(OSError) as refused:
            plain.bind(("", port))
        plain.close()
        assert refused.value.errno == errno.EADDRINUSE
        store = TCPStore("127.0.0.1", port, is_master=True, use_libuv=libuv,
                         timeout=timedelta(seconds=10), wait_for_workers=False)  # fmt: skip
        del store


def test_a_port_in_use_is_never_chosen_and_reservations_never_repeat() -> None:
    listening = socket.socket()
    listening.bind(("", 0))
    listening.listen()
    taken = listening.getsockname()[1]
    try:
        # ~14,000 ports are bind(0)'s to give: 1,000 released probes would repeat
        # one with near certainty; held ones (TIME_WAIT) never do.
        chosen = [ports.reserve_port() for _ in range(1000)]
    finally:
        listening.close()
    assert taken not in chosen
    assert len(set(chosen)) == len(chosen)


def _fake_srun(tmp_path: Path, text: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(text)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "FAKE_LOG": str(tmp_path / "srun.log"), "SLURMD_NODENAME": "node1"}  # fmt: skip


def test_another_master_node_is_asked_through_srun(tmp_path: Path) -> None:
    environ = _fake_srun(tmp_path, SRUN_PRINTING)
    port = asyncio.run(
        ports.rendezvous_port("node2", environ, sys.executable, job_id="7", attempt=1)
    )
    assert port == 40123
    assert "--nodelist=node2" in (tmp_path / "srun.log").read_text()


def test_on_the_master_node_itself_no_srun_runs(tmp_path: Path) -> None:
    environ = _fake_srun(tmp_path, SRUN_PRINTING)
    port = asyncio.run(
        ports.rendezvous_port("node1", environ, sys.executable, job_id="7", attempt=1)
    )
    assert 0 < port < 65536 and port != 40123
    assert not (tmp_path / "srun.log").exists()


def test_a_failed_probe_falls_back_to_the_derived_port_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    environ = _fake_srun(tmp_path, SRUN_FAILING)
    port = asyncio.run(
        ports.rendezvous_port("node2", environ, sys.executable, job_id="7", attempt=2)
    )
    assert port == ports.derived_port("7", 2)
    assert "Unable to create step" in caplog.text
    assert "derived port" in caplog.text
