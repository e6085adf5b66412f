"""The store's schema, its migrations, and the checks that run before a store is trusted.

``MIGRATIONS[i]`` turns schema version ``i`` into ``i + 1`` (``MIGRATIONS[0]``
creates version 1 in an empty file), so the current version is
``len(MIGRATIONS)``. Migrations only ever append; a released one is never
edited. Each runs in one transaction together with the version bump, so a
crash mid-migration leaves the old version intact.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Sequence
from pathlib import Path

from supervisor.errors import StoreCorrupt, StoreSchemaError

logger = logging.getLogger(__name__)

SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_BYTES = 100

_V1 = """
CREATE TABLE schema_version (version INTEGER NOT NULL);
INSERT INTO schema_version (version) VALUES (0);

CREATE TABLE jobs (
    job_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    original_nodes INTEGER NOT NULL CHECK (original_nodes >= 1),
    world_size INTEGER NOT NULL CHECK (world_size >= 0),
    min_nodes INTEGER NOT NULL CHECK (min_nodes >= 1),
    record TEXT NOT NULL,
    record_version INTEGER NOT NULL,
    secret_path TEXT,
    created_s REAL NOT NULL,
    updated_s REAL NOT NULL
);
CREATE INDEX jobs_by_state ON jobs (state);

CREATE TABLE attempts (
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    attempt INTEGER NOT NULL CHECK (attempt >= 0),
    nodes TEXT NOT NULL,
    resumed_from TEXT,
    started_s REAL NOT NULL,
    ended_s REAL,
    end_cause TEXT,
    PRIMARY KEY (job_id, attempt)
);

-- seq is the arrival order; AUTOINCREMENT so that a seq is never reused and a
-- consumer's "since_seq" cursor never skips an event.
CREATE TABLE events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    node TEXT,
    kind TEXT NOT NULL,
    source TEXT NOT NULL,
    agent_seq INTEGER,
    time_s REAL NOT NULL,
    received_s REAL NOT NULL,
    payload TEXT NOT NULL
);
CREATE INDEX events_by_job ON events (job_id, seq);

CREATE TABLE decisions (
    decision_id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    event_id TEXT REFERENCES events (event_id),
    from_state TEXT NOT NULL,
    to_state TEXT NOT NULL,
    cause TEXT NOT NULL,
    detail TEXT NOT NULL,
    decided_s REAL NOT NULL
);
CREATE INDEX decisions_by_job ON decisions (job_id, decision_id);

CREATE TABLE actions (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    action_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    kind TEXT NOT NULL,
    args TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('planned', 'started', 'done', 'failed')),
    starts INTEGER NOT NULL DEFAULT 0,
    planned_s REAL NOT NULL,
    started_s REAL,
    finished_s REAL,
    result TEXT,
    error TEXT,
    retryable INTEGER
);
CREATE INDEX actions_by_job ON actions (job_id, seq);
CREATE INDEX actions_unfinished ON actions (seq) WHERE state IN ('planned', 'started');

CREATE TABLE drains (
    drain_id INTEGER PRIMARY KEY AUTOINCREMENT,
    node TEXT NOT NULL,
    cause TEXT NOT NULL,
    job_id TEXT REFERENCES jobs (job_id),
    reason TEXT NOT NULL,
    drained_by TEXT NOT NULL,
    drained_s REAL NOT NULL,
    undrained_s REAL,
    undrained_by TEXT,
    action_id TEXT UNIQUE
);
CREATE INDEX drains_by_node ON drains (node, drained_s);
CREATE INDEX drains_by_time ON drains (drained_s);

CREATE TABLE commands (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    command_id TEXT NOT NULL UNIQUE,
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    node TEXT,
    kind TEXT NOT NULL,
    args TEXT NOT NULL,
    queued_s REAL NOT NULL
);
CREATE INDEX commands_by_job ON commands (job_id, seq);

CREATE TABLE command_acks (
    command_id TEXT NOT NULL REFERENCES commands (command_id),
    node TEXT NOT NULL,
    acked_s REAL NOT NULL,
    PRIMARY KEY (command_id, node)
) WITHOUT ROWID;

