"""Errors raised by the agent package; every leaf says what to do next."""


class ResurgoError(Exception):
    """Base of every error Resurgo raises on purpose."""


class CheckpointError(ResurgoError):
    """A checkpoint could not be written, read or trusted."""


class CheckpointInvalid(CheckpointError):
    """A checkpoint directory failed validation; the message names the first failure."""


class ConfigError(ResurgoError):
    """A setting is missing, unknown or out of range; the message names it."""


def describe(error: BaseException) -> str:
    """A failed request's error in a few words, for a log line ("timed out" for a timeout,
    whose message is empty)."""
    if isinstance(error, TimeoutError):
        return "timed out"
    return str(error) or type(error).__name__
