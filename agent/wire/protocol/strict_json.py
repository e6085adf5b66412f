"""Strict JSON: bytes to a document and back, and the envelope every message has.

Refused: invalid UTF-8, duplicate keys, NaN and infinities, lone surrogates,
bodies over their limit, a wrong protocol version or message type.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from agent.wire.protocol.constants import MAX_BODY_BYTES, MAX_EVENT_BYTES, PROTOCOL_VERSION
from agent.wire.protocol.errors import ProtocolError
from agent.wire.protocol.fields import _fail, _field, _object


def _reject_constant(name: str) -> NoReturn:
    _fail(f"JSON constant {name} is not allowed: numbers must be finite")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        keys = [key for key, _ in pairs]
        duplicate = next(key for key in keys if keys.count(key) > 1)
        _fail(f"JSON object has the key {duplicate[:64]!r} twice")
    return document


def _load(data: bytes, what: str, limit: int = MAX_BODY_BYTES) -> Any:
    if not isinstance(data, bytes | bytearray):
        _fail(f"{what}: expected bytes, got {type(data).__name__}")
    if len(data) > limit:
        _fail(f"{what}: {len(data)} bytes; the limit is {limit}")
    try:
        document = json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_no_duplicate_keys,
            parse_constant=_reject_constant,
        )
    # ValueError covers JSONDecodeError and integers longer than Python's digit
    # limit; RecursionError, nesting deeper than the parser's stack.
    # The hooks' own ProtocolError is not a ValueError and passes through.
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ProtocolError(f"{what}: not valid UTF-8 JSON: {error}") from error
    if _holds_lone_surrogate(document):
        _fail(
            f"{what}: {_surrogate_place(document, what)} holds a lone surrogate (a "
            "\\ud800-\\udfff escape without its pair): text must be valid Unicode"
        )
    return document


def _strings(document: Any) -> Iterator[str]:
    """Every string of a decoded document, keys included."""
    pending = [document]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for key, value in item.items():
                yield key
                pending.append(value)
        elif isinstance(item, list):
            pending.extend(item)


def _holds_lone_surrogate(document: Any) -> bool:
    # Strict UTF-8 decoding already refused encoded surrogates; only JSON's
    # \uXXXX escapes can make one, and no UTF-8 writer (a log, a terminal,
    # the store's readers) can write it out again.
    return any(not text.isascii() and not is_unicode(text) for text in _strings(document))


def is_unicode(text: str) -> bool:
    """False for text the protocol cannot carry: a lone surrogate (e.g. undecodable
    bytes of a path kept by ``surrogateescape``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_place(document: Any, what: str) -> str:
    """Where the first lone surrogate is, as ``what.key[index]``, for the refusal."""
    pending: list[tuple[Any, str]] = [(document, what)]
    while pending:
        item, where = pending.pop(0)
        if isinstance(item, str) and not is_unicode(item):
            return where
        if isinstance(item, dict):
            for key, value in item.items():
                if not is_unicode(key):
                    return f"a key of {where}"
                pending.append((value, f"{where}.{key[:64]}"))
        elif isinstance(item, list):
            pending.extend((value, f"{where}[{index}]") for index, value in enumerate(item))
    return what


def _envelope(value: Any, message_type: str) -> dict[str, Any]:
    document = _object(value, message_type)
    version = _field(document, "protocol", message_type)
    # Only the integer: 1.0 and true compare equal to 1 but are other spellings.
    if type(version) is not int or version != PROTOCOL_VERSION:
        _fail(
            f"{message_type}: protocol version {version!r} is not supported; this "
            f"Resurgo speaks {PROTOCOL_VERSION}: run the same Resurgo version on "
            "agents and supervisor"
        )
    found = _field(document, "type", message_type)
    if found != message_type:
        _fail(f"{message_type}: message type is {found!r}, expected {message_type!r}")
    return document


def _dump(document: Mapping[str, Any]) -> bytes:
    try:
        # ensure_ascii keeps every line pure ASCII, so a spool line never
        # contains a raw newline or invalid UTF-8 whatever the stack text holds.
        return json.dumps(document, allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as error:
        raise ProtocolError(
            f"cannot encode as JSON ({error}): values must be JSON types and numbers finite"
        ) from error


def _json_roundtrip(document: Mapping[str, Any], what: str) -> Any:
    """``document`` as a peer would read it: tuples become lists, keys strings."""
    return _load(_dump(document), what, limit=MAX_EVENT_BYTES)
