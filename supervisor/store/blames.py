"""The store's blames: every node a decision blamed, and whose job blamed it.

A drain or a ticket is what was done about a blame; the blame itself is kept
whatever was done, so that what the hourly share or the storm brake left
undone still counts as evidence: the storm brake reads the blames of the
last minutes (:func:`supervisor.core.drains.drain_storm`), and ``resurgo
nodes`` shows who blamed a node. The user is the one Slurm named at the
job's registration (``jobs.slurm_user``), never one a job's files say.
"""

from __future__ import annotations

from typing import Any

from supervisor.store.core import StoreCore, locked
from supervisor.store.rows import ActionState, BlameOutcome, BlameRow, Label, label

_COLUMNS = "blame_id, node, job_id, attempt, slurm_user, cause, outcome, blamed_s"
_UNFINISHED = (ActionState.PLANNED.value, ActionState.STARTED.value)


class Blames(StoreCore):
    """Blames, and how many actions of a kind are unfinished; a base of the store."""

    @locked
    def record_blame(
        self,
        node: str,
        *,
        job_id: str,
        attempt: int,
        cause: Label,
        outcome: BlameOutcome,
        now_s: float,
    ) -> None:
        """Record that ``job_id``'s ``attempt`` blamed ``node`` (once per attempt and node)."""
        with self._tx(durable=True), self._job_must_exist(job_id):
            self._db.execute(
                "INSERT INTO blames (node, job_id, attempt, slurm_user, cause, outcome,"
                " blamed_s) VALUES (?, ?, ?, (SELECT slurm_user FROM jobs WHERE job_id = ?),"
                " ?, ?, ?) ON CONFLICT (job_id, attempt, node) DO NOTHING",
                (node, job_id, attempt, job_id, label(cause), outcome.value, now_s),
            )

    @locked
    def blames_since(self, since_s: float) -> list[BlameRow]:
        """Blames at or after ``since_s``, oldest first (the storm brake's window)."""
        return self._blames("WHERE blamed_s >= ?", (since_s,))

    @locked
    def blames_for(self, node: str) -> list[BlameRow]:
        """Every blame of ``node``, oldest first."""
        return self._blames("WHERE node = ?", (node,))

    @locked
    def all_blames(self) -> list[BlameRow]:
        """Every blame, oldest first."""
        return self._blames("", ())

    @locked
    def blame_counts(self) -> dict[str, int]:
        """How many blames each outcome has, over the store's life."""
        rows = self._db.execute("SELECT outcome, COUNT(*) FROM blames GROUP BY outcome")
        return {outcome: int(count) for outcome, count in rows}

    @locked
    def job_users(self) -> dict[str, str]:
        """Each job's Slurm user, for the jobs whose user is known."""
        rows = self._db.execute("SELECT job_id, slurm_user FROM jobs WHERE slurm_user IS NOT NULL")
        return {job_id: user for job_id, user in rows}

    @locked
    def unfinished_count(self, kind: str) -> int:
        """Actions of ``kind`` planned or started and not finished: the drains decided
        and not done yet count against the hourly share as done ones do."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM actions WHERE state IN (?, ?) AND kind = ?",
            (*_UNFINISHED, kind),
        ).fetchone()
        return int(row[0])

    @locked
    def observed_count(self, kind: str, since_s: float) -> int:
        """Actions of ``kind`` that observe-only mode recorded as done, not doing them,
        since ``since_s``."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM actions WHERE kind = ? AND state = 'done' AND finished_s >= ?"
            " AND json_extract(result, '$.observe_only') = 1",
            (kind, since_s),
        ).fetchone()
        return int(row[0])

    def _blames(self, where: str, params: tuple[Any, ...]) -> list[BlameRow]:
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM blames {where} ORDER BY blamed_s, blame_id", params
        )
        return [
            BlameRow(
                blame_id=row[0], node=row[1], job_id=row[2], attempt=row[3], slurm_user=row[4],
                cause=row[5], outcome=BlameOutcome(row[6]), blamed_s=row[7],
            )
            for row in rows
        ]  # fmt: skip
