"""The supervisor's HTTP API for node agents and the CLI (docs/protocol.md is the contract).

- :mod:`supervisor.api.directory`: :class:`JobDirectory`, what the API asks
  about jobs (the daemon implements it over the store), and
  :class:`MemoryDirectory`;
- :mod:`supervisor.api.refusals`: refusal causes with their statuses, and the
  rate-limited refusal log;
- :mod:`supervisor.api.app`: :func:`build_app` (routes, authentication,
  answers), :func:`serve` and :func:`shutdown`.

This package touches the network; it holds no job state of its own.
"""

from supervisor.api.app import (
    HEALTH_PATH,
    JOB_STATUS_PATH,
    bound_port,
    build_app,
    build_metrics_app,
    open_streams,
    serve,
    shutdown,
)
from supervisor.api.directory import JobDirectory, MemoryDirectory
from supervisor.api.refusals import Cause, RefusalLog

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
