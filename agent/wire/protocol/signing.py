"""HMAC-SHA256 signing of requests and heartbeat stream frames, and the replay window.

Pure: the signing timestamp and ``now`` are arguments.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

from agent.wire.protocol.constants import (
    HEADER_JOB,
    HEADER_PROTOCOL,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    HEARTBEAT_STREAM_PATH,
    METHOD,
    PROTOCOL_VERSION,
    REPLAY_WINDOW_S,
)
from agent.wire.protocol.errors import AuthError, ProtocolError, StaleTimestamp

_SIGNATURE_SCHEME = "RESURGO-HMAC-SHA256"
_SIGNATURE = re.compile(r"[0-9a-f]{64}")
# A heartbeat stream frame's first line: the timestamp (as the header's) and the signature.
# One spelling per timestamp (no leading zeros): int() would read "0017" as 17,
# so two spellings would share one canonical string and one signature.
_FRAME_HEAD = re.compile(rb"(0|[1-9][0-9]{0,11}) ([0-9a-f]{64})")
_FRAME_HEAD_BYTES = 12 + 1 + 64 + 1


def canonical_string(method: str, path: str, job_id: str, timestamp_s: int, body: bytes) -> str:
    """The exact text that is signed: scheme, method, path, job, timestamp, body SHA-256.

    One field per line, ``\\n``-separated, no trailing newline; the body hash
    is lowercase hex. Newlines inside a field are refused so that no two
    different requests share a canonical string.
    """
    for name, value in (("method", method), ("path", path), ("job_id", job_id)):
        if not value or "\n" in value or "\r" in value:
            raise ProtocolError(f"{name} {value!r} cannot be signed: empty or has a newline")
    return "\n".join(
        (
            _SIGNATURE_SCHEME,
            method.upper(),
            path,
            job_id,
            str(int(timestamp_s)),
            hashlib.sha256(body).hexdigest(),
        )
    )


def sign(secret: bytes, method: str, path: str, job_id: str, timestamp_s: int, body: bytes) -> str:
    """HMAC-SHA256 of :func:`canonical_string` under the job's secret, lowercase hex."""
    message = canonical_string(method, path, job_id, timestamp_s, body).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(
    secret: bytes,
    method: str,
    path: str,
    job_id: str,
    timestamp_s: int,
    body: bytes,
    signature: str,
    now_s: int,
    window_s: int = REPLAY_WINDOW_S,
) -> None:
    """Return if ``signature`` signs this request and the timestamp is fresh; else raise.

    Raises :class:`StaleTimestamp` (an :class:`AuthError`) when the timestamp
    is more than ``window_s`` away from ``now_s`` (either direction: clocks
    drift both ways), :class:`AuthError` when the signature does not match
    (compared in constant time).
    """
    check_fresh(timestamp_s, now_s, window_s)
    verify_hashed(secret, method, path, job_id, timestamp_s, hashlib.sha256(body), signature)


def check_fresh(timestamp_s: int, now_s: int, window_s: int = REPLAY_WINDOW_S) -> None:
    """Raise :class:`StaleTimestamp` unless ``timestamp_s`` is within ``window_s`` of ``now_s``.

    It needs no body: a server can refuse a stale request before reading one.
    """
    skew = int(timestamp_s) - int(now_s)
    if abs(skew) > window_s:
        raise StaleTimestamp(
            f"request timestamp {timestamp_s} is {skew:+d} s from the verifier's clock "
            f"{now_s}; the window is ±{window_s} s: check the node's clock (NTP)"
        )


def verify_hashed(
    secret: bytes,
    method: str,
    path: str,
    job_id: str,
    timestamp_s: int,
    body_hash: Any,
    signature: str,
) -> None:
    """:func:`verify` without the window, given the body's SHA-256 object (``hashlib.sha256``)
    fed while the body streamed in; raise :class:`AuthError` when the signature is wrong."""
    if not _SIGNATURE.fullmatch(signature):
        # Refused before compare_digest, which raises TypeError on non-ASCII text.
        raise AuthError(
            f"bad signature for job {job_id!r}: {HEADER_SIGNATURE} is 64 lowercase hex digits"
        )
    try:
        head = canonical_string(method, path, job_id, timestamp_s, b"")
    except ProtocolError as error:
        raise AuthError(f"request cannot be verified: {error}") from error
    # The canonical string ends with the body's hash: the same text sign() makes.
    message = head[: -len(_EMPTY_SHA256)] + body_hash.hexdigest()
    expected = hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(signature, expected):
        raise AuthError(
            f"bad signature for job {job_id!r}: the agent and the supervisor do not share "
            "the same job secret, or the request was altered"
        )


def is_signature(text: str) -> bool:
    """Whether ``text`` is spelled as a signature (64 lowercase hex digits)."""
    return _SIGNATURE.fullmatch(text) is not None


_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def sign_frame(
    secret: bytes, job_id: str, timestamp_s: int, body: bytes, path: str = HEARTBEAT_STREAM_PATH
) -> bytes:
    """One stream frame: ``<timestamp> <signature>\\n`` and the body.

    The signature is the one a ``POST`` of ``body`` to the stream's ``path``
    (:data:`HEARTBEAT_STREAM_PATH`, or :data:`JOB_HEARTBEATS_STREAM_PATH` for a
    job's aggregator) would carry, so each frame is authenticated and bounded
    by the replay window exactly like a request, and a frame can never pass
    for a request to another path, for a frame of the other stream, nor a
    request for a frame.
    """
    signature = sign(secret, METHOD, path, job_id, timestamp_s, body)
    return f"{timestamp_s} {signature}\n".encode() + body


def open_frame(
    secret: bytes,
    job_id: str,
    frame: bytes,
    now_s: int,
    window_s: int = REPLAY_WINDOW_S,
    path: str = HEARTBEAT_STREAM_PATH,
) -> bytes:
    """The body of a frame :func:`sign_frame` made for ``job_id`` on ``path``; else raise.

    Raises :class:`AuthError` (a missing or malformed signing line, a stale
    timestamp, a bad signature), as :func:`verify` does for a request.
    """
    end = frame.find(b"\n", 0, _FRAME_HEAD_BYTES)
    match = None if end < 0 else _FRAME_HEAD.fullmatch(frame, 0, end)
    if match is None:
        raise AuthError(
            "a heartbeat frame starts with a line '<timestamp> <signature>' "
            "(protocol.sign_frame; docs/protocol.md, Heartbeat stream)"
        )
    body = frame[end + 1 :]
    timestamp_s = int(match[1])
    verify(secret, METHOD, path, job_id, timestamp_s, body,
           match[2].decode("ascii"), now_s=now_s, window_s=window_s)  # fmt: skip
    return body


def signed_headers(
    secret: bytes, method: str, path: str, job_id: str, timestamp_s: int, body: bytes
) -> dict[str, str]:
    """Every header a request needs: job, timestamp, signature and protocol version."""
    return {
        HEADER_JOB: job_id,
        HEADER_TIMESTAMP: str(int(timestamp_s)),
        HEADER_SIGNATURE: sign(secret, method, path, job_id, timestamp_s, body),
        HEADER_PROTOCOL: str(PROTOCOL_VERSION),
    }
