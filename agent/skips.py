"""The windows of training data the ranks leave out, and how they are written.

After a loss anomaly the supervisor rolls a job back to an earlier checkpoint
and names the data to leave out on the way forward. The in-job driver passes
the windows to the node agent (``--skip-samples``), the agent to the ranks
(``RESURGO_SKIP_SAMPLES``), and :class:`~agent.train.sampler.GlobalBatchSampler`
never trains on them.

A window is a half-open range ``[start, end)`` of the global sample cursor
(``GlobalBatchSampler.consumed_total``: samples consumed since the start of
training, all epochs), so it names the same data whatever the world size.
Written ``START:END``, several joined by commas: ``1024:2048,8192:8704``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from agent.wire.errors import ConfigError

ENV_SKIP_SAMPLES = "RESURGO_SKIP_SAMPLES"
FORMAT = "START:END[,START:END...] (integers, 0 <= START < END)"

SampleRange = tuple[int, int]

# Digits only: int() would also take "+5", " 5" and "1_000".
_RANGE = re.compile(r"(\d+):(\d+)")


def parse_skip_samples(text: str, name: str = ENV_SKIP_SAMPLES) -> tuple[SampleRange, ...]:
    """The windows ``text`` names, in its order; empty text means none.

    Raises :class:`ConfigError` naming ``name`` (where the text came from) and
    the expected format: a window the ranks cannot read must stop the launch,
    not train on the data it was meant to leave out.
    """
    if not text.strip():
        return ()
    ranges = []
    for part in text.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None or int(match[1]) >= int(match[2]):
            raise ConfigError(
                f"{name}={text!r}: {part.strip()!r} is not a window; expected {FORMAT}"
            )
        ranges.append((int(match[1]), int(match[2])))
    return tuple(ranges)


def format_skip_samples(ranges: Iterable[SampleRange]) -> str:
    """``ranges`` as :func:`parse_skip_samples` reads them (empty: none)."""
    return ",".join(f"{start}:{end}" for start, end in ranges)


def merge(ranges: Iterable[SampleRange]) -> tuple[SampleRange, ...]:
    """Sorted, with overlapping and touching ranges joined: at most one range holds a position."""
    merged: list[SampleRange] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return tuple(merged)