CREATE TABLE leases (
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    node TEXT NOT NULL,
    incarnation TEXT NOT NULL,
    last_seen_s REAL NOT NULL,
    PRIMARY KEY (job_id, node)
) WITHOUT ROWID;

CREATE TABLE checkpoints (
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    path TEXT NOT NULL,
    step INTEGER NOT NULL,
    committed_s REAL NOT NULL,
    PRIMARY KEY (job_id, path)
);

CREATE TABLE progress (
    id INTEGER PRIMARY KEY,
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    step INTEGER NOT NULL,
    time_s REAL NOT NULL
);
CREATE INDEX progress_by_job ON progress (job_id, id);
"""

# What training ranks reported per step (step_losses events), for resume
# verification. WITHOUT ROWID: rows live in primary-key order, so an attempt's
# steps are one range and its last step one index probe; by_step finds every
# attempt's report of one step. A NULL loss is "no finite loss", a NULL cursor
# "unknown".
_V2 = """
CREATE TABLE step_reports (
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    attempt INTEGER NOT NULL CHECK (attempt >= 0),
    step INTEGER NOT NULL CHECK (step >= 0),
    global_rank INTEGER NOT NULL CHECK (global_rank >= 0),
    loss REAL,
    cursor INTEGER CHECK (cursor >= 0),
    received_s REAL NOT NULL,
    PRIMARY KEY (job_id, attempt, step, global_rank)
) WITHOUT ROWID;
CREATE INDEX step_reports_by_step ON step_reports (job_id, step, attempt);
"""

# A drain's verdict withdrawn: the drain was lifted outside Resurgo (an admin's
# `scontrol ... state=resume`), or an operator said it was wrong (`resurgo
# nodes forgive`). The row stays in the audit; its blame no longer counts
# towards the lemon list. NULL in every row of an older store: nothing withdrawn.
_V3 = """
ALTER TABLE drains ADD COLUMN withdrawn_s REAL;
ALTER TABLE drains ADD COLUMN withdrawn_by TEXT;
"""

# Drain tickets: a supervisor without Slurm operator rights asks the admins
# to drain a node it blamed instead of draining it. A ticket is a blame (it
# counts towards the lemon list) and keeps the node out of the user's jobs
# while open; closed_by says who closed it (an operator's forgive). The
# hook's answer is kept for `resurgo nodes`. supervisor_facts: what the running
# supervisor found out about itself (its Slurm rights), for `resurgo status`.
_V4 = """
CREATE TABLE tickets (
    ticket_id INTEGER PRIMARY KEY AUTOINCREMENT,
    node TEXT NOT NULL,
    cause TEXT NOT NULL,
    job_id TEXT REFERENCES jobs (job_id),
    evidence TEXT NOT NULL,
    raised_s REAL NOT NULL,
    closed_s REAL,
    closed_by TEXT,
    hook TEXT NOT NULL DEFAULT '',
    action_id TEXT UNIQUE
);
CREATE INDEX tickets_by_node ON tickets (node, raised_s);
CREATE INDEX tickets_open ON tickets (raised_s) WHERE closed_s IS NULL;

CREATE TABLE supervisor_facts (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    updated_s REAL NOT NULL
);
"""

# Blames: every node a decision blamed, whatever was done about it (drained,
# ticketed, only excluded from the job: the hourly share was used, or the storm
# brake held), with the Slurm user whose job blamed it. The storm brake and the
# per-user view read these; drains and tickets stay the audit of what was done.
# jobs.slurm_user: the job's user as Slurm said at registration (never the
# job's own files); NULL for jobs registered before this version.
_V5 = """
ALTER TABLE jobs ADD COLUMN slurm_user TEXT;

