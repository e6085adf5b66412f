"""Which checkpoint directories to delete: a pure plan, and a small applier.

The plan keeps the ``keep_last`` newest valid checkpoints, plus permanent ones
every ``keep_every_steps`` steps. It deletes invalid or uncommitted directories
only when they are older than the newest valid checkpoint (so they cannot be a
save in progress) and have been left untouched for ``grace_s``; they never
count among the kept ones. Directories newer than the newest valid checkpoint
are never touched. While a save is in flight, nothing newer than the oldest
kept checkpoint is deleted, and the in-flight directory never is.

:func:`plan_retention` is pure (``now_s`` is passed in); :func:`apply_retention`
lists, validates (QUICK) and deletes.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from agent.checkpoint.catalog import list_checkpoints
from agent.checkpoint.validate import Level, validate
from agent.wire.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetentionPolicy:
    """How many checkpoints to keep; values are checked on construction."""

    keep_last: int = 3
    keep_every_steps: int | None = None
    grace_s: float = 600.0

    def __post_init__(self) -> None:
        if not _is_int(self.keep_last) or self.keep_last < 1:
            raise ConfigError(
                f"retention keep_last must be an integer >= 1, got {self.keep_last!r}: "
                "keeping no checkpoint leaves nothing to resume from"
            )
        if self.keep_every_steps is not None and (
            not _is_int(self.keep_every_steps) or self.keep_every_steps < 1
        ):
            raise ConfigError(
                f"retention keep_every_steps must be an integer >= 1 or unset, "
                f"got {self.keep_every_steps!r}"
            )
        if (
            isinstance(self.grace_s, bool)
            or not isinstance(self.grace_s, int | float)
            or not math.isfinite(self.grace_s)
            or self.grace_s < 0
        ):
            raise ConfigError(
                f"retention grace_s must be a finite number of seconds >= 0, got {self.grace_s!r}"
            )


@dataclass(frozen=True)
class Candidate:
    """What the plan needs to know about one ``step-<N>`` directory."""

    step: int
    path: str
    valid: bool
    mtime_s: float


class DeleteReason(enum.Enum):
    """Why a directory is deleted."""

    BEYOND_KEEP_LAST = "beyond_keep_last"
    INVALID_PAST_GRACE = "invalid_past_grace"


@dataclass(frozen=True)
class Deletion:
    """One directory the plan deletes, with the reason in words for the log."""

    path: str
    step: int
    reason: DeleteReason
    detail: str


def plan_retention(
    entries: Sequence[Candidate],
    *,
    keep_last: int = 3,
    keep_every: int | None = None,
    grace_s: float,
    now_s: float,
    in_flight_step: int | None = None,
) -> list[Deletion]:
    """The directories to delete, newest first; pure: ``now_s`` is passed in.

    Raises :class:`ConfigError` for out-of-range settings.
    """
    RetentionPolicy(keep_last=keep_last, keep_every_steps=keep_every, grace_s=grace_s)
    ordered = sorted(entries, key=lambda entry: entry.step, reverse=True)
    valid = [entry for entry in ordered if entry.valid]
    if not valid:
        return []  # everything could still be a save in progress
    kept_paths = {entry.path for entry in valid[:keep_last]}
    newest_valid_step = valid[0].step
    oldest_kept_step = valid[:keep_last][-1].step
    deletions = []
    for entry in ordered:
        if entry.step == in_flight_step or entry.step > newest_valid_step:
            continue
        if in_flight_step is not None and entry.step > oldest_kept_step:
            continue
        if entry.valid:
            if entry.path in kept_paths or (keep_every and entry.step % keep_every == 0):
                continue
            deletions.append(
                Deletion(
                    entry.path,
                    entry.step,
                    DeleteReason.BEYOND_KEEP_LAST,
                    f"valid but older than the {keep_last} newest valid checkpoints "
                    "and not a permanent one",
                )
            )
            continue
        idle_s = now_s - entry.mtime_s
        if idle_s >= grace_s:
            deletions.append(
                Deletion(
                    entry.path,
                    entry.step,
                    DeleteReason.INVALID_PAST_GRACE,
                    f"invalid or uncommitted, older than the newest valid checkpoint "
                    f"(step {newest_valid_step}) and untouched for {idle_s:.0f} s "
                    f"(grace {grace_s:.0f} s)",
                )
            )
    return deletions


def apply_retention(
    root: str | os.PathLike[str],
    policy: RetentionPolicy,
    now_s: float,
    in_flight_step: int | None = None,
) -> list[Deletion]:
    """Validate (QUICK) every checkpoint under ``root``, plan, delete; return what was deleted.

    A directory that cannot be deleted is logged and skipped: the next run retries.
    """
    candidates = [
        Candidate(
            step=entry.step,
            path=entry.path,
            valid=validate(entry.path, Level.QUICK).valid,
            mtime_s=entry.mtime_s,
        )
        for entry in list_checkpoints(root)
    ]
    deleted = []
    for deletion in plan_retention(
        candidates,
        keep_last=policy.keep_last,
        keep_every=policy.keep_every_steps,
        grace_s=policy.grace_s,
        now_s=now_s,
        in_flight_step=in_flight_step,
    ):
        try:
            shutil.rmtree(deletion.path)
        except OSError as error:
            log.warning("retention could not delete %s: %s", deletion.path, error)
            continue
        log.info("retention deleted %s: %s", deletion.path, deletion.detail)
        deleted.append(deletion)
    return deleted


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
