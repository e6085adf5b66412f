"""The operator hook: a command of the site's that receives each drain ticket as JSON.

A supervisor without Slurm operator rights cannot drain a node it blamed; it
raises a drain ticket instead (:class:`supervisor.core.intents.DrainTicket`). When
``ticket_hook`` is set, the command runs once per ticket with the ticket as
one JSON object on its standard input, to open a ticket in the site's
tracker or mail the admins. Its outcome is kept with the ticket, in words; a
hook that fails or hangs never stops a recovery (the ticket stands in
``resurgo nodes``, on ``/metrics`` and as an alert either way).

The command line is split like a shell's (``shlex``) but runs without one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shlex
from collections.abc import Awaitable, Callable
from typing import Any

from supervisor.text import one_line

log = logging.getLogger(__name__)

HOOK_TIMEOUT_S = 60.0
# Of the hook's output, what is kept with the ticket.
KEPT_OUTPUT_CHARS = 300

TicketHook = Callable[[dict[str, Any]], Awaitable[str]]


def ticket_hook(command: str, timeout_s: float = HOOK_TIMEOUT_S) -> TicketHook | None:
    """The hook that runs ``command`` (None when it is empty)."""
    if not command.strip():
        return None
    argv = shlex.split(command)

    async def run(ticket: dict[str, Any]) -> str:
        return await run_hook(argv, ticket, timeout_s)

    return run


async def run_hook(argv: list[str], ticket: dict[str, Any], timeout_s: float) -> str:
    """Run ``argv`` with ``ticket`` on stdin; its outcome in words (never raises)."""
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as error:
        log.warning("ticket hook %s could not start: %s", argv[0], error)
        return f"hook did not start: {error}"
    try:
        output, _ = await asyncio.wait_for(
            process.communicate(json.dumps(ticket, sort_keys=True).encode() + b"\n"), timeout_s
        )
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        log.warning("ticket hook %s ran past %g s and was killed", argv[0], timeout_s)
        return f"hook killed after {timeout_s:g} s"
    said = one_line(output.decode(errors="replace").strip())[:KEPT_OUTPUT_CHARS]
    if process.returncode != 0:
        log.warning("ticket hook %s exited %d: %s", argv[0], process.returncode, said)
        return f"hook exited {process.returncode}: {said}".rstrip(": ")
    return f"hook ok: {said}".rstrip(": ")
