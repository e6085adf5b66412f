"""Numbers, counts and stacks as an operator reads them; pure.

Every view prints through these, so a value reads the same wherever it shows:
seconds to three significant digits (or milliseconds), bytes in kB/MB/GB,
``none`` for a missing value (never Python's ``None``), a count with its noun
in the right number, and a time of day for a Unix time instead of ten digits.
"""

from __future__ import annotations

import datetime
import math
import re
from collections.abc import Mapping, Sequence

from supervisor.core.failure_rules import FailureClass
from supervisor.core.goodput import Badput, Goodput

# Above this a number named ``*_s`` is a Unix time (2001 on), not a duration.
EPOCH_FLOOR_S = 1e9
_BADPUT_WORDS = {
    Badput.STARTUP: "start-up",
    Badput.QUEUE_WAIT: "queue wait",
    Badput.LOST_WORK: "lost work",
    Badput.DETECTION: "detection",
    Badput.RECOVERY: "recovery",
    Badput.CHECKPOINT_STALL: "checkpoint stalls",
    Badput.SHUTDOWN: "shutdown",
}


def number(value: float) -> str:
    """A float to three significant digits, without an exponent below a million."""
    if not math.isfinite(value):
        return str(value)
    if value != 0 and abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def seconds(value: float) -> str:
    """A duration: ``11.4 ms``, ``27.5 s``, ``4.2 min``, ``3.5 h``, ``2.0 d``."""
    if not math.isfinite(value):
        return f"{value} s"
    size = abs(value)
    if 0 < size < 1:
        return f"{number(value * 1000)} ms"
    if size < 120:
        return f"{number(value)} s"
    if size < 7200:
        return f"{value / 60:.1f} min"
    if size < 172800:
        return f"{value / 3600:.1f} h"
    return f"{value / 86400:.1f} d"


def size(count: float) -> str:
    """Bytes in decimal units to three significant digits: ``512 B``, ``183 kB``, ``1.2 GB``."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{number(count)} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


def clock(time_s: float) -> str:
    """A Unix time as local date and time to the second."""
    return datetime.datetime.fromtimestamp(time_s).strftime("%Y-%m-%d %H:%M:%S")


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 rank``, ``2 ranks``; ``nouns`` where adding an ``s`` is wrong."""
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


def listed(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(items) <= 1:
        return "".join(items)
    return f"{', '.join(items[:-1])} and {items[-1]}"


def value(key: str, raw: object) -> str:
    """One stored value for people, read by its key: ``*_s`` seconds (or a time of day
    when it is a Unix time), ``*bytes`` sizes, floats rounded, ``none`` for None."""
    if raw is None:
        return "none"
    if isinstance(raw, bool):
        return "yes" if raw else "no"
    if isinstance(raw, int | float):
        if key.endswith("_s"):
            return clock(raw) if raw > EPOCH_FLOOR_S else seconds(raw)
        if key == "bytes" or key.endswith("_bytes"):
            return size(raw)
        return number(raw) if isinstance(raw, float) else str(raw)
    return str(raw)


def fields(payload: Mapping[str, object]) -> str:
    """A payload with no summary of its own: ``key=value`` for its plain values."""
    return ", ".join(
        f"{key}={value(key, raw)}"
        for key, raw in sorted(payload.items())
        if not isinstance(raw, dict | list)
    )


def badput(goodput: Goodput) -> str:
    """Where the time that did not train went, largest first: ``start-up 27.5 s, ...``
    (``none`` when every second trained)."""
    parts = sorted(
        ((s, kind) for kind, s in goodput.badput_s.items() if s >= 0.05), key=lambda p: -p[0]
    )
    return ", ".join(f"{badput_name(kind)} {seconds(s)}" for s, kind in parts)


def badput_name(kind: Badput) -> str:
    """What a kind of badput is called in a sentence: ``start-up``, ``lost work``."""
    return _BADPUT_WORDS.get(kind, kind.value.replace("_", " "))


def goodput_line(goodput: Goodput) -> str:
    """``16.3% of 66 s trained; the rest: start-up 27.5 s, recovery 16.1 s, ...``."""
    line = f"{goodput.ratio * 100:.1f}% of {seconds(goodput.wall_s)} trained"
    lost = badput(goodput)
    return f"{line}; the rest: {lost}" if lost else line


# How a decision names a classified failure (Classified.words in supervisor.core.failure_rules):
# ``oom (rule kernel-oom-kill): "Killed process ..."``; a rule's name is 1-64 of [A-Za-z0-9_.-].
_CLASSIFIED = re.compile(
    r"\b(?P<cls>"
    + "|".join(c.value for c in FailureClass)
    + r") \(rule (?P<rule>[A-Za-z0-9][A-Za-z0-9_.-]*)\)"
)


def failure_in(explanation: str) -> tuple[str, str] | None:
    """The failure class and rule a decision's explanation names (the first it names),
    or None when it names none (no rule matched: class ``unknown``, or no rank failed)."""
    found = _CLASSIFIED.search(explanation)
    return None if found is None else (found["cls"], found["rule"])


def failures(counts: Mapping[str, int], rules: Mapping[str, Sequence[str]] | None = None) -> str:
    """``oom 2 (kernel-oom-kill), unknown 1``: failures by class (in the order of their
    names, as restarts by cause are), each with the rules that named it where known;
    ``none`` when there were none."""
    parts = []
    for name, count in sorted(counts.items()):
        named = (rules or {}).get(name)
        parts.append(f"{name} {count}" + (f" ({', '.join(named)})" if named else ""))
    return ", ".join(parts) or "none"


# A frame line of py-spy's text dump (``    all_reduce (torch/distributed/c10d.py:3252)``)
# and of a Python traceback (``  File "train.py", line 40, in train``).
_THREAD = re.compile(r'^Thread \S+ \((?:idle|active)\)(?:: "(?P<name>[^"]*)")?')
_PY_SPY_FRAME = re.compile(r"^\s+\S.*\(.*\)\s*$")
_TRACEBACK_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<fn>.+)$')


def innermost_frame(stack: str) -> str:
    """The frame a rank was in when its stack was dumped, or the dump's own first line
    when it holds no frame (``(no stack: ...)``).

    The agent stores py-spy's layout, innermost frame first under each
    ``Thread`` line; the training loop is on the main thread. A Python
    traceback, should one be stored, lists the innermost frame last.
    """
    lines = [line for line in stack.split("\n") if line.strip()]
    if any(line.startswith("Traceback (most recent call last)") for line in lines):
        called = [m for line in lines if (m := _TRACEBACK_FRAME.match(line))]
        if called:
            last = called[-1]
            return f"{last['fn']} ({last['file']}:{last['line']})"
    threads = [i for i, line in enumerate(lines) if _THREAD.match(line)]
    main = [i for i in threads if _thread_name(lines[i]) == "MainThread"]
    for start in main + threads:
        following = lines[start + 1 : start + 2]
        if following and _PY_SPY_FRAME.match(following[0]):
            return following[0].strip()
    frames = [line for line in lines if _PY_SPY_FRAME.match(line)]
    return (frames[0] if frames else lines[0] if lines else "").strip()


def _thread_name(line: str) -> str | None:
    found = _THREAD.match(line)
    return None if found is None else found["name"]
