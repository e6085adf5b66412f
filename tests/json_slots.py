"""JSON documents taken apart for mutation by the property-based tests."""

from __future__ import annotations

from typing import Any


def slots(document: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a JSON document: each place a value can be edited."""
    found: list[tuple[Any, Any]] = []
    if isinstance(document, dict):
        for key, value in document.items():
            found += [(document, key), *slots(value)]
    elif isinstance(document, list):
        for index, value in enumerate(document):
            found += [(document, index), *slots(value)]
    return found
