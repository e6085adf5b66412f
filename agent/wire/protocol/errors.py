"""What the protocol raises: a malformed message, or a request that fails authentication."""

from __future__ import annotations

from agent.wire.errors import ResurgoError


class ProtocolError(ResurgoError):
    """A message does not follow the wire protocol; the message names the field and the rule."""


class AuthError(ResurgoError):
    """A request's signature is wrong or its timestamp is outside the replay window."""


class StaleTimestamp(AuthError):
    """A request's timestamp is outside the replay window (its signature was not checked)."""
