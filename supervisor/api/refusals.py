"""Why the API refuses a request, and a log of refusals that a flood cannot fill the disk with.

Every refusal has a :class:`Cause` (a stable short code, sent to the client
and used as the log key) with its HTTP status. :class:`RefusalLog` writes one
WARNING line per refused request (INFO for an unknown job: a job submitted a
moment ago calls in before it is registered), but at most ``per_window`` per
cause per window; the rest are counted and summarised in one line when the
window ends.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from supervisor.errors import RequestRefused


class Cause(enum.Enum):
    """Why a request was refused; the value is the code in the answer's JSON and in the log."""

    MISSING_AUTH = "missing_auth"  # a signing header is absent
    MALFORMED_AUTH = "malformed_auth"  # a signing header is present but not well formed
    UNKNOWN_JOB = "unknown_job"
    BAD_SIGNATURE = "bad_signature"
    STALE_TIMESTAMP = "stale_timestamp"  # outside the replay window
    CROSS_JOB = "cross_job"  # one job's credentials acting on another job
    FOREIGN_NODE = "foreign_node"  # about a node outside the job's current allocation
    UNKNOWN_RANK = "unknown_rank"  # about a rank the job's world never had
    RATE_LIMITED = "rate_limited"  # the job sent more events than its budget a minute
    TOO_LARGE = "too_large"
    MALFORMED = "malformed"  # not JSON, or not the protocol's schema
    UNSUPPORTED_PROTOCOL = "unsupported_protocol"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    BAD_HTTP = "bad_http"  # not valid HTTP/1.1; refused by aiohttp's parser before any handler
    OUTSIDE_ROOT = "outside_root"  # a checkpoint path outside the job's checkpoint root
    BODY_TIMEOUT = "body_timeout"  # the body did not arrive within the body timeout
    BUSY = "busy"  # unauthenticated bodies already hold the buffer cap; retry later
    # The client went away before its request was read: nobody gets the answer.
    CLIENT_GONE = "client_gone"
    INTERNAL = "internal"  # a bug behind a handler (answered 500, logged with its traceback)

    @property
    def status(self) -> int:
        """The HTTP status a request refused for this cause is answered with."""
        return _STATUS[self]

    def refuse(self, reason: str) -> RequestRefused:
        """The error that, raised in a handler, answers ``status`` with ``reason``."""
        return RequestRefused(self.status, self.value, reason)


_STATUS = {
    Cause.MISSING_AUTH: 401,
    Cause.MALFORMED_AUTH: 401,
    Cause.UNKNOWN_JOB: 401,
    Cause.BAD_SIGNATURE: 401,
    Cause.STALE_TIMESTAMP: 401,
    Cause.CROSS_JOB: 403,
    Cause.FOREIGN_NODE: 403,
    Cause.UNKNOWN_RANK: 400,
    Cause.RATE_LIMITED: 429,
    Cause.TOO_LARGE: 413,
    Cause.MALFORMED: 400,
    Cause.UNSUPPORTED_PROTOCOL: 400,
    Cause.NOT_FOUND: 404,
    Cause.METHOD_NOT_ALLOWED: 405,
    Cause.BAD_HTTP: 400,
    Cause.OUTSIDE_ROOT: 403,
    Cause.BODY_TIMEOUT: 408,
    Cause.BUSY: 503,
    Cause.CLIENT_GONE: 400,
    Cause.INTERNAL: 500,
}

_LOGGED_CHARS = 300


@dataclass
class _Window:
    """Refusals of one cause since ``start``."""

    start: float
    count: int = 0


class RefusalLog:
    """Logs refusals at WARNING: the first ``per_window`` per cause per window, then a count.

    ``totals`` counts every refusal by cause code since start (for /healthz).
    Attacker-controlled text (job id, reason) is clipped and ``repr``-quoted, so
    a request cannot forge log lines.
    """

    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float],
        per_window: int = 20,
        window_s: float = 60.0,
    ) -> None:
        self._logger = logger
        self._clock = clock
        self._per_window = per_window
        self._window_s = window_s
        self._windows: dict[str, _Window] = {}
        self.totals: Counter[str] = Counter()

    def record(self, status: int, cause: str, reason: str, job: str | None) -> None:
        """Count one refusal and log it unless its cause already filled this window."""
        if self._count(cause):
            # A job submitted moments ago calls in before the next poll registers it:
            # its driver's first questions are refused and asked again, no warning.
            level = logging.INFO if cause == Cause.UNKNOWN_JOB.value else logging.WARNING
            self._logger.log(
                level,
                "refused request: job=%s status=%d cause=%s reason=%r",
                "-" if job is None else repr(job[:64]),
                status,
                cause,
                reason[:_LOGGED_CHARS],
            )

    def internal_error(self, message: str, *args: object) -> None:
        """Log an unexpected error with its traceback (call in an ``except``), at most
        ``per_window`` per window like refusals: a bug a client can trigger must not
        fill the disk either."""
        if self._count(Cause.INTERNAL.value):
            self._logger.error(message, *args, exc_info=True)

    def _count(self, cause: str) -> bool:
        """Count one of ``cause``; whether it may be logged in the current window."""
        now = self._clock()
        self.flush(now)
        self.totals[cause] += 1
        window = self._windows.setdefault(cause, _Window(start=now))
        window.count += 1
        return window.count <= self._per_window

    def flush(self, now: float) -> None:
        """Close the windows that ended by ``now``, logging how many lines each suppressed."""
        for cause, window in list(self._windows.items()):
            if now - window.start < self._window_s:
                continue
            del self._windows[cause]
            suppressed = window.count - self._per_window
            if suppressed > 0:
                self._logger.warning(
                    "refused %d more requests with cause=%s in %.0f s without logging each",
                    suppressed,
                    cause,
                    now - window.start,
                )
