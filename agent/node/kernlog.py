"""What the node's kernel says about a rank that died: an out-of-memory kill, a GPU's Xid.

A rank killed by SIGKILL may have been killed by a person, by Slurm, or by the
kernel's out-of-memory killer; only the kernel tells them apart. Two sources,
either may be missing:

- the memory cgroup of the rank, read while it runs (:func:`memory_cgroup`):
  its ``oom_kill`` counter (cgroup v2 ``memory.events``, v1
  ``memory.oom_control``) rose while the rank ran. Readable by the job's own
  user; says "someone in the rank's cgroup was killed for memory";
- the kernel log (``dmesg``): the line ``Killed process <pid>`` names the
  rank itself, and ``NVRM: Xid`` lines name GPU errors. Often refused to a
  user who is not root (``kernel.dmesg_restrict``): then only the counter
  speaks.

The parsing is pure; :func:`memory_cgroup` and :func:`oom_kills` read ``/proc``
and ``/sys`` and never raise.
"""

from __future__ import annotations

import re
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
XID_MARK = "NVRM: Xid"
XID_CODE = re.compile(r"NVRM: Xid \([^)]*\): (\d+)")
# Xids an application causes (a bad kernel, a memory fault, a killed CUDA
# process, a reset channel): Resurgo's own stops leave some behind; they say
# nothing about the node's hardware.
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
# "[ 7263.207093] " or "[Sat Dec  5 23:41:02 2026] " before a kernel line.
_STAMP = re.compile(r"^\[\s*([0-9]+(?:\.[0-9]+)?)\]\s*|^\[[^\]]*\]\s*")
LINE_CHARS = 300


def memory_cgroup(pid: int, proc: Path = Path("/proc"), root: Path = CGROUP_ROOT) -> Path | None:
    """The file holding the ``oom_kill`` counter of ``pid``'s memory cgroup (None: unknown)."""
    try:
        lines = (proc / str(pid) / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        relative = path.lstrip("/")
        if number == "0" and controllers == "":
            for base in (root, root / "unified"):
                events = base / relative / "memory.events"
                if events.is_file():
                    return events
        elif "memory" in controllers.split(","):
            control = root / "memory" / relative / "memory.oom_control"
            if control.is_file():
                return control
    return None


def oom_kills(counter: Path | None) -> int | None:
    """The ``oom_kill`` count in ``counter`` (a :func:`memory_cgroup` file); None: unreadable."""
    if counter is None:
        return None
    try:
        text = counter.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _bare(line: str) -> str:
    return _STAMP.sub("", line.strip())[:LINE_CHARS]


def oom_kill_line(kernel_log: str, pid: int, since_boot_s: float = 0.0) -> str | None:
    """The kernel's line saying it killed ``pid`` for memory (its newest), or None.

    Only lines stamped at or after ``since_boot_s`` seconds after boot count (lines
    without a stamp always do): pids are reused (32768 of them by default), and an
    older process's out-of-memory kill under the same pid would turn a rank's
    SIGKILL, a node fault, into the script's memory use.
    """
    killed = re.compile(rf"Killed process {pid} \(|[ ,]pid={pid},")
    found = [
        line
        for line in kernel_log.splitlines()
        if killed.search(line) and _stamped_since(line, since_boot_s)
    ]
    chosen = [line for line in found if "Killed process" in line] or found
    return _bare(chosen[-1]) if chosen else None


def xid_code(line: str) -> int | None:
    """The Xid number of a kernel log line (None when it has none)."""
    found = XID_CODE.search(line)
    return int(found.group(1)) if found else None


def hardware_xids(kernel_log: str, since_boot_s: float = 0.0) -> list[str]:
    """``NVRM: Xid`` lines of GPU errors (not :data:`APPLICATION_XIDS`) stamped at or after
    ``since_boot_s`` seconds after boot (lines without a stamp always count)."""
    lines = []
    for line in kernel_log.splitlines():
        if XID_MARK not in line or xid_code(line) in APPLICATION_XIDS:
            continue
        if _stamped_since(line, since_boot_s):
            lines.append(_bare(line))
    return lines


def _stamped_since(line: str, since_boot_s: float) -> bool:
    """Whether ``line``'s stamp (seconds since boot) is ``since_boot_s`` or later; a line
    without a stamp is."""
    stamp = _STAMP.match(line.strip())
    return not (stamp and stamp.group(1) is not None and float(stamp.group(1)) < since_boot_s)
