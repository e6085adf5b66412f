"""The node health check: an operator's command, like Slurm's HealthCheckProgram / NHC.

Exit status 0 means healthy; anything else, a timeout, or a command that
cannot start means unhealthy. The output's tail travels with the event so the
operator sees why without logging in to the node.
"""

from __future__ import annotations

import asyncio
import shlex
from dataclasses import dataclass

OUTPUT_TAIL_BYTES = 2048


@dataclass(frozen=True)
class HealthResult:
    """Outcome of one run of the health-check command."""

    command: str
    healthy: bool
    exit_code: int | None
    output_tail: str
    reason: str


async def run_health_check(command: str, timeout_s: float) -> HealthResult:
    """Run ``command`` (split like a shell would, but without a shell) within ``timeout_s``."""
    try:
        argv = shlex.split(command)
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
    except (OSError, ValueError) as error:
        return HealthResult(command, False, None, "", f"could not start: {error}")
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        process.kill()
        await process.wait()
        return HealthResult(command, False, None, "", f"timed out after {timeout_s:.0f} s")
    tail = output[-OUTPUT_TAIL_BYTES:].decode(errors="replace")
    code = process.returncode
    if code == 0:
        return HealthResult(command, True, 0, tail, "exit status 0")
    return HealthResult(command, False, code, tail, f"exit status {code}")
