"""Run an async tick forever at a fixed period, surviving its failures.

The agent's and the supervisor's loops are made of these: one bad tick (a
bug, an unexpected answer) is logged with its traceback and the next one runs
on time; only cancellation stops the loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable


async def every(
    period_s: float, tick: Callable[[], Awaitable[object]], log: logging.Logger, what: str
) -> None:
    """Run ``tick`` every ``period_s`` until cancelled; a failing tick is logged, not fatal."""
    while True:
        try:
            await tick()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s tick %s failed; continuing", what, tick.__name__)
        await asyncio.sleep(period_s)
