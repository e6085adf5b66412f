"""Text a job's owner wrote, made safe to show: one line, printable, escapes visible.

Paths, culprit reasons, error digests, stack dumps and Slurm reasons reach
log lines, terminals and Slurm's own records. Written as they are, a newline
forges a whole log record (``... ERROR ALERT ...`` on a line of its own), a
NUL makes a log file binary, an escape sequence drives the operator's
terminal, and a lone surrogate stops any UTF-8 writer with
``UnicodeEncodeError``. :func:`one_line` writes every character that
``str.isprintable`` rejects as a Python-style escape (``\\n``, ``\\x00``,
``\\x1b``, ``\\u202e``, ``\\ud800``) and a backslash as ``\\\\``, so the result
is one line and reads back unambiguously.
"""

from __future__ import annotations

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _escape(char: str) -> str:
    named = _NAMED.get(char)
    if named is not None:
        return named
    if char.isprintable():
        return char
    code = ord(char)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def one_line(text: str) -> str:
    """``text`` as one line of printable characters; anything else as a visible escape."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape(char) for char in text)


def fragment(text: str, max_chars: int) -> str:
    """``text`` as :func:`one_line`, in ASCII, at most ``max_chars`` long (``...`` where cut):
    for records other programs keep, such as a Slurm drain reason."""
    line = one_line(text).encode("ascii", "backslashreplace").decode("ascii")
    if len(line) <= max_chars:
        return line
    return line[: max(0, max_chars - 3)] + "..."
