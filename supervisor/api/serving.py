"""Serving the API: the listener's lifecycle and aiohttp's own server log.

:func:`serve` starts an application of :mod:`supervisor.api.app` on a TCP
port, :func:`bound_port` says which one, :func:`shutdown` stops it. Requests
that are not valid HTTP never reach the application: aiohttp's parser
refuses them, and :class:`_ServerLog` sends those to the rate-limited refusal
log instead of a traceback each.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage

from supervisor.api.app import refusal_log
from supervisor.api.refusals import Cause, RefusalLog

logger = logging.getLogger(__name__)

# A request head not whole this long after the connection opened (or its last answer).
HEADER_TIMEOUT_S = 30.0
# Connections the kernel holds for the loop to accept (capped by net.core.somaxconn,
# 4096 on current kernels). aiohttp's default of 128 overflowed whenever thousands
# of agents opened connections at once (an agent's event connection idles longer
# than the keep-alive): each dropped SYN is sent again 1, 3, 7 s later, which held
# events for seconds and kept a /metrics scrape from connecting for 30 s.
LISTEN_BACKLOG = 4096


async def serve(
    app: web.Application,
    host: str,
    port: int,
    *,
    shutdown_timeout_s: float = 10.0,
    header_timeout_s: float = HEADER_TIMEOUT_S,
) -> web.AppRunner:
    """Listen on ``host:port`` (port 0: any free one, see :func:`bound_port`) and return the runner.

    Stop with :func:`shutdown`. Signals are left to the daemon (its handlers
    only enqueue), and there is no access log: one line per heartbeat of
    thousands of agents would drown everything else.

    A connection that has not sent a whole request head ``header_timeout_s``
    after it opened, or after its previous answer, is closed: aiohttp's
    keep-alive timer, which partial headers do not reset, is that timeout
    (aiohttp's own default is an hour, and 300 connections trickling their
    headers were held as long). An idle keep-alive connection is closed as
    late: clients close theirs sooner (aiohttp's client after 15 s).
    """
    refusals = refusal_log(app) or RefusalLog(logger, time.time)
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        shutdown_timeout=shutdown_timeout_s,
        logger=_ServerLog(refusals),
        keepalive_timeout=header_timeout_s,
    )
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG).start()
    except BaseException:
        await runner.cleanup()
        raise
    logger.info("API listening on %s", ", ".join(str(address) for address in runner.addresses))
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The TCP port the runner listens on (the one picked when :func:`serve` was given 0)."""
    return int(runner.addresses[0][1])


async def shutdown(runner: web.AppRunner) -> None:
    """Stop accepting, let in-flight requests finish (up to the shutdown timeout), close."""
    await runner.cleanup()


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server-level log, where a request that is not valid HTTP would be an ERROR.

    aiohttp logs every request its parser refuses (answered 400) with a
    traceback: a flood of garbage would fill the disk. Those go to the
    rate-limited refusal log instead, a client that hung up is no error at
    all, and anything else is a rate-limited ERROR.
    """

    def __init__(self, refusals: RefusalLog) -> None:
        super().__init__(logging.getLogger(f"{__name__}.http"), {})
        self._refusals = refusals

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        """Log like :meth:`logging.Logger.exception`, unless the client sent invalid HTTP."""
        error = sys.exc_info()[1] if exc_info is True else exc_info
        if isinstance(error, BadHttpMessage):
            self._refusals.record(400, Cause.BAD_HTTP.value, error.message, None)
            return
        if isinstance(error, ConnectionError):
            self._refusals.record(400, Cause.CLIENT_GONE.value, str(error), None)
            return
        if exc_info is True:
            self._refusals.internal_error(str(msg), *args)
        else:
            super().exception(msg, *args, exc_info=exc_info, **kwargs)
