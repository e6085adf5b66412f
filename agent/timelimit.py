"""The time limit as a planned stop: when to warn, and the notice the driver hands the agents.

A job that reaches its Slurm time limit has done nothing wrong. Resurgo turns
the limit into a planned stop (docs/operations.md, "Time limits"):

1. the in-job driver notices the limit is near: Slurm's ``USR1`` warning
   (``--signal=B:USR1@LEAD``, added by ``resurgo submit``) or its own timer,
   armed from the job's time left and the newest checkpoint's measured save
   time, whichever comes first;
2. it writes a :class:`Notice` into the job's directory (shared with the
   compute nodes) and tells the supervisor;
3. every node agent sees the notice, asks its ranks for a checkpoint at the
   next step boundary (the save-request file the in-rank library polls),
   waits until a checkpoint newer than the notice is committed or the
   notice's ``save_by`` passes, then stops the ranks with SIGTERM and its
   grace period;
4. the supervisor requeues the job at its size before Slurm ends it; if the
   supervisor cannot, the driver requeues its own job.

No signal goes through ``srun`` for this: slurmstepd delivers a forwarded
signal to every process of the step, and ``USR1``'s default action ends a
training script that does not handle it (verified on Slurm 22.05).

This module is pure (the lead, Slurm's durations, the notice's format);
:mod:`agent.stopfiles` reads and writes the notice and the save-request file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# Without a measured save, assume one this long (a large model on a shared filesystem).
DEFAULT_SAVE_S = 60.0
# After the ranks stopped: the supervisor validates (quick) and requeues.
REQUEUE_MARGIN_S = 30.0
# The warning never takes more than this share of the job's time limit: a
# 3-minute job is warned 45 s before its end, never 4 s into its run.
MAX_LEAD_SHARE = 0.25
MIN_LEAD_S = 10.0
# The ranks' stop at a time limit ends this long before it at the latest: the
# supervisor's requeue takes about two seconds, and the driver requeues the job
# itself 5 s before the end if the supervisor has not.
STOPPED_BEFORE_END_S = 10.0
# Slurm's --signal takes at most 0xffff seconds.
MAX_LEAD_S = 65535.0


def stop_grace_s(notice: Notice, now_unix_s: float, configured_s: float) -> float:
    """The SIGTERM-to-SIGKILL grace of the ranks' stop at a time limit: the configured
    one, cut so that the ranks are gone :data:`STOPPED_BEFORE_END_S` before the end (a
    framework that handles SIGTERM itself, as Lightning does, would otherwise outlive
    a short lead), and at least a second."""
    left_s = notice.end_unix_s - now_unix_s - STOPPED_BEFORE_END_S
    return max(1.0, min(configured_s, left_s))


def warning_lead_s(
    limit_s: float | None,
    save_s: float | None = None,
    stop_grace_s: float = 30.0,
    requested_s: float | None = None,
) -> float:
    """Seconds before the time limit at which the planned stop begins.

    Room for one more save (twice the measured save time: the one in flight
    may have to finish first), the ranks' stop grace and the requeue, but at
    most a quarter of the limit (a short job still trains for most of its
    time) and at least :data:`MIN_LEAD_S`. ``requested_s`` (the operator's
    ``--time-limit-lead``) replaces the computed value, still within the
    limit. ``limit_s`` None (unknown, or unlimited) gives the uncapped value.
    """
    if requested_s is not None:
        lead = requested_s
    else:
        save = DEFAULT_SAVE_S if save_s is None or not math.isfinite(save_s) else save_s
        lead = 2 * max(0.0, save) + stop_grace_s + REQUEUE_MARGIN_S
        if limit_s is not None and limit_s > 0:
            lead = min(lead, MAX_LEAD_SHARE * limit_s)
    if limit_s is not None and limit_s > 0:
        lead = min(lead, limit_s / 2)
    return float(min(MAX_LEAD_S, max(MIN_LEAD_S, lead)))


def parse_slurm_duration(text: str) -> float | None:
    """Seconds in one of Slurm's durations (``[D-]HH:MM:SS``, ``MM:SS``, ``M``); None when
    Slurm says ``UNLIMITED``, ``INVALID``, ``NOT_SET`` or nothing."""
    text = text.strip()
    if not text or not (text[0].isdigit()):
        return None
    days = 0
    if "-" in text:
        day_text, text = text.split("-", 1)
        if not day_text.isdigit():
            return None
        days = int(day_text)
    parts = text.split(":")
    if not parts or not all(part.isdigit() for part in parts) or len(parts) > 3:
        return None
    numbers = [int(part) for part in parts]
    if days and len(numbers) == 1:
        seconds = numbers[0] * 3600  # D-HH
    elif len(numbers) == 1:
        seconds = numbers[0] * 60  # minutes
    elif len(numbers) == 2:
        seconds = numbers[0] * 3600 + numbers[1] * 60 if days else numbers[0] * 60 + numbers[1]
    else:
        seconds = numbers[0] * 3600 + numbers[1] * 60 + numbers[2]
    return float(days * 86400 + seconds)


@dataclass(frozen=True)
class Notice:
    """The driver's word that the time limit is near, for one attempt's agents.

    Times are Unix seconds. ``save_by_unix_s``: the agents stop waiting for the
    final checkpoint then; ``end_unix_s``: when Slurm ends the job.
    """

    attempt: int
    warned_unix_s: float
    save_by_unix_s: float
    end_unix_s: float

    def to_json(self) -> str:
        """The notice file's text."""
        return json.dumps(
            {
                "attempt": self.attempt,
                "warned_unix_s": self.warned_unix_s,
                "save_by_unix_s": self.save_by_unix_s,
                "end_unix_s": self.end_unix_s,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Notice:
        """Parse :meth:`to_json`'s text; ValueError saying what is wrong."""
        data: Any = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("the notice is not a JSON object")
        try:
            attempt = data["attempt"]
            times = [float(data[key]) for key in ("warned_unix_s", "save_by_unix_s", "end_unix_s")]
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"the notice lacks a field or has a wrong one: {error}") from error
        if isinstance(attempt, bool) or not isinstance(attempt, int):
            raise ValueError("the notice's attempt is not a whole number")
        if not all(math.isfinite(value) for value in times):
            raise ValueError("the notice has a time that is not finite")
        return cls(attempt, *times)
