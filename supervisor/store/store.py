"""The supervisor's SQLite store: every job, attempt, event, decision, action and drain.

Exactly-once protocol for actions (what the executor does with this store):

1. In one :meth:`Store.transaction`, record the decision, ``plan_action`` each
   action under a deterministic id (``f"{job}/{attempt}/drain/{node}"``) and
   update the job record. Planning an id twice returns the first row, so a
   decision replayed after a crash plans nothing new.
2. ``mark_started`` is committed (fsynced) BEFORE the side effect runs.
3. Run the side effect (scontrol, a command to agents).
4. ``mark_done`` or ``mark_failed`` records the outcome.

After a restart, :meth:`Store.unfinished_actions` lists what was planned or
started but not finished, in plan order. A ``planned`` action never ran and
can be started. A ``started`` one may or may not have taken effect (the
supervisor died between 2 and 4): the executor reconciles it against Slurm
(is the node already drained? the job already requeued?) and then either
marks it done or starts it again; it is never blindly re-run.

Events are consumed by cursor: agents' events are stored idempotently by
``event_id`` and numbered in arrival order (``seq``); the daemon keeps the
last ``seq`` it decided on in the job record, updated in the same transaction
as the decision, and reads ``events_for(job, since_seq=cursor)``.

Durability: WAL with ``synchronous=NORMAL`` for high-volume writes (events,
observations, progress, checkpoints, step reports, lease flushes): a commit
survives the supervisor being SIGKILLed (it is in the WAL, in the OS page
cache) but the last commits can vanish if the head node loses power.
Everything that drives or records a side effect (jobs, attempts, decisions,
actions, drains, commands, and every :meth:`Store.transaction`) commits with
``synchronous=FULL``, which fsyncs the WAL: after a power loss the store never
forgets that a drain or a requeue already happened. Agents' events are
re-observable (Slurm and the agents report the state again), drains are not.
The daemon opens ``transaction(durable=False)`` for a job record that only
took such news in (a newer checkpoint) and decides nothing. The WAL is
written in order, so a power loss takes back only the newest commits, never
one before an fsynced commit.

Heartbeat leases live in memory (a dict update per heartbeat, no SQL). What
must survive a crash is which agent incarnation holds each lease: a new lease
or incarnation is written by the next :meth:`Store.flush_leases`, which the
daemon calls every tick. Renewal times are written only at a clean
:meth:`Store.close` (and before a backup), so after a crash the stored times
are when each lease was taken: grant a grace of one lease period from the
start before trusting ``expired_leases`` (the daemon does).

Every agent asks for its pending commands on every heartbeat, and nearly
always there are none: the store remembers which agents (job, node) have
none, and forgets a job's agents when a command is queued for the job (or a
transaction is rolled back). Commands are queued through this object (the
executor's), never by another process writing the same file.

Threads: the daemon uses the store from its asyncio thread. Every public
method and :meth:`Store.transaction` holds one re-entrant lock, so calling
from a worker thread (``asyncio.to_thread``) is safe too; a transaction
blocks other threads until it ends. The store never reads the clock: every
time is an argument.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent.wire.protocol import Command, CommandKind
from supervisor.errors import ActionStateError, StoreError
from supervisor.store.blames import Blames
from supervisor.store.checks import NodeChecks
from supervisor.store.core import locked, rowid
from supervisor.store.history import History
from supervisor.store.rows import (
    ActionRow,
    ActionState,
    Actor,
    CheckpointRow,
    CheckResult,
    DrainRow,
    Label,
    Lemon,
    ProgressRow,
    dumps,
    label,
    loads,
)
from supervisor.store.steps import StepReports
from supervisor.store.summaries import Summaries
from supervisor.store.tickets import Tickets

logger = logging.getLogger(__name__)

_PLANNED, _STARTED = ActionState.PLANNED.value, ActionState.STARTED.value
_DONE, _FAILED = ActionState.DONE.value, ActionState.FAILED.value
# Jobs whose agents without pending commands are remembered: more than run at
# once; beyond it (finished jobs pile up) the memory starts afresh.
_QUIET_JOBS_REMEMBERED = 10_000


class Store(History, StepReports, Tickets, Blames, NodeChecks, Summaries):
    """The supervisor's store; open it with :meth:`Store.open`. See the module docstring."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        """Wrap an open, checked and migrated connection; use :meth:`open` instead."""
        super().__init__(db, path)
        # job -> its nodes known to have no pending command
        self._quiet: dict[str, set[str]] = {}

    def _forget_caches(self) -> None:
        super()._forget_caches()
        self._quiet.clear()

    # ------------------------------------------------------------------
    # Actions: the exactly-once backbone.

    @locked
    def plan_action(
        self, action_id: str, job_id: str, kind: Label, args: dict[str, Any], now_s: float
    ) -> ActionRow:
        """Record the intent ``action_id``; planning an existing id returns the stored row.

        The first plan wins: a re-plan's ``kind`` and ``args`` are ignored
        (logged when they differ), so make ids deterministic from what the
        action is and does.
        """
        args_text = dumps(args, f"action {action_id} args")
        with self._tx(durable=True), self._job_must_exist(job_id):
            self._db.execute(
                "INSERT INTO actions (action_id, job_id, kind, args, state, planned_s)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (action_id) DO NOTHING",
                (action_id, job_id, label(kind), args_text, _PLANNED, now_s),
            )
        row = self._action(action_id)
        if (row.job_id, row.kind, row.args) != (job_id, label(kind), loads(args_text)):
            logger.warning(
                "action %s was planned before as %s %s for job %s; keeping the first plan",
                action_id, row.kind, row.args, row.job_id,
            )  # fmt: skip
        return row

    @locked
    def mark_started(self, action_id: str, now_s: float) -> ActionRow:
        """Record that the side effect is about to run; commit this BEFORE running it.

        Allowed from planned, from started (re-running after reconciliation
        found it had not taken effect) and from a retryable failure.
        """
        return self._transition(
            action_id,
            "state = ?, starts = starts + 1, started_s = ?, finished_s = NULL, error = NULL,"
            " retryable = NULL",
            (_STARTED, now_s),
            f"state IN ('{_PLANNED}', '{_STARTED}') OR (state = '{_FAILED}' AND retryable = 1)",
            "start",
        )

    @locked
    def mark_done(self, action_id: str, result: dict[str, Any], now_s: float) -> ActionRow:
        """Record that a started action took effect, with what it returned."""
        return self._transition(
            action_id,
            "state = ?, finished_s = ?, result = ?",
            (_DONE, now_s, dumps(result, f"action {action_id} result")),
            f"state = '{_STARTED}'",
            "finish",
        )

    @locked
    def mark_failed(
        self, action_id: str, error: str, now_s: float, *, retryable: bool
    ) -> ActionRow:
        """Record that a planned or started action failed; ``retryable`` lets it start again."""
        return self._transition(
            action_id,
            "state = ?, finished_s = ?, error = ?, retryable = ?",
            (_FAILED, now_s, error, int(retryable)),
            f"state IN ('{_PLANNED}', '{_STARTED}')",
            "fail",
        )

    @locked
    def get_action(self, action_id: str) -> ActionRow | None:
        """The action's row, or None if it was never planned."""
        row = self._db.execute(
            f"SELECT {_ACTION_COLUMNS} FROM actions WHERE action_id = ?", (action_id,)
        ).fetchone()
        return None if row is None else _action(row)

    @locked
    def unfinished_actions(self, job_id: str | None = None) -> list[ActionRow]:
        """Planned or started actions (of one job, or all) in plan order: reconcile these."""
        return self.list_actions(job_id, states=(ActionState.PLANNED, ActionState.STARTED))

    @locked
    def list_actions(
        self, job_id: str | None = None, *, states: Iterable[ActionState] | None = None
    ) -> list[ActionRow]:
        """Actions (of one job, or all; in ``states``, or any) in plan order."""
        clauses, params = [], []
        if job_id is not None:
            clauses.append("job_id = ?")
            params.append(job_id)
        if states is not None:
            values = [state.value for state in states]
            clauses.append(f"state IN ({', '.join('?' * len(values))})" if values else "0")
            params.extend(values)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self._db.execute(
            f"SELECT {_ACTION_COLUMNS} FROM actions {where} ORDER BY seq", params
        )
        return [_action(row) for row in rows]

    def _transition(
        self, action_id: str, assignments: str, params: tuple[Any, ...], allowed: str, verb: str
    ) -> ActionRow:
        with self._tx(durable=True):
            cursor = self._db.execute(
                f"UPDATE actions SET {assignments} WHERE action_id = ? AND ({allowed})",
                (*params, action_id),
            )
        row = self._action(action_id)
        if cursor.rowcount != 1:
            raise ActionStateError(
                f"cannot {verb} action {action_id}: it is {row.state.value}"
                + (" (not retryable)" if row.state is ActionState.FAILED else "")
                + "; a finished action is never run again: plan a new action id instead"
            )
        return row

    def _action(self, action_id: str) -> ActionRow:
        row = self.get_action(action_id)
        if row is None:
            raise StoreError(f"no action {action_id} in the store; plan_action() it first")
        return row

    # ------------------------------------------------------------------
    # Drains: the audit trail, the rate limit and the lemon list.

    @locked
    def record_drain(
        self,
        node: str,
        *,
        cause: Label,
        job_id: str | None,
        reason: str,
        now_s: float,
        by: Actor = Actor.SUPERVISOR,
        action_id: str | None = None,
    ) -> DrainRow:
        """Audit a drain of ``node``; with ``action_id``, recording it again returns the first."""
        with self._tx(durable=True), self._job_must_exist(job_id or ""):
            cursor = self._db.execute(
                "INSERT INTO drains (node, cause, job_id, reason, drained_by, drained_s,"
                " action_id) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (action_id) DO NOTHING",
                (node, label(cause), job_id, reason, by.value, now_s, action_id),
            )
            if cursor.rowcount == 1:
                row = self._db.execute(
                    f"SELECT {_DRAIN_COLUMNS} FROM drains WHERE drain_id = ?", (rowid(cursor),)
                )
            else:
                row = self._db.execute(
                    f"SELECT {_DRAIN_COLUMNS} FROM drains WHERE action_id = ?", (action_id,)
                )
        return _drain(row.fetchone())

    @locked
    def record_undrain(self, node: str, *, now_s: float, by: Actor = Actor.SUPERVISOR) -> int:
        """Close every open drain of ``node`` (it was resumed); return how many were open."""
        with self._tx(durable=True):
            cursor = self._db.execute(
                "UPDATE drains SET undrained_s = ?, undrained_by = ?"
                " WHERE node = ? AND undrained_s IS NULL",
                (now_s, by.value, node),
            )
        return cursor.rowcount

    @locked
    def record_lifted_outside(self, node: str, *, now_s: float) -> int:
        """Close ``node``'s open Resurgo drains as undone outside Resurgo, verdicts withdrawn.

        Someone resumed the node with Slurm's own tools: they judged the drain
        wrong, so its blame stops counting towards the lemon list. Returns how
        many drains were open.
        """
        with self._tx(durable=True):
            cursor = self._db.execute(
                "UPDATE drains SET undrained_s = ?, undrained_by = ?, withdrawn_s = ?,"
                " withdrawn_by = ? WHERE node = ? AND undrained_s IS NULL AND drained_by = ?",
                (now_s, Actor.OUTSIDE.value, now_s, Actor.OUTSIDE.value, node,
                 Actor.SUPERVISOR.value),
            )  # fmt: skip
        return cursor.rowcount

    @locked
    def withdraw_blames(self, node: str, *, now_s: float, by: Actor = Actor.OPERATOR) -> int:
        """Mark every standing verdict of Resurgo against ``node`` wrong; return how many.

        Its open drain tickets are closed. The drains stay in the audit (an
        open one stays open: the node is still drained in Slurm until someone
        resumes it); none counts towards the lemon list any more.
        """
        with self._tx(durable=True):
            cursor = self._db.execute(
                "UPDATE drains SET withdrawn_s = ?, withdrawn_by = ?"
                " WHERE node = ? AND drained_by = ? AND withdrawn_s IS NULL",
                (now_s, by.value, node, Actor.SUPERVISOR.value),
            )
            return cursor.rowcount + self.close_tickets(node, now_s=now_s, by=by)

    @locked
    def open_drains(self) -> list[DrainRow]:
        """Drains not yet undone (the nodes Resurgo or an operator keeps out), oldest first."""
        return self._drains("WHERE undrained_s IS NULL", ())

    @locked
    def drains_since(self, since_s: float, *, by: Actor | None = None) -> list[DrainRow]:
        """Drains at or after ``since_s`` (by one actor, or any), oldest first: the rate limit."""
        if by is None:
            return self._drains("WHERE drained_s >= ?", (since_s,))
        return self._drains("WHERE drained_s >= ? AND drained_by = ?", (since_s, by.value))

    @locked
    def blame_history(self, node: str) -> list[DrainRow]:
        """Every drain of ``node`` across all jobs, oldest first."""
        return self._drains("WHERE node = ?", (node,))

    @locked
    def lemons(self, threshold: int, window_s: float, now_s: float, users: int = 1) -> list[Lemon]:
        """Nodes the supervisor blamed at least ``threshold`` times in the last ``window_s``,
        on the word of jobs of at least ``users`` distinct Slurm users, or of fewer when the
        node failed the supervisor's own check within the window.

        A blame is a drain, or a drain ticket where the supervisor may not
        drain. Operator drains (maintenance) are not blame and do not count,
        nor do withdrawn verdicts (lifted outside Resurgo, or forgiven). A job
        whose user is not known (registered before users were kept) counts as
        a user of its own.
        """
        rows = self._db.execute(
            "SELECT b.node, COUNT(*), MAX(b.blamed_s),"
            " COUNT(DISTINCT COALESCE(j.slurm_user, 'job ' || b.job_id, 'unknown')) FROM ("
            " SELECT node, job_id, drained_s AS blamed_s FROM drains"
            " WHERE drained_by = ? AND drained_s > ? AND withdrawn_s IS NULL"
            " UNION ALL SELECT node, job_id, raised_s FROM tickets"
            " WHERE raised_s > ? AND closed_s IS NULL"
            ") AS b LEFT JOIN jobs AS j ON j.job_id = b.job_id"
            " GROUP BY b.node HAVING COUNT(*) >= ?"
            " AND (COUNT(DISTINCT COALESCE(j.slurm_user, 'job ' || b.job_id, 'unknown')) >= ?"
            " OR b.node IN (SELECT node FROM node_checks WHERE result = ? AND ended_s > ?))"
            " ORDER BY COUNT(*) DESC, b.node",
            (Actor.SUPERVISOR.value, now_s - window_s, now_s - window_s, threshold, users,
             CheckResult.FAILED.value, now_s - window_s),
        )  # fmt: skip
        return [Lemon(*row) for row in rows]

    def _drains(self, where: str, params: tuple[Any, ...]) -> list[DrainRow]:
        rows = self._db.execute(
            f"SELECT {_DRAIN_COLUMNS} FROM drains {where} ORDER BY drained_s, drain_id", params
        )
        return [_drain(row) for row in rows]

    # ------------------------------------------------------------------
    # Commands to agents.

    @locked
    def queue_command(self, job_id: str, node: str | None, command: Command, now_s: float) -> bool:
        """Queue ``command`` for one node (or every node of the job, ``node=None``).

        Idempotent by ``command_id``; returns whether it was new.
        """
        # Forgotten before the write: a rollback then costs a query, never a command.
        self._quiet.pop(job_id, None)
        with self._tx(durable=True), self._job_must_exist(job_id):
            cursor = self._db.execute(
                "INSERT INTO commands (command_id, job_id, node, kind, args, queued_s)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (command_id) DO NOTHING",
                (
                    command.command_id, job_id, node, command.kind.value,
                    dumps(command.args, f"command {command.command_id} args"), now_s,
                ),
            )  # fmt: skip
        return cursor.rowcount == 1

    @locked
    def maybe_pending(self, job_id: str, nodes: Iterable[str]) -> list[str]:
        """Those of ``nodes`` that may have commands pending: not known to have none
        since the job's last command was queued (no SQL runs)."""
        quiet = self._quiet.get(job_id)
        return list(nodes) if quiet is None else [node for node in nodes if node not in quiet]

    @locked
    def pending_commands(self, job_id: str, node: str) -> list[Command]:
        """Commands for ``node`` of the job that ``node`` has not acknowledged, oldest first."""
        if node in self._quiet.get(job_id, ()):
            return []
        rows = self._db.execute(
            "SELECT kind, command_id, args FROM commands AS c"
            " WHERE job_id = ? AND (node IS NULL OR node = ?) AND NOT EXISTS"
            " (SELECT 1 FROM command_acks AS a WHERE a.command_id = c.command_id"
            " AND a.node = ?) ORDER BY seq",
            (job_id, node, node),
        )
        commands = [
            Command(CommandKind(kind), command_id, loads(args)) for kind, command_id, args in rows
        ]
        if not commands:
            if job_id not in self._quiet and len(self._quiet) >= _QUIET_JOBS_REMEMBERED:
                self._quiet.clear()
            self._quiet.setdefault(job_id, set()).add(node)
        return commands

    @locked
    def ack_command(self, command_id: str, node: str, now_s: float) -> bool:
        """Record that ``node`` received the command; return False if unknown or acked before.

        A command for every node is pending on each node until that node acks it.
        """
        with self._tx(durable=False):
            cursor = self._db.execute(
                "INSERT INTO command_acks (command_id, node, acked_s)"
                " SELECT command_id, ?, ? FROM commands WHERE command_id = ?"
                " AND (node IS NULL OR node = ?) ON CONFLICT DO NOTHING",
                (node, now_s, command_id, node),
            )
        return cursor.rowcount == 1

    # ------------------------------------------------------------------
    # Raw data for goodput accounting.

    @locked
    def record_checkpoint(self, job_id: str, step: int, path: str, now_s: float) -> CheckpointRow:
        """Record a committed checkpoint; the same path again keeps its first commit time."""
        with self._tx(durable=False), self._job_must_exist(job_id):
            self._db.execute(
                "INSERT INTO checkpoints (job_id, path, step, committed_s) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, path) DO NOTHING",
                (job_id, path, step, now_s),
            )
        row = self._db.execute(
            "SELECT job_id, step, path, committed_s FROM checkpoints WHERE job_id = ? AND path = ?",
            (job_id, path),
        ).fetchone()
        return CheckpointRow(*row)

    @locked
    def checkpoints_for(self, job_id: str) -> list[CheckpointRow]:
        """The job's committed checkpoints in commit order."""
        rows = self._db.execute(
            "SELECT job_id, step, path, committed_s FROM checkpoints WHERE job_id = ?"
            " ORDER BY committed_s, step",
            (job_id,),
        )
        return [CheckpointRow(*row) for row in rows]

    @locked
    def newest_checkpoint(self, job_id: str) -> CheckpointRow | None:
        """The job's committed checkpoint of the highest step (of equal steps, the first
        committed); None before its first."""
        row = self._db.execute(
            "SELECT job_id, step, path, committed_s FROM checkpoints WHERE job_id = ?"
            " ORDER BY step DESC, committed_s LIMIT 1",
            (job_id,),
        ).fetchone()
        return None if row is None else CheckpointRow(*row)

    @locked
    def record_progress(self, job_id: str, step: int, now_s: float) -> bool:
        """Record that the job is at ``step``; return whether a row was written.

        Compact: a row only when the step differs from the job's last
        recorded one (a rollback after a restart is a difference too), so
        heartbeats repeating the same step cost no write. Pass one job-level
        step (e.g. the slowest rank's), not every rank's.
        """
        if job_id not in self._last_step:
            found = self._db.execute(
                "SELECT step FROM progress WHERE job_id = ? ORDER BY id DESC LIMIT 1", (job_id,)
            ).fetchone()
            self._last_step[job_id] = None if found is None else found[0]
        if self._last_step[job_id] == step:
            return False
        with self._tx(durable=False), self._job_must_exist(job_id):
            self._db.execute(
                "INSERT INTO progress (job_id, step, time_s) VALUES (?, ?, ?)",
                (job_id, step, now_s),
            )
            self._last_step[job_id] = step
        return True

    @locked
    def first_progress_after(self, job_id: str, since_s: float) -> ProgressRow | None:
        """The job's first progress sample at or after ``since_s`` (None: none yet)."""
        row = self._db.execute(
            "SELECT job_id, step, time_s FROM progress WHERE job_id = ? AND time_s >= ?"
            " ORDER BY id LIMIT 1",
            (job_id, since_s),
        ).fetchone()
        return None if row is None else ProgressRow(*row)

    @locked
    def latest_progress(self, job_id: str) -> ProgressRow | None:
        """The job's newest progress sample (None: it never stepped)."""
        row = self._db.execute(
            "SELECT job_id, step, time_s FROM progress WHERE job_id = ? ORDER BY id DESC LIMIT 1",
            (job_id,),
        ).fetchone()
        return None if row is None else ProgressRow(*row)

    @locked
    def progress_for(self, job_id: str, since_s: float | None = None) -> list[ProgressRow]:
        """The job's progress samples (at or after ``since_s``) in the order they came."""
        rows = self._db.execute(
            PROGRESS_SINCE_SQL, (job_id, float("-inf") if since_s is None else since_s)
        )
        return [ProgressRow(*row) for row in rows]


