"""Where the node agent's events go: the supervisor's spooling reporter and/or a local log.

With a supervisor URL, every event goes through :class:`agent.node.client.Reporter`
(spooled, signed, delivered in order exactly once). With an events log, each
event is also appended there as one JSON line (``protocol.encode_event``): an
operator's record on the node, and what tests read when no supervisor runs.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.node.client import Reporter
from agent.node.config import AgentConfig
from agent.wire import protocol
from agent.wire.auth import load_secret
from agent.wire.errors import ConfigError

log = logging.getLogger(__name__)


class EventOut:
    """Emits events with ids: to the supervisor's spooling reporter and/or a local
    JSON-lines log."""

    def __init__(self, config: AgentConfig, run_dir: Path, on_command: Callable[[Any], None]):
        self._config = config
        self._log_path = Path(config.events_log) if config.events_log else None
        self._reporter: Reporter | None = None
        self._incarnation = secrets.token_hex(8)
        self._seq = 0
        if config.supervisor_url:
            if not config.secret_file:
                raise ConfigError(
                    "a supervisor URL needs the job's secret: pass --secret-file (0600)"
                )
            self._reporter = Reporter(
                config.supervisor_url,
                config.job_id,
                config.node,
                load_secret(Path(config.secret_file)),
                run_dir / "spool",
                on_command=on_command,
                aggregator_url=config.aggregator_url,
            )
            self._incarnation = self._reporter.incarnation

    @property
    def incarnation(self) -> str:
        """This agent run's token: part of every event id."""
        return self._incarnation

    async def start(self) -> None:
        """Start delivering (the reporter's sender task)."""
        if self._reporter is not None:
            await self._reporter.start()

    async def emit(self, kind: protocol.EventKind, payload: dict[str, Any]) -> None:
        """Give the event its id and send it; a payload the protocol refuses raises."""
        if self._reporter is not None:
            event = await self._reporter.emit(kind, payload)
        else:
            self._seq += 1
            event = protocol.make_event(
                kind,
                self._config.job_id,
                self._config.node,
                self._incarnation,
                self._seq,
                time.time(),
                payload,
            )
        log.info("event %s %s", kind.value, _summary(payload))
        if self._log_path is not None:
            with open(self._log_path, "ab") as handle:
                handle.write(protocol.encode_event(event) + b"\n")
                handle.flush()

    @property
    def undelivered(self) -> int:
        """Events spooled and not yet acknowledged by the supervisor (none without one)."""
        return self._reporter.pending if self._reporter is not None else 0

    async def heartbeat(self, report: protocol.HeartbeatReport) -> None:
        """Best-effort heartbeat report (nothing without a supervisor)."""
        if self._reporter is not None:
            await self._reporter.heartbeat(report)

    async def close(self, drain_timeout_s: float) -> None:
        """Deliver what is spooled within the timeout; the rest stays for the next start."""
        if self._reporter is not None:
            await self._reporter.close(drain_timeout_s)


def _summary(payload: dict[str, Any]) -> str:
    shown = {key: value for key, value in payload.items() if key not in ("stacks", "argv")}
    return str(shown)[:300]
