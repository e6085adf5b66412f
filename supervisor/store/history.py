"""The store's history tables: jobs, attempts, events and the decisions taken on them."""

from __future__ import annotations

import math
import sqlite3
import uuid
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from agent.wire.protocol import Event
from supervisor.errors import StoreError, UnknownJob
from supervisor.store.core import StoreCore, in_clause, locked, rowid
from supervisor.store.rows import (
    AttemptRow,
    DecisionRow,
    EventRow,
    EventSource,
    JobRow,
    Label,
    dumps,
    label,
    loads,
)

# What a pruning leaves of a job's quota: the next one comes a tenth of it later.
PRUNED_TO = 0.9


class History(StoreCore):
    """Jobs, attempts, events and decisions; the base of :class:`supervisor.store.Store`."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        super().__init__(db, path)
        # job -> [agent events stored, their payload bytes]: counted once, then kept
        self._usage: dict[str, list[int]] = {}

    def _forget_caches(self) -> None:
        super()._forget_caches()
        self._usage.clear()

    # ------------------------------------------------------------------
    # Jobs and attempts.

    @locked
    def upsert_job(
        self,
        job_id: str,
        *,
        state: Label,
        record: dict[str, Any],
        now_s: float,
        record_version: int = 1,
        name: str | None = None,
        original_nodes: int | None = None,
        world_size: int | None = None,
        min_nodes: int | None = None,
        secret_path: str | None = None,
        slurm_user: str | None = None,
    ) -> JobRow:
        """Create the job or update it; return the stored row.

        A new job needs ``name``, ``original_nodes`` and ``min_nodes``
        (``world_size`` defaults to ``original_nodes``). On an update, the
        optional fields left None keep their stored values; ``state`` and
        ``record`` are always replaced. ``slurm_user``: whose job it is, as
        Slurm says (blames and drains name this user).
        """
        record_text = dumps(record, f"job {job_id} record")
        with self._tx(durable=True):
            old = self.get_job(job_id)
            if old is None:
                if name is None or original_nodes is None or min_nodes is None:
                    raise ValueError(
                        f"job {job_id} is new: give name, original_nodes and min_nodes"
                    )
                self._db.execute(
                    "INSERT INTO jobs (job_id, name, state, original_nodes, world_size,"
                    " min_nodes, record, record_version, secret_path, created_s, updated_s,"
                    " slurm_user) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        job_id, name, label(state), original_nodes,
                        original_nodes if world_size is None else world_size,
                        min_nodes, record_text, record_version, secret_path, now_s, now_s,
                        slurm_user,
                    ),
                )  # fmt: skip
            else:
                self._db.execute(
                    "UPDATE jobs SET name = ?, state = ?, original_nodes = ?, world_size = ?,"
                    " min_nodes = ?, record = ?, record_version = ?, secret_path = ?,"
                    " updated_s = ?, slurm_user = ? WHERE job_id = ?",
                    (
                        old.name if name is None else name,
                        label(state),
                        old.original_nodes if original_nodes is None else original_nodes,
                        old.world_size if world_size is None else world_size,
                        old.min_nodes if min_nodes is None else min_nodes,
                        record_text,
                        record_version,
                        old.secret_path if secret_path is None else secret_path,
                        now_s,
                        old.slurm_user if slurm_user is None else slurm_user,
                        job_id,
                    ),
                )
            self._known_jobs.add(job_id)
            row = self.get_job(job_id)
        assert row is not None
        return row

    @locked
    def update_record(
        self,
        job_id: str,
        *,
        state: Label,
        record: dict[str, Any],
        now_s: float,
        world_size: int | None = None,
    ) -> None:
        """Replace a known job's state and record (and its world size, when given).

        The decision task's write after each decision: one statement, the old row
        not read back (:meth:`upsert_job` reads it twice, and a record names every
        node of the job). :class:`UnknownJob` for a job not in the store.
        """
        record_text = dumps(record, f"job {job_id} record")
        with self._tx(durable=True):
            cursor = self._db.execute(
                "UPDATE jobs SET state = ?, record = ?, record_version = 1, updated_s = ?,"
                " world_size = COALESCE(?, world_size) WHERE job_id = ?",
                (label(state), record_text, now_s, world_size, job_id),
            )
            if cursor.rowcount != 1:
                raise UnknownJob(f"job {job_id} is not in the store; upsert_job() it first")

    @locked
    def get_job(self, job_id: str) -> JobRow | None:
        """The job's row, or None if the store has never seen it."""
        row = self._db.execute(f"SELECT {_JOB_COLUMNS} FROM jobs WHERE job_id = ?", (job_id,))
        found = row.fetchone()
        return None if found is None else _job(found)

    @locked
    def list_jobs(self, states: Iterable[Label] | None = None) -> list[JobRow]:
        """Every job (or those in ``states``), oldest first."""
        where, params = in_clause("state", states)
        rows = self._db.execute(
            f"SELECT {_JOB_COLUMNS} FROM jobs {where} ORDER BY created_s, job_id", params
        )
        return [_job(row) for row in rows]

    @locked
    def start_attempt(
        self,
        job_id: str,
        attempt: int,
        *,
        nodes: Sequence[str],
        resumed_from: str | None,
        now_s: float,
    ) -> AttemptRow:
        """Record launch number ``attempt``; starting the same number again returns the first."""
        with self._tx(durable=True), self._job_must_exist(job_id):
            self._db.execute(
                "INSERT INTO attempts (job_id, attempt, nodes, resumed_from, started_s)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (job_id, attempt) DO NOTHING",
                (job_id, attempt, dumps(list(nodes), "nodes"), resumed_from, now_s),
            )
        return self._attempt(job_id, attempt)

    @locked
    def end_attempt(self, job_id: str, attempt: int, *, cause: Label, now_s: float) -> AttemptRow:
        """Record how an attempt ended; an attempt that already ended keeps its first end."""
        with self._tx(durable=True):
            self._db.execute(
                "UPDATE attempts SET ended_s = ?, end_cause = ?"
                " WHERE job_id = ? AND attempt = ? AND ended_s IS NULL",
                (now_s, label(cause), job_id, attempt),
            )
        return self._attempt(job_id, attempt)

    @locked
    def attempts_for(self, job_id: str) -> list[AttemptRow]:
        """Every attempt of the job, in attempt order (the last one is the current one)."""
        rows = self._db.execute(
            f"SELECT {_ATTEMPT_COLUMNS} FROM attempts WHERE job_id = ? ORDER BY attempt",
            (job_id,),
        )
        return [_attempt_row(row) for row in rows]

    @locked
    def relaunches_for(
        self, job_id: str, *, started_after_s: float = -math.inf
    ) -> list[AttemptRow]:
        """The job's attempts after its first (those started after ``started_after_s``),
        in attempt order: what a timeline reads at each scrape, which for nearly every
        job is none, without decoding the first attempt's nodes."""
        rows = self._db.execute(
            f"SELECT {_ATTEMPT_COLUMNS} FROM attempts WHERE job_id = ? AND started_s > ?"
            " AND attempt > (SELECT MIN(attempt) FROM attempts WHERE job_id = ?)"
            " ORDER BY attempt",
            (job_id, started_after_s, job_id),
        )
        return [_attempt_row(row) for row in rows]

    def _attempt(self, job_id: str, attempt: int) -> AttemptRow:
        row = self._db.execute(
            f"SELECT {_ATTEMPT_COLUMNS} FROM attempts WHERE job_id = ? AND attempt = ?",
            (job_id, attempt),
        ).fetchone()
        if row is None:
            raise StoreError(f"job {job_id} has no attempt {attempt}; start_attempt() it first")
        return _attempt_row(row)

    # ------------------------------------------------------------------
    # Events and decisions.

    @locked
    def record_events(self, job_id: str, events: Iterable[Event], *, now_s: float) -> list[str]:
        """Store agents' events once each; return every id in the batch as accepted.

        A duplicate (a retry whose first reply was lost) is accepted again
        but not stored again. One ``executemany`` per batch, NORMAL sync.
        """
        rows = []
        for event in events:
            if event.job_id != job_id:
                raise ValueError(
                    f"event {event.event_id} belongs to job {event.job_id}, not {job_id}"
                )
            rows.append(
                (
                    event.event_id, job_id, event.node, event.kind.value,
                    EventSource.AGENT.value, event.seq, event.time_unix_s, now_s,
                    dumps(event.payload, f"event {event.event_id} payload"),
                )
            )  # fmt: skip
        if rows:
            with self._tx(durable=False), self._job_must_exist(job_id):
                stored = self._db.executemany(
                    "INSERT INTO events (event_id, job_id, node, kind, source, agent_seq,"
                    " time_s, received_s, payload) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
                    " ON CONFLICT (event_id) DO NOTHING",
                    rows,
                ).rowcount
            usage = self._usage.get(job_id)
            if usage is not None and stored == len(rows):
                usage[0] += stored
                usage[1] += sum(len(row[-1].encode()) for row in rows)
            else:  # duplicates in the batch: counted again when next asked
                self._usage.pop(job_id, None)
        return [row[0] for row in rows]

    @locked
    def event_usage(self, job_id: str) -> tuple[int, int]:
        """(agent events stored for the job, the bytes of their payloads)."""
        usage = self._usage.get(job_id)
        if usage is None:
            count, size = self._db.execute(
                "SELECT count(*), coalesce(sum(length(CAST(payload AS BLOB))), 0) FROM events"
                " WHERE job_id = ? AND source = ?",
                (job_id, EventSource.AGENT.value),
            ).fetchone()
            usage = self._usage[job_id] = [int(count), int(size)]
        return usage[0], usage[1]

    @locked
    def prune_events(
        self, job_id: str, max_events: int, max_bytes: int, at_most: int
    ) -> tuple[int, int]:
        """Keep a job's agent events within a quota: past ``max_events`` or ``max_bytes``,
        delete its oldest down to :data:`PRUNED_TO` of both, ``at_most`` of them a call
        (the caller waits: a deletion costs about what storing the rows cost). Returns
        (events, bytes) deleted.

        Events a decision names stay (the decision's reference, and the replay cursor
        after a restart), and so does everything the supervisor recorded itself: a
        job that floods its own history loses only its own oldest reports.
        """
        count, size = self.event_usage(job_id)
        if count <= max_events and size <= max_bytes:
            return 0, 0
        keep_count, keep_size = int(max_events * PRUNED_TO), int(max_bytes * PRUNED_TO)
        named = "SELECT event_id FROM decisions WHERE job_id = ? AND event_id IS NOT NULL"
        oldest = self._db.execute(
            "SELECT seq, length(CAST(payload AS BLOB)) FROM events"
            f" WHERE job_id = ? AND source = ? AND event_id NOT IN ({named}) ORDER BY seq",
            (job_id, EventSource.AGENT.value, job_id),
        )
        last, dropped, freed = None, 0, 0
        for seq, length in oldest:
            if dropped >= at_most or (count - dropped <= keep_count and size - freed <= keep_size):
                break
            last, dropped, freed = seq, dropped + 1, freed + length
        oldest.close()
        if last is None:
            return 0, 0
        with self._tx(durable=False):
            deleted = self._db.execute(
                "DELETE FROM events WHERE job_id = ? AND source = ? AND seq <= ?"
                f" AND event_id NOT IN ({named})",
                (job_id, EventSource.AGENT.value, last, job_id),
            ).rowcount
        self._usage[job_id] = [count - deleted, size - freed]
        return deleted, freed

    @locked
    def record_observation(
        self,
        job_id: str,
        kind: Label,
        payload: dict[str, Any],
        now_s: float,
        *,
        node: str | None = None,
        observation_id: str | None = None,
    ) -> EventRow:
        """Store something the supervisor saw itself (Slurm state, lease expiry) as an event.

        The id is ``{job}/supervisor/{random hex}`` unless ``observation_id``
        is given; recording a given id again returns the first row.
        """
        event_id = observation_id or f"{job_id}/supervisor/{uuid.uuid4().hex}"
        with self._tx(durable=False), self._job_must_exist(job_id):
            self._db.execute(
                "INSERT INTO events (event_id, job_id, node, kind, source, agent_seq, time_s,"
                " received_s, payload) VALUES (?, ?, ?, ?, ?, NULL, ?, ?, ?)"
                " ON CONFLICT (event_id) DO NOTHING",
                (
                    event_id, job_id, node, label(kind), EventSource.SUPERVISOR.value,
                    now_s, now_s, dumps(payload, f"observation {event_id} payload"),
                ),
            )  # fmt: skip
        row = self._db.execute(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE event_id = ?", (event_id,)
        ).fetchone()
        return _event(row)

    @locked
    def events_for(
        self,
        job_id: str,
        since_seq: int | None = None,
        kinds: Iterable[Label] | None = None,
        *,
        limit: int | None = None,
    ) -> list[EventRow]:
        """The job's events with ``seq > since_seq`` (of ``kinds``), in arrival order."""
        where, params = in_clause("kind", kinds)
        where = f"{where} AND" if where else "WHERE"
        rows = self._db.execute(
            f"SELECT {_EVENT_COLUMNS} FROM events {where} job_id = ? AND seq > ?"
            f" ORDER BY seq LIMIT ?",
            (*params, job_id, since_seq or 0, -1 if limit is None else limit),
        )
        return [_event(row) for row in rows]

    @locked
    def latest_event(self, job_id: str, kind: Label) -> EventRow | None:
        """The job's last event of ``kind`` to arrive (None: none yet)."""
        row = self._db.execute(
            f"SELECT {_EVENT_COLUMNS} FROM events WHERE job_id = ? AND kind = ?"
            " ORDER BY seq DESC LIMIT 1",
            (job_id, label(kind)),
        ).fetchone()
        return None if row is None else _event(row)

    @locked
    def count_events(self, job_id: str, kind: Label) -> int:
        """How many events of ``kind`` the job has."""
        row = self._db.execute(
            "SELECT count(*) FROM events WHERE job_id = ? AND kind = ?", (job_id, label(kind))
        ).fetchone()
        return int(row[0])

    @locked
    def record_decision(
        self,
        job_id: str,
        event_ref: str | None,
        from_state: Label,
        to_state: Label,
        cause: Label,
        detail: dict[str, Any],
        now_s: float,
    ) -> DecisionRow:
        """Record what the core decided on event ``event_ref`` (None: a timer tick) and why."""
        with self._tx(durable=True), self._job_must_exist(job_id):
            cursor = self._db.execute(
                "INSERT INTO decisions (job_id, event_id, from_state, to_state, cause, detail,"
                " decided_s) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id, event_ref, label(from_state), label(to_state), label(cause),
                    dumps(detail, "decision detail"), now_s,
                ),
            )  # fmt: skip
        return DecisionRow(
            decision_id=rowid(cursor),
            job_id=job_id,
            event_id=event_ref,
            from_state=label(from_state),
            to_state=label(to_state),
            cause=label(cause),
            detail=loads(dumps(detail, "decision detail")),
            decided_s=now_s,
        )

    @locked
    def recoveries_opened(self, job_id: str, live: Collection[str]) -> list[tuple[float, str]]:
        """When each of the job's recoveries opened (a decision from a state in ``live`` to
        ``recovering``), with its cause: the first one named (not ``none``) from that
        decision on, ``unknown`` if none is. Read by SQL alone: a long job's thousands
        of other decisions (straggler alerts) are never decoded."""
        marks = ", ".join("?" * len(live))
        rows = self._db.execute(
            "SELECT o.decided_s, (SELECT d.cause FROM decisions d WHERE d.job_id = o.job_id"
            " AND d.decision_id >= o.decision_id AND d.cause NOT IN ('none', '')"
            " ORDER BY d.decision_id LIMIT 1) FROM decisions o WHERE o.job_id = ?"
            f" AND o.to_state = 'recovering' AND o.from_state IN ({marks})"
            " ORDER BY o.decision_id",
            (job_id, *sorted(live)),
        )
        return [(float(t), cause if cause is not None else "unknown") for t, cause in rows]

    @locked
    def decisions_for(self, job_id: str, after_s: float | None = None) -> list[DecisionRow]:
        """The job's decisions, oldest first; with ``after_s``, those from the first one
        decided after ``after_s`` on (every later one, whatever its time).

        A scrape reads what came since its last window, not a long job's whole
        history (a straggler alert is a decision: thousands an hour on a large job).
        """
        columns = (
            "SELECT decision_id, job_id, event_id, from_state, to_state, cause, detail,"
            " decided_s FROM decisions WHERE job_id = ?"
        )
        if after_s is None:
            rows = self._db.execute(f"{columns} ORDER BY decision_id", (job_id,))
        else:
            rows = self._db.execute(
                f"{columns} AND decision_id >= (SELECT min(decision_id) FROM decisions"
                " WHERE job_id = ? AND decided_s > ?) ORDER BY decision_id",
                (job_id, job_id, after_s),
            )
        return [_decision(row) for row in rows]


