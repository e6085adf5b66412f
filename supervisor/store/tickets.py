"""The store's drain tickets (what a supervisor without operator rights asks the admins),
and the facts the supervisor found out about itself.

Such a supervisor never drains (Slurm would refuse it). A node it blames is
excluded from the job and ticketed (:class:`supervisor.core.intents.DrainTicket`):
the ticket is the audit of that blame, counts towards the lemon list as a
drain would, and keeps the node out of the user's jobs while it is open
(raised within ``policy.probation_s`` and not closed). ``resurgo nodes
forgive`` closes a node's tickets.
"""

from __future__ import annotations

from typing import Any

from supervisor.store.core import StoreCore, locked, rowid
from supervisor.store.rows import Actor, Label, TicketRow, dumps, label, loads

_COLUMNS = (
    "t.ticket_id, t.node, t.cause, t.job_id, t.evidence, t.raised_s, t.closed_s, t.closed_by,"
    " t.hook, t.action_id, j.slurm_user"
)


class Tickets(StoreCore):
    """Drain tickets; a base of :class:`supervisor.store.Store`."""

    @locked
    def record_ticket(
        self,
        node: str,
        *,
        cause: Label,
        job_id: str | None,
        evidence: str,
        now_s: float,
        hook: str = "",
        action_id: str | None = None,
    ) -> TicketRow:
        """Record a ticket for ``node``; with ``action_id``, recording it again returns the
        first."""
        with self._tx(durable=True), self._job_must_exist(job_id or ""):
            cursor = self._db.execute(
                "INSERT INTO tickets (node, cause, job_id, evidence, raised_s, hook, action_id)"
                " VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (action_id) DO NOTHING",
                (node, label(cause), job_id, evidence, now_s, hook, action_id),
            )
            if cursor.rowcount == 1:
                found = self._tickets("WHERE t.ticket_id = ?", (rowid(cursor),))
            else:
                found = self._tickets("WHERE t.action_id = ?", (action_id,))
        return found[0]

    @locked
    def open_tickets(self, since_s: float) -> list[TicketRow]:
        """Tickets raised at or after ``since_s`` and not closed, oldest first."""
        return self._tickets("WHERE t.closed_s IS NULL AND t.raised_s >= ?", (since_s,))

    @locked
    def tickets_for(self, node: str) -> list[TicketRow]:
        """Every ticket of ``node``, oldest first."""
        return self._tickets("WHERE t.node = ?", (node,))

    @locked
    def all_tickets(self) -> list[TicketRow]:
        """Every ticket, oldest first."""
        return self._tickets("", ())

    @locked
    def close_tickets(self, node: str, *, now_s: float, by: Actor = Actor.OPERATOR) -> int:
        """Close ``node``'s open tickets (their verdicts withdrawn); return how many were open."""
        with self._tx(durable=True):
            cursor = self._db.execute(
                "UPDATE tickets SET closed_s = ?, closed_by = ?"
                " WHERE node = ? AND closed_s IS NULL",
                (now_s, by.value, node),
            )
        return cursor.rowcount

    @locked
    def set_fact(self, name: str, value: dict[str, Any], now_s: float) -> None:
        """Record what the supervisor found out about itself (e.g. ``rights``)."""
        with self._tx(durable=False):
            self._db.execute(
                "INSERT INTO supervisor_facts (name, value, updated_s) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO UPDATE SET value = excluded.value,"
                " updated_s = excluded.updated_s",
                (name, dumps(value, f"fact {name}"), now_s),
            )

    @locked
    def fact(self, name: str) -> dict[str, Any] | None:
        """A fact :meth:`set_fact` recorded, with its ``updated_s``; None if never."""
        row = self._db.execute(
            "SELECT value, updated_s FROM supervisor_facts WHERE name = ?", (name,)
        ).fetchone()
        if row is None:
            return None
        value: dict[str, Any] = loads(row[0])
        return {**value, "updated_s": row[1]}

    def _tickets(self, where: str, params: tuple[Any, ...]) -> list[TicketRow]:
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM tickets t LEFT JOIN jobs j ON j.job_id = t.job_id"
            f" {where} ORDER BY t.raised_s, t.ticket_id",
            params,
        )
        return [_ticket(row) for row in rows]


def _ticket(row: tuple[Any, ...]) -> TicketRow:
    (ticket_id, node, cause, job_id, evidence, raised_s, closed_s, closed_by, hook, action_id,
     slurm_user) = row  # fmt: skip
    return TicketRow(
        ticket_id=ticket_id,
        node=node,
        cause=cause,
        job_id=job_id,
        evidence=evidence,
        raised_s=raised_s,
        closed_s=closed_s,
        closed_by=None if closed_by is None else Actor(closed_by),
        hook=hook,
        action_id=action_id,
        slurm_user=slurm_user,
    )
