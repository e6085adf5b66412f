"""The node's health: the gate before every launch, and the operator's health-check command.

The gate (:func:`run_gate`) runs before every launch and relaunch on each node
that will run ranks: the built-in checks of :mod:`agent.node.healthchecks`,
which need no configuration, and the operator's command when one is set, like
Slurm's HealthCheckProgram / NHC. All run at once, each bounded in time, so the
gate takes about as long as its slowest check.

The command's exit status 0 means healthy; anything else, a timeout, or a
command that cannot start means unhealthy. Its output's tail travels with the
event so the operator sees why without logging in to the node.
"""

from __future__ import annotations

import asyncio
import shlex
import time
from dataclasses import dataclass
from typing import Any

from agent.node.healthchecks import CheckResult, GateInputs, run_bounded, run_builtin_checks
from agent.wire import protocol

OUTPUT_TAIL_BYTES = 2048
# The health_check_failed event's output_tail: the check lines come last, so the
# supervisor's blame, which quotes the tail, names the failing ones.
EVENT_TAIL_CHARS = 4096


@dataclass(frozen=True)
class HealthResult:
    """Outcome of one run of the health-check command."""

    command: str
    healthy: bool
    exit_code: int | None
    output_tail: str
    reason: str


@dataclass(frozen=True)
class GateReport:
    """Every check of one gate run; ``command``: the operator command's own outcome, for
    its exit status and output (None: no command ran)."""

    results: tuple[CheckResult, ...]
    command: HealthResult | None = None

    @property
    def healthy(self) -> bool:
        """True when every check passed."""
        return all(result.ok for result in self.results)

    def lines(self) -> list[str]:
        """One line per check, the failures last (the end of a text is what gets quoted)."""
        return [result.line() for result in sorted(self.results, key=lambda r: not r.ok)]

    def failure_payload(self) -> dict[str, Any]:
        """The ``health_check_failed`` payload: the failing checks by name, the command's
        exit status when it failed, its output and every check's line."""
        failed = [result for result in self.results if not result.ok]
        command = self.command if self.command is not None and not self.command.healthy else None
        output = command.output_tail.rstrip("\n") if command is not None else ""
        text = "\n".join([*([output] if output else []), *self.lines()])
        return {
            "command": [protocol.clip_text(result.name, 4096) for result in failed],
            "exit_code": None if command is None else command.exit_code,
            "output_tail": protocol.clip_text(text + "\n", EVENT_TAIL_CHARS),
            "timed_out": any(result.timed_out for result in failed),
        }


async def run_gate(inputs: GateInputs, command: str, command_timeout_s: float) -> GateReport:
    """The launch's health gate: the built-in checks and, when set, the operator's command,
    concurrently; see the module docstring."""
    if not command:
        return GateReport(tuple(await run_builtin_checks(inputs)))
    builtins, operator = await asyncio.gather(
        run_builtin_checks(inputs), command_report(command, command_timeout_s)
    )
    return GateReport((*builtins, *operator.results), operator.command)


async def command_report(command: str, timeout_s: float) -> GateReport:
    """:func:`run_health_check` as a report of one check, named by the command, its detail
    ending with the output's last line: alone, it is the periodic check while the ranks run."""
    start = time.monotonic()
    result = await run_health_check(command, timeout_s)
    last = (result.output_tail.strip().splitlines() or [""])[-1]
    detail = f"{result.reason}: {last}" if last else result.reason
    timed_out = result.exit_code is None and "timed out" in result.reason
    check = CheckResult(command, result.healthy, detail, time.monotonic() - start, timed_out)
    return GateReport((check,), result)


async def run_health_check(command: str, timeout_s: float) -> HealthResult:
    """Run ``command`` (split like a shell would, but without a shell) within ``timeout_s``;
    on timeout its whole process group is killed."""
    try:
        argv = shlex.split(command)
        if not argv:
            raise ValueError("the command is empty")
        answer = await run_bounded(argv, timeout_s)
    except TimeoutError:
        return HealthResult(command, False, None, "", f"timed out after {timeout_s:.0f} s")
    except (OSError, ValueError) as error:
        return HealthResult(command, False, None, "", f"could not start: {error}")
    tail = answer.output.encode()[-OUTPUT_TAIL_BYTES:].decode(errors="replace")
    code = answer.returncode
    if code == 0:
        return HealthResult(command, True, 0, tail, "exit status 0")
    return HealthResult(command, False, code, tail, f"exit status {code}")
