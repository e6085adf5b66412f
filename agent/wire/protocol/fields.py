"""Field checkers: one rule per JSON field, raising :class:`ProtocolError` naming it.

Each checker takes the containing object, the key and where it sits (for the
message), and returns the value in its wire shape.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

from agent.wire.protocol.constants import (
    _INCARNATION,
    _INT_LIMIT,
    _NAME,
    MAX_ARGV_ITEMS,
    MAX_RANKS,
    MAX_SHORT_TEXT_CHARS,
    MAX_TEXT_CHARS,
)
from agent.wire.protocol.errors import ProtocolError

_DECIMAL = re.compile(r"0|[1-9][0-9]{0,9}")
_SEQ = re.compile(r"[1-9][0-9]{0,18}")

_E = TypeVar("_E", bound=enum.Enum)

_Check = Callable[[Mapping[str, Any], str, str], Any]


def _fail(message: str) -> NoReturn:
    raise ProtocolError(message)


def _field(document: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in document:
        _fail(f"{where}: missing field {key!r}")
    return document[key]


def _int(document: Mapping[str, Any], key: str, where: str, minimum: int = 0) -> int:
    value = _field(document, key, where)
    # bool is an int subclass; true/false are not counts.
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(f"{where}.{key} must be an integer, got {type(value).__name__}")
    if value < minimum or value >= _INT_LIMIT:
        _fail(f"{where}.{key} must be an integer in [{minimum}, 2**63), got {value}")
    return value


def _signed_int(document: Mapping[str, Any], key: str, where: str) -> int:
    return _int(document, key, where, minimum=-(1 << 63))


def _float(document: Mapping[str, Any], key: str, where: str) -> float:
    value = _field(document, key, where)
    if not isinstance(value, int | float) or isinstance(value, bool):
        _fail(f"{where}.{key} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        _fail(f"{where}.{key} is too large for a double")
    if not math.isfinite(number) or number < 0:
        _fail(f"{where}.{key} must be a finite number >= 0, got {value}")
    return number


def _finite_float(document: Mapping[str, Any], key: str, where: str) -> float:
    value = _field(document, key, where)
    if not isinstance(value, int | float) or isinstance(value, bool):
        _fail(f"{where}.{key} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        _fail(f"{where}.{key} is too large for a double")
    if not math.isfinite(number):
        _fail(f"{where}.{key} must be a finite number, got {value}")
    return number


def _positive_float(document: Mapping[str, Any], key: str, where: str) -> float:
    number = _float(document, key, where)
    if number <= 0:
        _fail(f"{where}.{key} must be > 0, got {number}")
    return number


def _bool(document: Mapping[str, Any], key: str, where: str) -> bool:
    value = _field(document, key, where)
    if not isinstance(value, bool):
        _fail(f"{where}.{key} must be true or false, got {type(value).__name__}")
    return value


def _str(
    document: Mapping[str, Any], key: str, where: str, max_chars: int = MAX_SHORT_TEXT_CHARS
) -> str:
    value = _field(document, key, where)
    if not isinstance(value, str):
        _fail(f"{where}.{key} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        _fail(f"{where}.{key} has {len(value)} characters; the limit is {max_chars}")
    return value


def _text(document: Mapping[str, Any], key: str, where: str) -> str:
    return _str(document, key, where, max_chars=MAX_TEXT_CHARS)


def _name(document: Mapping[str, Any], key: str, where: str) -> str:
    value = _str(document, key, where)
    if not _NAME.fullmatch(value):
        _fail(
            f"{where}.{key} {value[:64]!r} is not a name: 1-128 characters of "
            "letters, digits and ._:@+-, starting with a letter or digit"
        )
    return value


def _list(
    document: Mapping[str, Any], key: str, where: str, max_items: int, min_items: int = 0
) -> list[Any]:
    value = _field(document, key, where)
    if not isinstance(value, list):
        _fail(f"{where}.{key} must be a list, got {type(value).__name__}")
    if not min_items <= len(value) <= max_items:
        _fail(f"{where}.{key} has {len(value)} items; allowed {min_items} to {max_items}")
    return value


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(f"{where} must be an object, got {type(value).__name__}")
    return value


def _argv(document: Mapping[str, Any], key: str, where: str) -> list[str]:
    items = _list(document, key, where, max_items=MAX_ARGV_ITEMS)
    for index, item in enumerate(items):
        if not isinstance(item, str) or len(item) > MAX_SHORT_TEXT_CHARS:
            _fail(f"{where}.{key}[{index}] must be a string of at most {MAX_SHORT_TEXT_CHARS}")
    return list(items)


def _enum(document: Mapping[str, Any], key: str, where: str, kind: type[_E]) -> _E:
    value = _field(document, key, where)
    try:
        return kind(value)
    except (ValueError, TypeError):
        known = ", ".join(repr(member.value) for member in kind)
        _fail(f"{where}.{key}: unknown {kind.__name__} {value!r}; this version knows {known}")


def _enum_value(kind: type[enum.Enum]) -> _Check:
    def check(document: Mapping[str, Any], key: str, where: str) -> Any:
        return _enum(document, key, where, kind).value

    return check


def _optional(document: Mapping[str, Any], key: str, where: str, check: _Check) -> Any:
    if _field(document, key, where) is None:
        return None
    return check(document, key, where)


def _nullable(check: _Check) -> _Check:
    def nullable(document: Mapping[str, Any], key: str, where: str) -> Any:
        return _optional(document, key, where, check)

    return nullable


def _objects(fields: tuple[_Spec, ...], max_items: int = MAX_RANKS) -> _Check:
    def check(document: Mapping[str, Any], key: str, where: str) -> list[dict[str, Any]]:
        items = _list(document, key, where, max_items=max_items)
        return [
            _check_fields(
                _object(item, f"{where}.{key}[{index}]"), fields, f"{where}.{key}[{index}]"
            )
            for index, item in enumerate(items)
        ]

    return check


def _stacks(document: Mapping[str, Any], key: str, where: str) -> dict[str, str]:
    stacks = _object(_field(document, key, where), f"{where}.{key}")
    if len(stacks) > MAX_RANKS:
        _fail(f"{where}.{key} has {len(stacks)} entries; the limit is {MAX_RANKS}")
    for rank in stacks:
        # JSON object keys are strings: global ranks go as decimal strings.
        if not _DECIMAL.fullmatch(rank):
            _fail(f"{where}.{key}: key {rank[:32]!r} is not a global rank as a decimal string")
        _text(stacks, rank, f"{where}.{key}")
    return dict(stacks)


@dataclass(frozen=True)
class _Spec:
    """One payload or argument field: its name, its check, and whether it may be absent."""

    name: str
    check: _Check
    required: bool = True


def _check_fields(
    document: Mapping[str, Any], specs: tuple[_Spec, ...], where: str
) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for spec in specs:
        if spec.name in document:
            checked[spec.name] = spec.check(document, spec.name, where)
        elif spec.required:
            _fail(f"{where}: missing field {spec.name!r}")
    return checked


def _check_incarnation(value: str, where: str) -> None:
    if not isinstance(value, str) or not _INCARNATION.fullmatch(value):
        _fail(f"{where} {str(value)[:80]!r} must be 8-64 lowercase hex digits")


def _check_event_id_shape(value: Any, where: str) -> str:
    if not isinstance(value, str):
        _fail(f"{where} must be a string, got {type(value).__name__}")
    parts = value.split("/")
    if (
        len(parts) != 4
        or not _NAME.fullmatch(parts[0])
        or not _NAME.fullmatch(parts[1])
        or not _INCARNATION.fullmatch(parts[2])
        or not _SEQ.fullmatch(parts[3])
    ):
        _fail(f"{where} {value[:200]!r} is not an event id job/node/incarnation/seq")
    return value


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a valid job id or node name, else raise :class:`ProtocolError`."""
    if type(value) is str and _NAME.fullmatch(value):
        return value
    return _name({what: value}, what, "name")


def check_incarnation(value: str) -> str:
    """Return ``value`` if it is a valid incarnation token (8-64 lowercase hex digits)."""
    _check_incarnation(value, "incarnation")
    return value
