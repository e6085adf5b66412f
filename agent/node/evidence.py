"""The evidence a rank's exit carries beyond its status: the kernel's word on it.

For a rank that died abnormally the agent reads the kernel log once
(``dmesg``, bounded in time, shared by the ranks that die together) and
attaches what names the rank: the out-of-memory killer's line for its pid, or,
where the log is refused, the rise of its memory cgroup's ``oom_kill`` count
(:mod:`agent.node.kernlog`); and the newest GPU Xid error logged since the
agent started. Each piece is optional and bounded; none is waited for longer
than :data:`KERNEL_LOG_S`.
"""

from __future__ import annotations

import logging
import shutil
import signal
import time

import psutil

from agent.node import kernlog
from agent.node.healthchecks import run_bounded
from agent.node.procs import RankExit

log = logging.getLogger(__name__)

# The longest the kernel log is waited for, and how long one reading serves.
KERNEL_LOG_S = 2.0
REUSE_S = 1.0


class KernelLog:
    """``dmesg``'s text, read at most once a second; None where it is refused or missing."""

    def __init__(self, dmesg: str | None = None) -> None:
        self._dmesg = dmesg if dmesg is not None else shutil.which("dmesg")
        self._read_at: float | None = None
        self._text: str | None = None
        self.started_boot_s = max(time.time() - psutil.boot_time(), 0.0)

    async def text(self) -> str | None:
        now = time.monotonic()
        if self._read_at is not None and now - self._read_at < REUSE_S:
            return self._text
        self._read_at, self._text = now, None
        if self._dmesg is None:
            return None
        try:
            answer = await run_bounded([self._dmesg], KERNEL_LOG_S)
        except (TimeoutError, OSError) as error:
            log.info("kernel log not read: %s", error)
            return None
        if answer.returncode == 0:
            self._text = answer.output
        return self._text


def abnormal(rank_exit: RankExit) -> bool:
    """A rank ended by a signal or a failing status."""
    return rank_exit.signal is not None or rank_exit.exit_code not in (0, None)


def killed(rank_exit: RankExit) -> bool:
    """Ended by SIGKILL (directly, or as a wrapper's status 137)."""
    return rank_exit.signal == signal.SIGKILL or rank_exit.exit_code == 128 + signal.SIGKILL


async def kernel_evidence(rank_exit: RankExit, kernel: KernelLog) -> dict[str, str]:
    """The payload fields ``oom_kill`` and ``xid`` for ``rank_exit`` (only those found)."""
    if not abnormal(rank_exit):
        return {}
    text = await kernel.text()
    found: dict[str, str] = {}
    if killed(rank_exit):
        line = (
            kernlog.oom_kill_line(text, rank_exit.rank.pid, kernel.started_boot_s) if text else None
        )
        rose = rank_exit.oom_kills_while_running
        if line is not None:
            found["oom_kill"] = line
        elif rose:
            found["oom_kill"] = (
                f"the kernel killed {rose} process(es) for memory in the rank's cgroup "
                f"({rank_exit.rank.oom_counter}) while it ran"
            )
    xids = kernlog.hardware_xids(text, kernel.started_boot_s) if text else []
    if xids:
        found["xid"] = xids[-1]
    return found
