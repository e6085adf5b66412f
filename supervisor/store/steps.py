"""The store's step reports: per-step losses and data cursors, kept for resume verification.

The daemon stores each ``step_losses`` event's steps under the job's current
attempt (:meth:`StepReports.record_steps`); :mod:`supervisor.core.verify` reads them
back with the three indexed queries below. A job runs for up to millions of
steps, so nothing here reads more rows than the caller asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from supervisor.store.core import StoreCore, locked
from supervisor.store.rows import StepRow

_COLUMNS = "job_id, attempt, step, global_rank, loss, cursor, received_s"
# Each of these is one probe or one range of an index (a test checks the plans).
LAST_STEP_SQL = (
    "SELECT step FROM step_reports WHERE job_id = ? AND attempt = ? ORDER BY step DESC LIMIT 1"
)
FIRST_STEP_SQL = (
    "SELECT step FROM step_reports WHERE job_id = ? AND attempt = ? ORDER BY step LIMIT 1"
)
STEP_SQL = (
    f"SELECT {_COLUMNS} FROM step_reports WHERE job_id = ? AND step = ?"
    " ORDER BY attempt, global_rank"
)
RANGE_SQL = (
    f"SELECT {_COLUMNS} FROM step_reports WHERE job_id = ? AND attempt = ?"
    " AND step BETWEEN ? AND ? ORDER BY step, global_rank"
)


class StepReports(StoreCore):
    """What training ranks reported per step; a base of :class:`supervisor.store.Store`."""

    @locked
    def record_steps(
        self,
        job_id: str,
        attempt: int,
        global_rank: int,
        steps: Iterable[Mapping[str, Any]],
        now_s: float,
    ) -> int:
        """Store ``global_rank``'s reports from launch ``attempt``; return how many were new.

        ``steps`` are the entries of a ``step_losses`` payload: ``step``, and
        ``loss`` and ``cursor`` (None or absent when unknown). The same step of
        the same attempt and rank again keeps its first report (a resent
        event, or ranks that replayed steps within one attempt); a loss that
        is not finite is stored as None. ValueError names an entry that is not
        a step report.
        """
        rows = [_row(job_id, attempt, global_rank, entry, now_s) for entry in steps]
        if not rows:
            return 0
        with self._tx(durable=False), self._job_must_exist(job_id):
            cursor = self._db.executemany(
                f"INSERT INTO step_reports ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT DO NOTHING",
                rows,
            )
        return cursor.rowcount

    @locked
    def steps_for(
        self,
        job_id: str,
        attempt: int | None = None,
        *,
        first_step: int | None = None,
        last_step: int | None = None,
    ) -> list[StepRow]:
        """The job's step reports (of one attempt; steps in ``[first_step, last_step]``).

        Ordered by attempt, step, global rank.
        """
        low = -1 if first_step is None else first_step
        high = (1 << 63) - 1 if last_step is None else last_step
        if attempt is not None:
            rows = self._db.execute(RANGE_SQL, (job_id, attempt, low, high))
        else:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM step_reports WHERE job_id = ?"
                " AND step BETWEEN ? AND ? ORDER BY attempt, step, global_rank",
                (job_id, low, high),
            )
        return [StepRow(*row) for row in rows]

    @locked
    def reports_of_step(self, job_id: str, step: int) -> list[StepRow]:
        """Every attempt's and rank's report of one step, by attempt then rank."""
        return [StepRow(*row) for row in self._db.execute(STEP_SQL, (job_id, step))]

    @locked
    def last_reported_step(self, job_id: str, attempt: int) -> int | None:
        """The highest step any rank reported in ``attempt``; None before the first report."""
        found = self._db.execute(LAST_STEP_SQL, (job_id, attempt)).fetchone()
        return None if found is None else int(found[0])

    @locked
    def first_reported_step(self, job_id: str, attempt: int) -> int | None:
        """The lowest step any rank reported in ``attempt``; None before the first report."""
        found = self._db.execute(FIRST_STEP_SQL, (job_id, attempt)).fetchone()
        return None if found is None else int(found[0])


def _row(
    job_id: str, attempt: int, global_rank: int, entry: Mapping[str, Any], now_s: float
) -> tuple[Any, ...]:
    step, loss, cursor = entry.get("step"), entry.get("loss"), entry.get("cursor")
    counts = (attempt, global_rank, step, 0 if cursor is None else cursor)
    number = loss is None or (isinstance(loss, int | float) and not isinstance(loss, bool))
    if not all(_is_count(value) for value in counts) or not number:
        raise ValueError(
            f"job {job_id} attempt {attempt} rank {global_rank}: {dict(entry)!r} is not a step "
            "report: attempt, rank, step and cursor must be integers >= 0, loss a number or None"
        )
    finite = None if loss is None or not math.isfinite(loss) else float(loss)
    return (job_id, attempt, step, global_rank, finite, cursor, now_s)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
