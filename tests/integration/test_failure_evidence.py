"""What a failed rank's exit says about the failure: real torchrun ranks under a real agent.

The exception's message and errno, the rank's last lines on standard error,
and the kernel's out-of-memory kill reach the ``rank_exited`` event
(agent.wire.raised, agent.node.rankexec, agent.node.evidence).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.wire.protocol import EventKind
from tests.cgroups import memory_cgroup
from tests.integration.agent_harness import RunningAgent


@pytest.fixture
def run_script(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    started: list[RunningAgent] = []

    def start(code: str) -> dict[int, dict[str, object]]:
        script = tmp_path / "failing.py"
        script.write_text(code)
        command = ["torchrun", "--nproc-per-node=2", str(script)]
        agent = RunningAgent(tmp_path, [], [], script, command)
        started.append(agent)
        agent.wait_event(EventKind.LAUNCHER_EXITED, 90)
        return {
            e.payload["global_rank"]: dict(e.payload)
            for e in agent.events()
            if e.kind is EventKind.RANK_EXITED
        }

    yield start
    for agent in started:
        agent.stop()


# Rank 1 cannot write its checkpoint: the disk is full. Rank 0 waits to be stopped.
FULL_DISK = """
import errno, os, sys, time
if os.environ["RANK"] == "1":
    print("saving step 30", file=sys.stderr, flush=True)
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/ckpt/step-30/shard-1.distcp")
time.sleep(60)
"""


def test_a_full_disk_reaches_the_exit_with_its_errno_message_and_traceback(run_script) -> None:  # type: ignore[no-untyped-def]
    exits = run_script(FULL_DISK)
    failed = exits[1]
    assert (failed["exit_code"], failed["raised"], failed["errno"]) == (1, "OSError", 28)
    assert failed["raised_message"] == (
        "[Errno 28] No space left on device: '/ckpt/step-30/shard-1.distcp'"
    )
    tail = str(failed["stderr_tail"])
    assert tail.startswith("saving step 30\nTraceback (most recent call last):"), tail
    assert tail.endswith(
        "OSError: [Errno 28] No space left on device: '/ckpt/step-30/shard-1.distcp'"
    )
    assert "oom_kill" not in failed and "errno" not in exits[0]


# Rank 1 joins a cgroup limited to 200 MiB and allocates past it.
OOM = """
import os, sys, time
if os.environ["RANK"] == "1":
    with open(sys.argv[1] + "/cgroup.procs", "w") as procs:
        procs.write(str(os.getpid()))
    hoard = []
    while True:
        hoard.append(bytearray(16 << 20))
time.sleep(60)
"""


def test_a_rank_killed_for_memory_carries_the_kernels_line(run_script, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    cgroup = memory_cgroup(200 << 20)
    assert cgroup is not None, "no memory cgroup controller writable on this machine"
    try:
        exits = run_script(OOM.replace("sys.argv[1]", repr(str(cgroup))))
    finally:
        with contextlib.suppress(OSError):
            cgroup.rmdir()
    killed = exits[1]
    assert killed["signal_name"] == "SIGKILL", killed
    assert f"Killed process {killed['pid']} (" in str(killed["oom_kill"]), killed
    assert "oom_kill" not in exits[0]


if sys.platform != "linux":  # pragma: no cover
    pytestmark = pytest.mark.skip("Linux only")
