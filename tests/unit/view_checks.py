"""What no view may print: the checker behind ``test_views_read_well.py``.

A view is read by a person: it shows no Python ``None``, no float with more
digits than anyone reads (``0.011354302999990296``), no Unix time
(``1700000034.000125``) and no traceback. :func:`defects` lists each rule a
text breaks; :func:`json_strings` and :func:`visible_text` give the parts of a
``--json`` document and of an HTML report that people read.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterator

MAX_SIGNIFICANT_DIGITS = 4

# A number standing alone: not part of a word, a version (3.11.7) or a path.
_FLOAT = re.compile(r"(?<![\w.])(\d+\.\d+)(?![\w.])")
# Ten digits from 1e9 to 4e9 (2001 to 2096): a Unix time in seconds.
_EPOCH = re.compile(r"(?<![\w.,])([1-3]\d{9})(?:\.\d+)?(?![\w.,])")
_NONE = re.compile(r"\bNone\b")
_TRACEBACK = re.compile(r'Traceback \(most recent call last\)|File "[^"]*", line \d+')

RULES = ("None", "long float", "epoch time", "traceback")


def significant_digits(number: str) -> int:
    """Digits of a decimal literal from its first non-zero one: ``0.0113`` has 3."""
    return len(number.replace(".", "").lstrip("0"))


def defects(text: str) -> list[str]:
    """``"rule: excerpt"`` for each place ``text`` breaks one of :data:`RULES`."""
    found = [f"None: {_around(text, m)}" for m in _NONE.finditer(text)]
    found += [
        f"long float: {_around(text, m)}"
        for m in _FLOAT.finditer(text)
        if significant_digits(m.group(1)) > MAX_SIGNIFICANT_DIGITS
    ]
    found += [f"epoch time: {_around(text, m)}" for m in _EPOCH.finditer(text)]
    found += [f"traceback: {_around(text, m)}" for m in _TRACEBACK.finditer(text)]
    return found


def rules_broken(text: str) -> set[str]:
    """The names of the rules ``text`` breaks."""
    return {found.split(":", 1)[0] for found in defects(text)}


def json_strings(document: object) -> Iterator[str]:
    """Every string in a ``--json`` document: what a person reads there (its numbers
    are data for programs, and keep their precision)."""
    if isinstance(document, str):
        yield document
    elif isinstance(document, dict):
        for value in document.values():
            yield from json_strings(value)
    elif isinstance(document, list):
        for value in document:
            yield from json_strings(value)


def visible_text(page: str) -> str:
    """An HTML report's text as a browser shows it: no style, no markup, and no SVG
    (its numbers are drawing coordinates; its labels are drawn as glyph paths)."""
    page = re.sub(r"<style>.*?</style>|<svg.*?</svg>", " ", page, flags=re.DOTALL)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def _around(text: str, match: re.Match[str]) -> str:
    start, end = max(0, match.start() - 40), min(len(text), match.end() + 40)
    return text[start:end].replace("\n", " ")