CREATE TABLE blames (
    blame_id INTEGER PRIMARY KEY AUTOINCREMENT,
    node TEXT NOT NULL,
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    attempt INTEGER NOT NULL,
    slurm_user TEXT,
    cause TEXT NOT NULL,
    outcome TEXT NOT NULL,
    blamed_s REAL NOT NULL,
    UNIQUE (job_id, attempt, node)
);
CREATE INDEX blames_by_time ON blames (blamed_s);
CREATE INDEX blames_by_node ON blames (node, blamed_s);
"""

# Node checks: a node one job blamed is checked by a Slurm job of the
# supervisor's own before it is drained (supervisor.core.drains). A check
# is raised by a decision (action_id), submitted once the blaming job has left
# the node (slurm_job_id, submitted_s) and ends passed, failed or expired
# (result, detail: the check's output or why it has none).
_V6 = """
CREATE TABLE node_checks (
    check_id INTEGER PRIMARY KEY AUTOINCREMENT,
    node TEXT NOT NULL,
    job_id TEXT NOT NULL REFERENCES jobs (job_id),
    attempt INTEGER NOT NULL,
    cause TEXT NOT NULL,
    evidence TEXT NOT NULL,
    raised_s REAL NOT NULL,
    slurm_job_id INTEGER,
    submitted_s REAL,
    ended_s REAL,
    result TEXT,
    detail TEXT NOT NULL DEFAULT '',
    action_id TEXT UNIQUE
);
CREATE INDEX node_checks_open ON node_checks (raised_s) WHERE ended_s IS NULL;
CREATE INDEX node_checks_by_node ON node_checks (node, raised_s);
"""

# Timeline summaries: each job's goodput accounting as the metrics last read it
# (supervisor/views/timeline.py's JobTimeline.summary(), a JSON document naming
# its own format), up to upto_s, so that a restarted supervisor's first scrape
# reads only the history after it. Derived data: a job without one, or with one
# of another format, is read from its whole history once and gets a new one.
# progress_by_time: every read of a job's progress "since" a time is one range.
_V7 = """
CREATE TABLE timeline_summaries (
    job_id TEXT PRIMARY KEY REFERENCES jobs (job_id),
    upto_s REAL NOT NULL,
    summary TEXT NOT NULL,
    saved_s REAL NOT NULL
);

