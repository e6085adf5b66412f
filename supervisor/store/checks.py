"""The store's node checks: the supervisor's own Slurm job on a node one job blamed.

A check is raised by a decision (:class:`supervisor.core.intents.CheckNode`),
submitted once the blaming job has left the node, and ends passed, failed or
expired (:mod:`supervisor.act.node_checks` runs them,
:mod:`supervisor.core.drains` decides what follows). While open it keeps
the node out of its user's next jobs, as a drain ticket does; a failed one
that drained nothing keeps it out of everyone's.
"""

from __future__ import annotations

from typing import Any

from supervisor.store.core import StoreCore, locked, rowid
from supervisor.store.rows import CheckResult, Label, NodeCheckRow, label

_COLUMNS = (
    "c.check_id, c.node, c.job_id, c.attempt, c.cause, c.evidence, c.raised_s,"
    " c.slurm_job_id, c.submitted_s, c.ended_s, c.result, c.detail, c.action_id, j.slurm_user"
)


class NodeChecks(StoreCore):
    """Node checks; a base of :class:`supervisor.store.Store`."""

    @locked
    def record_node_check(
        self,
        node: str,
        *,
        job_id: str,
        attempt: int,
        cause: Label,
        evidence: str,
        now_s: float,
        action_id: str | None = None,
    ) -> NodeCheckRow:
        """Raise a check of ``node``; with ``action_id``, raising it again returns the first."""
        with self._tx(durable=True), self._job_must_exist(job_id):
            cursor = self._db.execute(
                "INSERT INTO node_checks (node, job_id, attempt, cause, evidence, raised_s,"
                " action_id) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (action_id) DO NOTHING",
                (node, job_id, attempt, label(cause), evidence, now_s, action_id),
            )
            if cursor.rowcount == 1:
                found = self._checks("WHERE c.check_id = ?", (rowid(cursor),))
            else:
                found = self._checks("WHERE c.action_id = ?", (action_id,))
        return found[0]

    @locked
    def open_node_checks(self) -> list[NodeCheckRow]:
        """Checks not ended, oldest first."""
        return self._checks("WHERE c.ended_s IS NULL", ())

    @locked
    def node_checks_since(self, since_s: float) -> list[NodeCheckRow]:
        """Checks raised at or after ``since_s``, oldest first."""
        return self._checks("WHERE c.raised_s >= ?", (since_s,))

    @locked
    def node_checks_for(self, node: str) -> list[NodeCheckRow]:
        """Every check of ``node``, oldest first."""
        return self._checks("WHERE c.node = ?", (node,))

    @locked
    def node_check_submitted(self, check_id: int, slurm_job_id: int, now_s: float) -> None:
        """Record the Slurm job that runs the check."""
        with self._tx(durable=True):
            self._db.execute(
                "UPDATE node_checks SET slurm_job_id = ?, submitted_s = ? WHERE check_id = ?",
                (slurm_job_id, now_s, check_id),
            )

    @locked
    def end_node_check(self, check_id: int, result: CheckResult, detail: str, now_s: float) -> bool:
        """End an open check with ``result``; False when it had ended already."""
        with self._tx(durable=True):
            cursor = self._db.execute(
                "UPDATE node_checks SET ended_s = ?, result = ?, detail = ?"
                " WHERE check_id = ? AND ended_s IS NULL",
                (now_s, result.value, detail, check_id),
            )
        return cursor.rowcount == 1

    @locked
    def node_check_counts(self) -> dict[str, int]:
        """How many checks ended with each result over the store's life (``open``: not yet)."""
        rows = self._db.execute(
            "SELECT COALESCE(result, 'open'), COUNT(*) FROM node_checks GROUP BY 1"
        )
        return {result: int(count) for result, count in rows}

    def _checks(self, where: str, params: tuple[Any, ...]) -> list[NodeCheckRow]:
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM node_checks c LEFT JOIN jobs j ON j.job_id = c.job_id"
            f" {where} ORDER BY c.raised_s, c.check_id",
            params,
        )
        return [_check(row) for row in rows]


def _check(row: tuple[Any, ...]) -> NodeCheckRow:
    (check_id, node, job_id, attempt, cause, evidence, raised_s, slurm_job_id, submitted_s,
     ended_s, result, detail, action_id, slurm_user) = row  # fmt: skip
    return NodeCheckRow(
        check_id=check_id,
        node=node,
        job_id=job_id,
        attempt=attempt,
        cause=cause,
        evidence=evidence,
        raised_s=raised_s,
        slurm_job_id=slurm_job_id,
        submitted_s=submitted_s,
        ended_s=ended_s,
        result=None if result is None else CheckResult(result),
        detail=detail,
        action_id=action_id,
        slurm_user=slurm_user,
    )
