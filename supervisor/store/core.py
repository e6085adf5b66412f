"""The store's connection: opening and checking the file, transactions, backup, locking.

:class:`StoreCore` is the base of :class:`supervisor.store.Store`; the tables'
methods live in ``history.py``, ``steps.py`` and ``store.py`` and use only what
is here: ``_db`` inside ``_tx``, under ``_lock``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Concatenate, ParamSpec, TypeVar

from supervisor.errors import StoreCorrupt, StoreError, StoreMissing, UnknownJob
from supervisor.store import schema, wal
from supervisor.store.rows import Label, LeaseRow, label

logger = logging.getLogger(__name__)

DEFAULT_BUSY_TIMEOUT_S = 10.0
# With checkpoints left to a worker thread, the log checkpoints inline only past
# this many pages (about 40 MB at SQLite's 4 KiB pages): bounded if they stop.
BACKGROUND_FALLBACK_PAGES = 10_000

_P = ParamSpec("_P")
_R = TypeVar("_R")
_S = TypeVar("_S", bound="StoreCore")


def locked(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Run ``method`` under the store's re-entrant lock."""

    def wrapper(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__qualname__ = method.__qualname__
    wrapper.__doc__ = method.__doc__
    return wrapper


class StoreCore:
    """The connection and its rules; see :class:`supervisor.store.Store` for the tables."""

    def __init__(self, db: sqlite3.Connection, path: Path) -> None:
        """Wrap an open, checked and migrated connection; use :meth:`open` instead."""
        self.path = path
        self._db = db
        self._lock = threading.RLock()
        # WAL checkpoints run on their own connection (see checkpoint_in_background).
        self._checkpointer: sqlite3.Connection | None = None
        self._checkpoint_lock = threading.Lock()
        self._depth = 0
        self._synchronous = ""
        self._known_jobs: set[str] = set()
        self._last_step: dict[str, int | None] = {}
        # job -> node -> lease; leases new or of a new incarnation since the last flush
        self._leases: dict[str, dict[str, LeaseRow]] = {}
        self._unwritten_leases: set[tuple[str, str]] = set()
        # Set by open(read_only=True): nothing is written, closing included.
        self.read_only = False
        for row in db.execute("SELECT job_id, node, incarnation, last_seen_s FROM leases"):
            self._leases.setdefault(row[0], {})[row[1]] = LeaseRow(*row)

    @classmethod
    def open(
        cls: type[_S],
        path: str | Path,
        *,
        create: bool = True,
        read_only: bool = False,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    ) -> _S:
        """Open (or create) the store at ``path``: check it, migrate it, switch to WAL.

        A damaged or non-SQLite file, a damaged write-ahead log, or an existing
        file without the store's tables raises :class:`StoreCorrupt`, and every
        file is left byte for byte as it was: the checks run on a read-only
        connection (or before anything writes). A newer schema raises
        ``StoreSchemaError``; an older one is backed up next to the file and
        migrated.

        ``read_only`` is for readers that may not write the store (the CLI's
        views, an operator in ``state_group``): the file must exist and have
        this version's schema, nothing is migrated, and :meth:`close` writes
        nothing (the leases stay as the supervisor flushed them).
        """
        if read_only:
            return cls._open_read_only(Path(path), busy_timeout_s)
        path = Path(path)
        log = wal.wal_path(path)
        existed = path.exists()
        if existed:
            schema.check_header(path)
            wal.check_wal(path, schema.RESTORE_HINT)
            mode = "rw"
        elif log.exists() and log.stat().st_size > 0:
            raise StoreCorrupt(
                f"store {path} does not exist but its write-ahead log {log} does: the "
                "database file was moved or deleted, and a new store would lose what the "
                f"log holds; put the file back, or {schema.RESTORE_HINT}"
            )
        elif create:
            mode = "rwc"
        else:
            raise StoreMissing(f"store {path} does not exist; check the configured path")
        checked = existed and _in_wal_mode(path)
        if checked:
            with _refusing_damage(path):
                _check_read_only(path, busy_timeout_s)
        db = _connect(path, f"mode={mode}", busy_timeout_s, "open")
        try:
            with _refusing_damage(path):
                if existed and not checked:
                    # A rollback-journal file (a store from before WAL, or a copy):
                    # checked before anything writes, since switching to WAL
                    # rewrites the header; closing it writes nothing.
                    _check_existing(db, path)
                db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
                mode_set = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
                if mode_set != "wal":
                    raise StoreError(
                        f"store {path}: SQLite refused WAL mode (got {mode_set!r}); put the "
                        "store on a local filesystem (WAL needs shared memory, not NFS)"
                    )
                db.execute("PRAGMA foreign_keys = ON")
                schema.migrate(db, path)
        except BaseException:
            db.close()
            raise
        return cls(db, path)

    @classmethod
    def _open_read_only(cls: type[_S], path: Path, busy_timeout_s: float) -> _S:
        if not path.exists():
            raise StoreMissing(f"store {path} does not exist; check the configured path")
        schema.check_header(path)
        wal.check_wal(path, schema.RESTORE_HINT)
        options = "mode=ro"
        if not wal.wal_path(path).exists() and not os.access(path.parent, os.W_OK):
            # No log (the supervisor closed the store cleanly) and no right to
            # create the shared-memory file SQLite wants before reading a WAL
            # database: read the file as it stands. Should the supervisor start
            # and write meanwhile, this one command may see a torn read.
            options += "&immutable=1"
        db = _connect(path, options, busy_timeout_s, "open to read")
        try:
            with _refusing_damage(path):
                db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
                _check_existing(db, path)
                version = schema.stored_version(db, path)
                if version != schema.SCHEMA_VERSION:
                    raise StoreError(
                        f"store {path} has schema version {version}, this Resurgo reads "
                        f"{schema.SCHEMA_VERSION}: run the Resurgo version the supervisor "
                        "runs (the supervisor migrates the store when it starts)"
                    )
            store = cls(db, path)
        except BaseException:
            db.close()
            raise
        store.read_only = True
        return store

    @locked
    def close(self) -> None:
        """Write every lease out and close; the store is unusable afterwards (twice is fine).

        A store opened read-only only closes."""
        with self._checkpoint_lock:
            if self._checkpointer is not None:
                self._checkpointer.close()
                self._checkpointer = None
        if self.read_only:
            self._db.close()
            return
        try:
            self.flush_leases(renewals=True)
        except sqlite3.ProgrammingError:
            return  # already closed
        self._db.close()

    @locked
    def checkpoint_in_background(self, fallback_pages: int = BACKGROUND_FALLBACK_PAGES) -> None:
        """Leave WAL checkpoints to :meth:`checkpoint_wal`, called from a worker thread.

        SQLite otherwise copies the log into the database, and fsyncs it, in the
        commit that takes the log past 1,000 pages: on a busy supervisor that
        commit runs on the event loop and held it for tens of milliseconds.
        Should the caller stop checkpointing, the commit that takes the log
        past ``fallback_pages`` checkpoints as before, so the log stays bounded.
        """
        self._db.execute(f"PRAGMA wal_autocheckpoint = {int(fallback_pages)}")

    def checkpoint_wal(self) -> tuple[int, int]:
        """Copy what the write-ahead log holds into the database (a passive checkpoint).

        Runs on a connection of its own and never takes the store's lock, so a
        worker thread can run it while the store is in use (it waits for no
        reader or writer: what it cannot copy yet, the next one does). Returns
        the log's pages and how many of them are now in the database.
        """
        with self._checkpoint_lock:
            if self._checkpointer is None:
                self._checkpointer = sqlite3.connect(
                    f"{self.path.resolve().as_uri()}?mode=rw",
                    uri=True,
                    isolation_level=None,
                    check_same_thread=False,
                )
            # fetchall() finishes the statement: one left open would hold a read
            # snapshot, and the log could then never start over from its beginning.
            ((busy, pages, copied),) = self._checkpointer.execute(
                "PRAGMA wal_checkpoint(PASSIVE)"
            ).fetchall()
            return (pages, copied) if not busy else (pages, 0)

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    # Transactions and backup.

    @contextlib.contextmanager
    def transaction(self, *, durable: bool = True) -> Iterator[None]:
        """Run the block's writes atomically and durably (BEGIN IMMEDIATE, fsynced COMMIT).

        An exception rolls every write of the block back and propagates.
        Nested blocks are savepoints: an exception caught inside the outer
        block undoes only the inner block's writes. ``durable=False`` commits
        without the fsync, as the high-volume writes do (see store.py): for
        writes that drive no side effect and that a power loss may take back.
        """
        with self._lock, self._tx(durable=durable):
            yield

    @contextlib.contextmanager
    def _tx(self, *, durable: bool) -> Iterator[None]:
        if self._depth > 0:
            name = f"sp{self._depth}"
            self._db.execute(f"SAVEPOINT {name}")
            self._depth += 1
            try:
                yield
            except BaseException:
                self._db.execute(f"ROLLBACK TO {name}")
                self._db.execute(f"RELEASE {name}")
                self._forget_caches()
                raise
            else:
                self._db.execute(f"RELEASE {name}")
            finally:
                self._depth -= 1
            return
        # synchronous cannot change inside a transaction, so the outermost
        # block picks it; nested writes inherit the outer block's durability.
        synchronous = "FULL" if durable else "NORMAL"
        if synchronous != self._synchronous:
            self._db.execute(f"PRAGMA synchronous = {synchronous}")
            self._synchronous = synchronous
        self._db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            self._forget_caches()
            raise
        finally:
            self._depth = 0

    def _forget_caches(self) -> None:
        # A rolled-back write may have filled a cache with something that is
        # no longer in the database; they refill from SQL on the next use.
        self._known_jobs.clear()
        self._last_step.clear()

    @locked
    def backup(self, dest: str | Path) -> None:
        """Write a consistent, openable copy of the store to ``dest`` (online backup API).

        Leases are flushed first. ``dest`` is replaced atomically and gets the
        store file's permission bits. Not allowed inside a transaction (the copy
        would miss its uncommitted writes).
        """
        dest = Path(dest)
        if self._depth:
            raise StoreError("backup() inside a transaction: call it after the block ends")
        if dest.resolve() == self.path.resolve():
            raise StoreError(f"backup destination {dest} is the store itself; pick another path")
        if not self.read_only:
            self.flush_leases(renewals=True)
        schema.copy_database(self._db, dest, self.path.stat().st_mode & 0o777)

    # ------------------------------------------------------------------
    # Heartbeat leases: in memory, written out in batches (see store.py's docstring).

    @locked
    def touch_leases(self, job_id: str, agents: Iterable[tuple[str, str]], now_s: float) -> None:
        """:meth:`touch_lease` for each ``(node, incarnation)`` of ``agents``, under one lock
        (a job's heartbeats from its aggregator: thousands of nodes a request)."""
        for node, incarnation in agents:
            self._touch_lease(job_id, node, incarnation, now_s)

    @locked
    def touch_lease(
        self, job_id: str, node: str, incarnation: str, now_s: float
    ) -> LeaseRow | None:
        """Renew the lease of ``job_id``'s agent on ``node``; return the previous one (or None).

        No SQL runs: a new lease (or a new incarnation) is written by the next
        :meth:`flush_leases`, a renewal only by a flush with ``renewals``. A
        report older than the stored one is ignored. A different
        ``incarnation`` in the returned row means the agent restarted.
        """
        return self._touch_lease(job_id, node, incarnation, now_s)

    def _touch_lease(
        self, job_id: str, node: str, incarnation: str, now_s: float
    ) -> LeaseRow | None:
        nodes = self._leases.get(job_id)
        previous = None if nodes is None else nodes.get(node)
        if previous is not None and now_s < previous.last_seen_s:
            return previous
        if nodes is None:
            if not self._job_exists(job_id):
                raise UnknownJob(f"job {job_id} is not in the store; upsert_job() it first")
            nodes = self._leases[job_id] = {}
        nodes[node] = LeaseRow(job_id, node, incarnation, now_s)
        if previous is None or previous.incarnation != incarnation:
            self._unwritten_leases.add((job_id, node))
        return previous

    @locked
    def expired_leases(
        self, now_s: float, lease_s: float, *, job_id: str | None = None
    ) -> list[LeaseRow]:
        """Leases not renewed for more than ``lease_s`` (of one job, or all), oldest first."""
        jobs = self._leases.values() if job_id is None else [self._leases.get(job_id, {})]
        expired = [
            lease
            for nodes in jobs
            for lease in nodes.values()
            if now_s - lease.last_seen_s > lease_s
        ]
        return sorted(expired, key=lambda lease: (lease.last_seen_s, lease.job_id, lease.node))

    @locked
    def leases_for(self, job_id: str) -> list[LeaseRow]:
        """Every lease of the job, by node."""
        nodes = self._leases.get(job_id, {})
        return [nodes[node] for node in sorted(nodes)]

    @locked
    def lease_count(self, job_ids: Iterable[str], since_s: float) -> int:
        """How many leases of ``job_ids`` were renewed at ``since_s`` or later."""
        return sum(
            1
            for job_id in job_ids
            for lease in self._leases.get(job_id, {}).values()
            if lease.last_seen_s >= since_s
        )

    @locked
    def drop_leases(self, job_id: str, nodes: Iterable[str] | None = None) -> None:
        """Forget the job's leases (on ``nodes``, or all): the job ended or left those nodes."""
        held = self._leases.get(job_id, {})
        chosen = list(held) if nodes is None else [node for node in set(nodes) if node in held]
        if not chosen:
            return
        with self._tx(durable=False):
            self._db.executemany(
                "DELETE FROM leases WHERE job_id = ? AND node = ?",
                [(job_id, node) for node in chosen],
            )
        for node in chosen:
            del held[node]
            self._unwritten_leases.discard((job_id, node))
        if not held:
            del self._leases[job_id]

    @locked
    def flush_leases(self, *, renewals: bool = False) -> int:
        """Write the leases that are new (or of a new incarnation) since the last flush, and
        with ``renewals`` every lease's last renewal, in one transaction; return how many.

        Only which agent incarnation holds each lease must survive a crash:
        leases count from the daemon's start after a restart, so a renewal
        time is needed in memory alone. Renewals are written at a clean close.
        """
        if self._depth:
            raise StoreError("flush_leases() inside a transaction: call it after the block ends")
        if renewals:
            rows = [lease for nodes in self._leases.values() for lease in nodes.values()]
        else:
            rows = [self._leases[job][node] for job, node in self._unwritten_leases]
        if not rows:
            return 0
        rows.sort(key=lambda lease: (lease.job_id, lease.node))
        with self._tx(durable=False):
            self._db.executemany(
                "INSERT INTO leases (job_id, node, incarnation, last_seen_s) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, node) DO UPDATE SET incarnation = excluded.incarnation,"
                " last_seen_s = excluded.last_seen_s",
                [(r.job_id, r.node, r.incarnation, r.last_seen_s) for r in rows],
            )
        self._unwritten_leases.clear()
        return len(rows)

    # ------------------------------------------------------------------
    # Internals shared with the other tables (history.py and store.py use these).

    @contextlib.contextmanager
    def _job_must_exist(self, job_id: str) -> Iterator[None]:
        """Turn a foreign-key failure on ``job_id`` into :class:`UnknownJob`."""
        try:
            yield
        except sqlite3.IntegrityError as error:
            if "FOREIGN KEY" in str(error) and not self._job_exists(job_id):
                raise UnknownJob(
                    f"job {job_id} is not in the store; upsert_job() it before recording "
                    "anything about it"
                ) from error
            raise

    def _job_exists(self, job_id: str) -> bool:
        if job_id in self._known_jobs:
            return True
        found = self._db.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        if found is not None:
            self._known_jobs.add(job_id)
        return found is not None


def _in_wal_mode(path: Path) -> bool:
    """Whether the database header says WAL (read and write versions 2)."""
    with path.open("rb") as file:
        file.seek(18)
        return file.read(2) == b"\x02\x02"


@contextlib.contextmanager
def _refusing_damage(path: Path) -> Iterator[None]:
    """SQLite's errors while checking or preparing the store, as the store's errors."""
    try:
        yield
    except sqlite3.OperationalError as error:
        # Busy, locked, read-only, out of disk: the file may be fine.
        raise StoreError(f"cannot use store {path}: {error}") from error
    except sqlite3.DatabaseError as error:
        raise StoreCorrupt(f"store {path} is damaged ({error}); {schema.RESTORE_HINT}") from error


def _check_read_only(path: Path, busy_timeout_s: float) -> None:
    """:func:`_check_existing` on a read-only connection: a refusal writes nothing.

    A read-write connection would checkpoint the log into the file when it
    closes, changing the damaged file the operator is told to keep.
    """
    db = sqlite3.connect(
        f"{path.resolve().as_uri()}?mode=ro",
        uri=True,
        isolation_level=None,
        timeout=busy_timeout_s,
    )
    try:
        _check_existing(db, path)
    finally:
        db.close()


def _check_existing(db: sqlite3.Connection, path: Path) -> None:
    """Refuse an existing file that is damaged or holds no store (it would be created anew)."""
    schema.check_integrity(db, path)
    if schema.stored_version(db, path) is None:
        raise StoreCorrupt(
            f"store {path} is an SQLite database without any tables: a store that lost "
            f"its contents (a damaged write-ahead log, a file copied without it), or one "
            f"whose first start was interrupted; if it held data, {schema.RESTORE_HINT}; "
            "if no store existed yet, delete the file and start again"
        )


def rowid(cursor: sqlite3.Cursor) -> int:
    rowid = cursor.lastrowid
    assert rowid is not None
    return rowid


def in_clause(column: str, values: Iterable[Label] | None) -> tuple[str, tuple[str, ...]]:
    """``WHERE column IN (?, ...)`` and its parameters; no clause when ``values`` is None."""
    if values is None:
        return "", ()
    texts = tuple(label(value) for value in values)
    if not texts:
        return "WHERE 0", ()
    return f"WHERE {column} IN ({', '.join('?' * len(texts))})", texts


def _connect(path: Path, options: str, busy_timeout_s: float, what: str) -> sqlite3.Connection:
    """A connection to the store's URI with ``options``; StoreError saying what failed."""
    try:
        return sqlite3.connect(
            f"{path.resolve().as_uri()}?{options}",
            uri=True,
            isolation_level=None,
            check_same_thread=False,
            timeout=busy_timeout_s,
        )
    except sqlite3.Error as error:
        raise StoreError(f"cannot {what} store {path}: {error}") from error
