"""The Slurm commands the driver runs for its own job: ``scontrol`` (its nodes, their
addresses, its requeue), ``squeue`` (its time left) and a bounded run of an
``srun``. The supervisor's Slurm adapter is the one place that administers Slurm."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
from collections.abc import Mapping, Sequence

from agent.timelimit import parse_slurm_duration
from agent.wire.errors import ConfigError, ResurgoError

log = logging.getLogger("resurgo.driver")


async def capture(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """Run ``argv`` (30 s at most) and return its standard output; ResurgoError, with
    its standard error, when it fails."""
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=dict(environ)
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=30)
    if process.returncode != 0:
        raise ResurgoError(f"`{' '.join(argv)}` failed: {err.decode(errors='replace').strip()}")
    return out.decode()


async def run_bounded(argv: Sequence[str], environ: Mapping[str, str], limit_s: float) -> str:
    """Run ``argv`` to its end within ``limit_s`` and return its standard output, whatever
    its exit status; on timeout or cancellation its process group is killed."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=dict(environ),
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout=limit_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
    return out.decode(errors="replace")


async def current_nodes(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The batch job's nodes now (``scontrol show hostnames`` of ``SLURM_JOB_NODELIST``)."""
    node_list = environ.get("SLURM_JOB_NODELIST", "")
    if not node_list:
        raise ConfigError("SLURM_JOB_NODELIST is not set")
    argv = ["scontrol", "show", "hostnames", node_list]
    return tuple((await capture(argv, environ)).split())


async def node_address(node: str, environ: Mapping[str, str]) -> str:
    """The address other nodes reach ``node`` at (its Slurm NodeAddr)."""
    text = await capture(["scontrol", "show", "node", node], environ)
    found = re.search(r"NodeAddr=(\S+)", text)
    return found.group(1) if found else node


async def time_left(job_id: str, environ: Mapping[str, str]) -> tuple[float | None, float | None]:
    """(seconds left, the time limit) of job ``job_id`` as Slurm has them now; None unknown."""
    argv = ["squeue", "-h", "-j", job_id, "-o", "%L %l"]
    try:
        words = (await capture(argv, environ)).split()
    except (ResurgoError, OSError, TimeoutError) as error:
        log.warning("could not read the job's time left: %s", error)
        return None, None
    if len(words) != 2:
        return None, None
    return parse_slurm_duration(words[0]), parse_slurm_duration(words[1])
