"""What a dead rank's exit carries from the kernel (agent.node.evidence), sources faked."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

from agent.node.evidence import KernelLog, kernel_evidence
from agent.node.procs import RankExit, RankProcess


class Log(KernelLog):
    """A kernel log that is ``text`` (None: refused, as dmesg is to most users)."""

    def __init__(self, text: str | None, started_boot_s: float = 0.0) -> None:
        super().__init__()
        self._fixed = text
        self.started_boot_s = started_boot_s

    async def text(self) -> str | None:
        return self._fixed


def _exit(tmp_path: Path, signum: int | None, code: int | None, kills: tuple[int, int]) -> RankExit:
    counter = tmp_path / "memory.events"
    counter.write_text(f"oom {kills[1]}\noom_kill {kills[1]}\n")
    rank = RankProcess(1, 1, 689, shim_pid=688, oom_counter=counter, oom_kills_at_start=kills[0])
    return RankExit(rank, code, signum, 0.0)


KERNEL = (
    "[72637.207093] Memory cgroup out of memory: Killed process 689 (python3) total-vm:82356kB\n"
    "[72638.000000] NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', GPU has fallen off the bus.\n"
)


def test_the_kernels_own_line_names_the_killed_rank(tmp_path: Path) -> None:
    found = asyncio.run(kernel_evidence(_exit(tmp_path, signal.SIGKILL, None, (0, 1)), Log(KERNEL)))
    assert found == {
        "oom_kill": "Memory cgroup out of memory: Killed process 689 (python3) total-vm:82356kB",
        "xid": "NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', GPU has fallen off the bus.",
    }


def test_where_the_log_is_refused_the_cgroups_count_speaks(tmp_path: Path) -> None:
    found = asyncio.run(kernel_evidence(_exit(tmp_path, signal.SIGKILL, None, (2, 3)), Log(None)))
    assert found["oom_kill"].startswith("the kernel killed 1 process(es) for memory")
    unchanged = _exit(tmp_path, signal.SIGKILL, None, (3, 3))
    assert asyncio.run(kernel_evidence(unchanged, Log(None))) == {}  # a person's kill -9


def test_a_clean_exit_asks_nothing_and_a_failure_gets_no_oom_line(tmp_path: Path) -> None:
    assert asyncio.run(kernel_evidence(_exit(tmp_path, None, 0, (0, 1)), Log(KERNEL))) == {}
    failed = asyncio.run(kernel_evidence(_exit(tmp_path, None, 1, (0, 1)), Log(KERNEL)))
    assert set(failed) == {"xid"}  # exit 1 is no kill, but a GPU error is worth naming
    later = Log(KERNEL, started_boot_s=80000.0)  # the Xid came before this agent started
    assert asyncio.run(kernel_evidence(_exit(tmp_path, None, 1, (0, 0)), later)) == {}
