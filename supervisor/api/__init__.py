"""The supervisor's HTTP API for node agents and the CLI (docs/protocol.md is the contract).

- :mod:`supervisor.api.directory`: :class:`JobDirectory`, what the API asks
  about jobs (the daemon implements it over the store), and
  :class:`MemoryDirectory`;
- :mod:`supervisor.api.refusals`: refusal causes with their statuses, and the
  rate-limited refusal log;
- :mod:`supervisor.api.app`: :func:`build_app` (routes, authentication,
  answers);
- :mod:`supervisor.api.serving`: :func:`serve`, :func:`bound_port` and
  :func:`shutdown` (the listener), and aiohttp's server log.

This package touches the network; it holds no job state of its own.
"""

from supervisor.api.app import (
    HEALTH_PATH,
    JOB_STATUS_PATH,
    build_app,
    build_metrics_app,
    open_streams,
)
from supervisor.api.directory import JobDirectory, MemoryDirectory
from supervisor.api.refusals import Cause, RefusalLog
from supervisor.api.serving import bound_port, serve, shutdown

__all__ = [
    "HEALTH_PATH",
    "JOB_STATUS_PATH",
    "Cause",
    "JobDirectory",
    "MemoryDirectory",
    "RefusalLog",
    "bound_port",
    "build_app",
    "build_metrics_app",
    "open_streams",
    "serve",
    "shutdown",
]
