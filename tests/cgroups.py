"""A memory cgroup for a test's rank to run out of memory in (root only; cgroup v1 or v2)."""

from __future__ import annotations

import uuid
from pathlib import Path


def memory_cgroup(limit_bytes: int) -> Path | None:
    """A fresh memory cgroup limited to ``limit_bytes`` with no swap (cgroup v1 or v2), or
    None where this machine has no memory controller to make one in."""
    name = f"resurgo-test-{uuid.uuid4().hex[:8]}"
    v1 = {"memory.limit_in_bytes": limit_bytes, "memory.memsw.limit_in_bytes": limit_bytes}
    v2 = {"memory.max": limit_bytes, "memory.swap.max": 0}
    for folder, limits in ((Path("/sys/fs/cgroup/memory") / name, v1),
                           (Path("/sys/fs/cgroup") / name, v2)):  # fmt: skip
        try:
            folder.mkdir()
        except OSError:
            continue
        if not (folder / next(iter(limits))).exists():
            folder.rmdir()
            continue
        for limit, value in limits.items():
            if (folder / limit).exists():
                (folder / limit).write_text(str(value))
        return folder
    return None