# One range of progress_by_time however long the job's history (a test checks the plan).
PROGRESS_SINCE_SQL = (
    "SELECT job_id, step, time_s FROM progress WHERE job_id = ? AND time_s >= ? ORDER BY id"
)
_ACTION_COLUMNS = (
    "seq, action_id, job_id, kind, args, state, starts, planned_s, started_s, finished_s,"
    " result, error, retryable"
)
_DRAIN_COLUMNS = (
    "drain_id, node, cause, job_id, reason, drained_by, drained_s, undrained_s,"
    " undrained_by, action_id, withdrawn_s, withdrawn_by"
)


def _action(row: tuple[Any, ...]) -> ActionRow:
    return ActionRow(
        seq=row[0],
        action_id=row[1],
        job_id=row[2],
        kind=row[3],
        args=loads(row[4]),
        state=ActionState(row[5]),
        starts=row[6],
        planned_s=row[7],
        started_s=row[8],
        finished_s=row[9],
        result=loads(row[10]),
        error=row[11],
        retryable=None if row[12] is None else bool(row[12]),
    )


def _drain(row: tuple[Any, ...]) -> DrainRow:
    return DrainRow(
        drain_id=row[0],
        node=row[1],
        cause=row[2],
        job_id=row[3],
        reason=row[4],
        drained_by=Actor(row[5]),
        drained_s=row[6],
        undrained_s=row[7],
        undrained_by=None if row[8] is None else Actor(row[8]),
        action_id=row[9],
        withdrawn_s=row[10],
        withdrawn_by=None if row[11] is None else Actor(row[11]),
    )
