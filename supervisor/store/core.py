"""The store's connection: opening and checking the file, transactions, backup, locking.

:class:`StoreCore` is the base of :class:`supervisor.store.Store`; the tables'
methods live in ``history.py``, ``steps.py`` and ``store.py`` and use only what
is here: ``_db`` inside ``_tx``, under ``_lock``.
"""

from __future__ import annotations

import contextlib
import logging
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
        self._depth = 0
        self._synchronous = ""
        self._known_jobs: set[str] = set()
        self._last_step: dict[str, int | None] = {}
        self._leases: dict[tuple[str, str], LeaseRow] = {}
        self._dirty_leases: set[tuple[str, str]] = set()
        for row in db.execute("SELECT job_id, node, incarnation, last_seen_s FROM leases"):
            self._leases[(row[0], row[1])] = LeaseRow(*row)

    @classmethod
    def open(
        cls: type[_S],
        path: str | Path,
        *,
        create: bool = True,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    ) -> _S:
        """Open (or create) the store at ``path``: check it, migrate it, switch to WAL.

        A damaged or non-SQLite file, a damaged write-ahead log, or an existing
        file without the store's tables raises :class:`StoreCorrupt`, and every
        file is left byte for byte as it was: the checks run on a read-only
        connection (or before anything writes). A newer schema raises
        ``StoreSchemaError``; an older one is backed up next to the file and
        migrated.
        """
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
        try:
            db = sqlite3.connect(
                f"{path.resolve().as_uri()}?mode={mode}",
                uri=True,
                isolation_level=None,
                check_same_thread=False,
                timeout=busy_timeout_s,
            )
        except sqlite3.Error as error:
            raise StoreError(f"cannot open store {path}: {error}") from error
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

    @locked
    def close(self) -> None:
        """Flush leases and close; the store is unusable afterwards (closing twice is fine)."""
        try:
            self.flush_leases()
        except sqlite3.ProgrammingError:
            return  # already closed
        self._db.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------
    # Transactions and backup.

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """Run the block's writes atomically and durably (BEGIN IMMEDIATE, fsynced COMMIT).

        An exception rolls every write of the block back and propagates.
        Nested blocks are savepoints: an exception caught inside the outer
        block undoes only the inner block's writes.
        """
        with self._lock, self._tx(durable=True):
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

        Leases are flushed first. ``dest`` is replaced atomically. Not allowed
        inside a transaction (the copy would miss its uncommitted writes).
        """
        dest = Path(dest)
        if self._depth:
            raise StoreError("backup() inside a transaction: call it after the block ends")
        if dest.resolve() == self.path.resolve():
            raise StoreError(f"backup destination {dest} is the store itself; pick another path")
        self.flush_leases()
        schema.copy_database(self._db, dest)

    # ------------------------------------------------------------------
    # Heartbeat leases: in memory, flushed in batches (see store.py's docstring).

    @locked
    def touch_lease(
        self, job_id: str, node: str, incarnation: str, now_s: float
    ) -> LeaseRow | None:
        """Renew the lease of ``job_id``'s agent on ``node``; return the previous one (or None).

        No SQL runs: the lease is written by the next :meth:`flush_leases`. A
        report older than the stored one is ignored. A different
        ``incarnation`` in the returned row means the agent restarted.
        """
        key = (job_id, node)
        previous = self._leases.get(key)
        if previous is not None and now_s < previous.last_seen_s:
            return previous
        if previous is None and not self._job_exists(job_id):
            raise UnknownJob(f"job {job_id} is not in the store; upsert_job() it first")
        self._leases[key] = LeaseRow(job_id, node, incarnation, now_s)
        self._dirty_leases.add(key)
        return previous

    @locked
    def expired_leases(
        self, now_s: float, lease_s: float, *, job_id: str | None = None
    ) -> list[LeaseRow]:
        """Leases not renewed for more than ``lease_s`` (of one job, or all), oldest first."""
        expired = [
            lease
            for lease in self._leases.values()
            if now_s - lease.last_seen_s > lease_s and (job_id is None or lease.job_id == job_id)
        ]
        return sorted(expired, key=lambda lease: (lease.last_seen_s, lease.job_id, lease.node))

    @locked
    def leases_for(self, job_id: str) -> list[LeaseRow]:
        """Every lease of the job, by node."""
        return sorted(
            (lease for lease in self._leases.values() if lease.job_id == job_id),
            key=lambda lease: lease.node,
        )

    @locked
    def drop_leases(self, job_id: str, nodes: Iterable[str] | None = None) -> None:
        """Forget the job's leases (on ``nodes``, or all): the job ended or left those nodes."""
        chosen = None if nodes is None else set(nodes)
        keys = [
            key for key in self._leases if key[0] == job_id and (chosen is None or key[1] in chosen)
        ]
        with self._tx(durable=False):
            self._db.executemany("DELETE FROM leases WHERE job_id = ? AND node = ?", keys)
        for key in keys:
            del self._leases[key]
            self._dirty_leases.discard(key)

    @locked
    def flush_leases(self) -> int:
        """Write the leases renewed since the last flush in one transaction; return how many."""
        if self._depth:
            raise StoreError("flush_leases() inside a transaction: call it after the block ends")
        if not self._dirty_leases:
            return 0
        rows = [self._leases[key] for key in sorted(self._dirty_leases)]
        with self._tx(durable=False):
            self._db.executemany(
                "INSERT INTO leases (job_id, node, incarnation, last_seen_s) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (job_id, node) DO UPDATE SET incarnation = excluded.incarnation,"
                " last_seen_s = excluded.last_seen_s",
                [(r.job_id, r.node, r.incarnation, r.last_seen_s) for r in rows],
            )
        self._dirty_leases.clear()
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