_JOB_COLUMNS = (
    "job_id, name, state, original_nodes, world_size, min_nodes, record, record_version,"
    " secret_path, created_s, updated_s, slurm_user"
)
_ATTEMPT_COLUMNS = "job_id, attempt, nodes, resumed_from, started_s, ended_s, end_cause"
_EVENT_COLUMNS = "seq, event_id, job_id, node, kind, source, agent_seq, time_s, received_s, payload"


def _job(row: tuple[Any, ...]) -> JobRow:
    return JobRow(
        job_id=row[0],
        name=row[1],
        state=row[2],
        original_nodes=row[3],
        world_size=row[4],
        min_nodes=row[5],
        record=loads(row[6]),
        record_version=row[7],
        secret_path=row[8],
        created_s=row[9],
        updated_s=row[10],
        slurm_user=row[11],
    )


def _attempt_row(row: tuple[Any, ...]) -> AttemptRow:
    return AttemptRow(row[0], row[1], tuple(loads(row[2])), *row[3:])


def _event(row: tuple[Any, ...]) -> EventRow:
    return EventRow(
        seq=row[0],
        event_id=row[1],
        job_id=row[2],
        node=row[3],
        kind=row[4],
        source=EventSource(row[5]),
        agent_seq=row[6],
        time_s=row[7],
        received_s=row[8],
        payload=loads(row[9]),
    )


def _decision(row: tuple[Any, ...]) -> DecisionRow:
    return DecisionRow(
        decision_id=row[0],
        job_id=row[1],
        event_id=row[2],
        from_state=row[3],
        to_state=row[4],
        cause=row[5],
        detail=loads(row[6]),
        decided_s=row[7],
    )
