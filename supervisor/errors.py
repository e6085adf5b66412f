"""Errors raised by the supervisor package."""

from agent.errors import ResurgoError


class SupervisorError(ResurgoError):
    """Base of the supervisor's own errors."""


class SlurmError(SupervisorError):
    """A Slurm command failed; the outcome it asked about is unknown, never 'gone'."""


class SlurmUnavailable(SlurmError):
    """Slurm could not be reached at all (no binary on PATH, controller down, timeout)."""