CREATE INDEX progress_by_time ON progress (job_id, time_s);
"""

# A job's events of one kind: its newest save statistics, its count of
# nondeterministic resumes and its alerts are read at every metrics scrape, and
# through events_by_job each read went over the job's whole history.
_V8 = """
CREATE INDEX events_by_kind ON events (job_id, kind, seq);
"""

MIGRATIONS: tuple[str, ...] = (_V1, _V2, _V3, _V4, _V5, _V6, _V7, _V8)
SCHEMA_VERSION = len(MIGRATIONS)
# Tables every version has: a file holding them is a Resurgo store, damaged if
# it lacks its schema_version.
_OWN_TABLES = frozenset({"jobs", "attempts", "events", "decisions", "actions", "drains"})

RESTORE_HINT = (
    "stop every resurgo-supervisor using it, move the file and its -wal and -shm files "
    "aside (keep them for inspection) and restore the newest backup (written by "
    "`resurgo store backup`) in its place: docs/operations.md, Backup and restore"
)


def check_header(path: Path) -> None:
    """Raise :class:`StoreCorrupt` unless ``path`` starts like an SQLite database.

    An empty or short file is refused too: it may be a store truncated by a
    disk problem, and treating it as new would silently drop every record.
    """
    with path.open("rb") as file:
        header = file.read(_HEADER_BYTES)
    if len(header) == 0:
        raise StoreCorrupt(
            f"store {path} is an empty file, not an SQLite database; if it is a store "
            f"that lost its contents, {RESTORE_HINT}; if no store existed yet, delete "
            "the empty file and start again"
        )
    if not header.startswith(SQLITE_MAGIC):
        raise StoreCorrupt(
            f"store {path} is not an SQLite database (it starts with {header[:16]!r}); "
            f"check the configured path, or {RESTORE_HINT}"
        )
    if len(header) < _HEADER_BYTES:
        raise StoreCorrupt(
            f"store {path} is truncated ({len(header)} bytes, shorter than an SQLite "
            f"header); {RESTORE_HINT}"
        )


def check_integrity(db: sqlite3.Connection, path: Path) -> None:
    """Run ``PRAGMA quick_check`` and raise :class:`StoreCorrupt` naming what it found.

    It reads every page (O(size), but only at start-up) and writes nothing, so
    a damaged file is left exactly as it was for inspection.
    """
    try:
        problems = [row[0] for row in db.execute("PRAGMA quick_check(20)")]
    except sqlite3.OperationalError:
        raise  # busy or locked, not damage: the caller reports it as such
    except sqlite3.DatabaseError as error:
        raise StoreCorrupt(f"store {path} is damaged ({error}); {RESTORE_HINT}") from error
    if problems != ["ok"]:
        shown = "; ".join(str(problem) for problem in problems[:5])
        raise StoreCorrupt(
            f"store {path} failed its integrity check ({len(problems)} problems, first: "
            f"{shown}); {RESTORE_HINT}"
        )


def stored_version(db: sqlite3.Connection, path: Path) -> int | None:
    """The schema version in ``db``; None for a file without tables (a new store)."""
    # str(): a damaged schema table may hold names of other types.
    tables = {
        str(row[0]) for row in db.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")
    }
    if not tables:
        return None
    if "schema_version" not in tables and tables & _OWN_TABLES:
        raise StoreCorrupt(
            f"store {path} holds Resurgo's tables ({', '.join(sorted(tables & _OWN_TABLES))}) "
            f"but no schema_version table: it is damaged; {RESTORE_HINT}"
        )
    if "schema_version" not in tables:
        raise StoreSchemaError(
            f"{path} is an SQLite database but not a Resurgo store (tables: "
            f"{', '.join(sorted(tables)[:10])}); point the supervisor at its own store file"
        )
    rows = db.execute("SELECT version FROM schema_version").fetchall()
    if len(rows) != 1 or not isinstance(rows[0][0], int):
        raise StoreCorrupt(
            f"store {path}: schema_version holds {rows[:3]!r}, expected one integer; {RESTORE_HINT}"
        )
    version: int = rows[0][0]
    return version


def migrate(db: sqlite3.Connection, path: Path, migrations: Sequence[str] = MIGRATIONS) -> int:
    """Bring ``db`` to ``len(migrations)``, backing an existing store up first; return it.

    A store newer than ``migrations`` raises :class:`StoreSchemaError`: this
    Resurgo cannot know what the newer tables mean, and must not write to them.
    """
    latest = len(migrations)
    version = stored_version(db, path)
    if version is not None and version > latest:
        raise StoreSchemaError(
            f"store {path} has schema version {version}, newer than this Resurgo's "
            f"{latest}: run the Resurgo version that wrote it, or restore a backup made "
            "by this version"
        )
    if version == latest:
        return latest
    if version is not None:
        backup = path.with_name(f"{path.name}.schema-v{version}.bak")
        copy_database(db, backup, path.stat().st_mode & 0o777)
        logger.info(
            "store %s: migrating schema %d -> %d (backup at %s)", path, version, latest, backup
        )
    for step in range(version or 0, latest):
        # executescript would COMMIT a pending transaction first, so the BEGIN
        # lives inside the script; the version bump commits with the DDL.
        script = (
            f"BEGIN IMMEDIATE;\n{migrations[step]}\n"
            f"UPDATE schema_version SET version = {step + 1};\nCOMMIT;"
        )
        try:
            db.executescript(script)
        except sqlite3.Error:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
    return latest


def copy_database(db: sqlite3.Connection, dest: Path, mode: int) -> None:
    """Write a consistent copy of ``db`` to ``dest`` (online backup API), atomically.

    The copy goes to a temporary file that is fsynced and renamed over
    ``dest``, so ``dest`` is always either the old file or a complete copy.
    It gets permission bits ``mode`` (pass the store's own: a copy of a 0600
    store holds the same jobs and secrets, and stays as private).
    """
    tmp = dest.with_name(f"{dest.name}.tmp")
    tmp.unlink(missing_ok=True)
    # Made empty with its mode before SQLite writes a byte into it, so no one the
    # store shuts out can open the copy meanwhile; then fchmod, since the umask
    # may have narrowed os.open's mode.
    handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(handle, mode)
    finally:
        os.close(handle)
    try:
        target = sqlite3.connect(tmp)
        try:
            db.backup(target)
        finally:
            target.close()
        with tmp.open("rb") as file:
            os.fsync(file.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    directory = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
