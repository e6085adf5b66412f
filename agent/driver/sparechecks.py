"""The idle spares' health checks (:mod:`agent.node.sparecheck`), run beside a step
when the supervisor asks, and their failures reported back to it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence

from agent.driver.argv import spare_check_argv
from agent.driver.settings import Ask, DriverSettings
from agent.driver.slurm import run_bounded
from agent.node.sparecheck import parse_verdicts
from agent.wire import protocol
from agent.wire.protocol import DriverPhase, DriverRequest

log = logging.getLogger("resurgo.driver")

# The longest an idle spares' health-check step may take: each check bounds
# itself (the agents' health timeouts); this bounds srun on a node that hangs.
SPARE_CHECK_LIMIT_S = 180.0


class SpareChecks:
    """At most one health check of the idle spares at a time, beside the running step."""

    def __init__(self, settings: DriverSettings, environ: Mapping[str, str], ask: Ask) -> None:
        self.settings = settings
        self._environ = environ
        self._ask = ask
        self._check: asyncio.Task[None] | None = None

    def start(self, spares: Sequence[str], attempt: int, rendezvous: tuple[str, int]) -> None:
        """Check ``spares`` against the world at ``rendezvous``, unless a check still runs."""
        if self._check is not None and not self._check.done():
            return
        self._check = asyncio.ensure_future(self._run(tuple(spares), attempt, rendezvous))

    async def stop(self) -> None:
        """End a check still running: the step it ran beside is over."""
        check, self._check = self._check, None
        if check is not None and not check.done():
            check.cancel()
            await asyncio.gather(check, return_exceptions=True)

    async def _run(
        self, spares: tuple[str, ...], attempt: int, rendezvous: tuple[str, int]
    ) -> None:
        """Run the health gate on ``spares`` and tell the supervisor what failed. A spare
        that gave no verdict (srun could not run the check there) is not reported:
        Slurm's own view of the node says what became of it."""
        argv = spare_check_argv(self.settings, spares, *rendezvous)
        try:
            output = await run_bounded(argv, self._environ, SPARE_CHECK_LIMIT_S)
        except (OSError, TimeoutError) as error:
            log.warning("spare check on %s gave no answer: %s", ",".join(spares), error)
            return
        verdicts = parse_verdicts(output, spares)
        unhealthy = tuple(
            (node, protocol.clip_text(verdict.failures(), protocol.MAX_SPARE_DETAIL_CHARS))
            for node, verdict in sorted(verdicts.items())
            if not verdict.healthy
        )
        silent = [node for node in spares if node not in verdicts]
        log.info(
            "spare check: %d healthy, %d unhealthy%s%s",
            len(verdicts) - len(unhealthy), len(unhealthy),
            "".join(f"; {node}: {detail}" for node, detail in unhealthy),
            f"; no verdict from {','.join(silent)}" if silent else "",
        )  # fmt: skip
        if verdicts:
            await self._ask(
                DriverRequest(
                    self.settings.job_id, DriverPhase.SPARE_CHECK, attempt=attempt,
                    checked=tuple(sorted(verdicts)), unhealthy=unhealthy,
                ),
                wait_s=self.settings.request_timeout_s,
            )  # fmt: skip
