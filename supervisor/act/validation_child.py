"""The checkpoint validation process: the supervisor's validator, run apart from it.

``python -m supervisor.act.validation_child MEMORY_MIB CPU_S PARENT`` imports the
validator (and torch), caps its own address space at what that took plus
``MEMORY_MIB``, dies with the process PARENT (the supervisor), says
``{"ready": true}`` on one line, then answers one JSON
request per line (``{"path": ..., "level": ...}``) with one JSON line
(``{"valid": ..., "reason": ...}``). Before each request its CPU-time limit
is set ``CPU_S`` past what it has used: a checkpoint whose content takes
longer is ended by SIGXCPU. A checkpoint is the job owner's data: what it
does to this process (memory, time, a crash in a C extension) cannot reach
the supervisor, which reads the verdict or the process's death
(:mod:`supervisor.act.validation`).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import resource
import signal
import sys
from typing import Any

READY = {"ready": True}
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """Be killed when the supervisor dies (a SIGKILL, a crash): a validation nobody
    waits for must not go on reading someone's checkpoint."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(0)


def _address_space_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_used_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _answer(request: dict[str, Any], memory_mib: int) -> dict[str, Any]:
    from agent.checkpoint import layouts
    from agent.checkpoint.report import Level
    from agent.checkpoint.validate import NEEDS_MORE_MEMORY

    past_limit = {
        "valid": False,
        "reason": f"validating it needed more than {memory_mib} MiB (the supervisor's "
        "validation_memory_mib): its content expands beyond any checkpoint's",
    }
    try:
        report = layouts.check(str(request["path"]), Level(str(request["level"])))
    except MemoryError:
        return past_limit
    except Exception as error:  # the owner's data made the validator fail: not valid
        return {"valid": False, "reason": f"validation failed: {type(error).__name__}: {error}"}
    if not report.valid and NEEDS_MORE_MEMORY in (report.reason or ""):
        return past_limit  # the validator's own words for it, in this process: its limit
    return {"valid": report.valid, "reason": report.reason or ""}


def main(argv: list[str]) -> int:
    memory_mib, cpu_s, parent = int(argv[0]), float(argv[1]), int(argv[2])
    _die_with_parent(parent)
    if len(argv) > 3:  # a background validator yields the CPU to everything else
        os.nice(int(argv[3]))
    # The warm-up: the validator and torch imported once, before any checkpoint is read.
    importlib.import_module("agent.checkpoint.validate")

    limit = _address_space_bytes() + (memory_mib << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    print(json.dumps(READY), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(_cpu_used_s() + cpu_s) + 1
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        print(json.dumps(_answer(request, memory_mib)), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # the supervisor is gone: nobody reads the answer
        os._exit(0)
