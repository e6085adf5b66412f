"""What a job's srun step and its training steps tell the core outside agents' events.

- The in-job driver's "the attempt's step ended" (:func:`note_step_end`,
  :func:`step_end_fallback`): the agents' reports name the culprit and come
  first when they can. The driver outlives them: when a step failed and, a
  lease after the driver first said so, no agent of the attempt has called in
  (their reports were lost with them), its word opens the recovery
  (:class:`~supervisor.core.observations.StepEnded`). Not for a clean end, an
  earlier attempt, a stop the supervisor ordered (the job is recovering then,
  or stopping for its time limit), or an attempt whose agents stopped
  cleanly: they reported the end themselves.
- A launch's first progress (:func:`progress_news`): a starting or
  relaunching job's slowest rank reached a new step.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from supervisor.core.model import JobRecord, JobState
from supervisor.core.observations import StepEnded, StepProgress


class StepEndNote(NamedTuple):
    """The driver's "the step ended": its attempt, when first heard, and its exit code."""

    attempt: int | None
    first_s: float
    exit_code: int | None


def note_step_end(
    note: StepEndNote | None, attempt: int | None, exit_code: int | None, now: float
) -> tuple[StepEndNote, bool]:
    """The note after the driver said attempt ``attempt``'s step ended, and whether this
    is the first time it said so for that attempt (a late exit code fills one in)."""
    if note is None or note.attempt != attempt:
        return StepEndNote(attempt, now, exit_code), True
    if note.exit_code is None and exit_code is not None:
        return note._replace(exit_code=exit_code), False
    return note, False


def step_end_fallback(
    note: StepEndNote,
    record: JobRecord,
    now: float,
    lease_s: float,
    last_report_s: float | None,
    stopped_attempts: Collection[int | None],
) -> StepEnded | None:
    """The driver's word as the observation, once its agents have said nothing for a
    lease after it (``last_report_s``: when a current agent last called in)."""
    if (
        note.exit_code in (None, 0)
        or note.attempt != record.attempt
        or record.state not in (JobState.RUNNING, JobState.STARTING)
        or record.time_limit_end_s is not None
        or note.attempt in stopped_attempts
    ):
        return None
    if now - note.first_s < lease_s:
        return None
    if last_report_s is not None and last_report_s >= note.first_s:
        return None  # its agents still talk: theirs is the word
    return StepEnded(note.attempt, note.exit_code)


def progress_news(record: JobRecord, step: int, previous_step: int | None) -> StepProgress | None:
    """A starting or relaunching job's ranks reached a step not reported before."""
    waiting = record.state in (JobState.STARTING, JobState.RELAUNCHING)
    if waiting and step != previous_step:
        return StepProgress(step)
    return None
