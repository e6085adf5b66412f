"""A damaged store at start-up: a clear refusal that leaves every file as it was, never silent loss.

Real store files are damaged the ways disks and people damage them: bytes
overwritten, zeroed or flipped anywhere in the database file, the file cut
short, the write-ahead log (where the newest transactions live until a
checkpoint) damaged or cut, the database file gone while its log stays.
``Store.open`` either refuses with :class:`StoreCorrupt` naming the file and
the backup to restore, leaving every byte as it was, or opens a store that
lost nothing a crash could not have lost. ``resurgo-supervisor`` itself
refuses to start on such a store and exits non-zero.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.wire.protocol import Event, EventKind, make_event
from supervisor.errors import StoreCorrupt, StoreError
from supervisor.store import Store
from supervisor.store.wal import wal_path
from tests.paths import REPO

JOB = "4711"
NOW = 1_760_000_000.0
INCARNATION = "0123abcd"
BATCHES = 20
PER_BATCH = 50
FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def event(seq: int) -> Event:
    return make_event(
        EventKind.AGENT_STOPPED, JOB, "node1", INCARNATION, seq, NOW, {"reason": f"r{seq}"}
    )


def fill(store: Store) -> None:
    """One job, then BATCHES transactions of PER_BATCH events each."""
    store.upsert_job(
        JOB, state="running", record={}, now_s=NOW, name="t", original_nodes=4, min_nodes=1
    )
    for batch in range(BATCHES):
        first = batch * PER_BATCH + 1
        events = [event(seq) for seq in range(first, first + PER_BATCH)]
        store.record_events(JOB, events, now_s=NOW)


def snapshot(directory: Path) -> dict[str, str]:
    """Every file's name and digest, except SQLite's shared-memory index (scratch space)."""
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.iterdir())
        if not path.name.endswith("-shm")
    }


EMPTY = hashlib.sha256(b"").hexdigest()


def assert_untouched(directory: Path, before: dict[str, str]) -> None:
    """Every file is as it was; at most an empty log appeared (SQLite's reader makes one)."""
    after = snapshot(directory)
    assert {name: after.get(name) for name in before} == before, "a file was changed or removed"
    assert all(after[name] == EMPTY for name in after.keys() - before.keys())


def stored_seqs(path: Path) -> list[int]:
    with Store.open(path, create=False) as store:
        return sorted(row.agent_seq or 0 for row in store.events_for(JOB))


@pytest.fixture(scope="module")
def closed_store(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A store as a cleanly stopped supervisor leaves it: one file, everything in it."""
    path = tmp_path_factory.mktemp("closed") / "resurgo.db"
    with Store.open(path) as store:
        fill(store)
    assert not wal_path(path).exists()
    return path.read_bytes()


@pytest.fixture(scope="module")
def crashed_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """A store as a killed supervisor leaves it: every transaction still in the log.

    The files are copied while the store is open (as a SIGKILL leaves them);
    20 small transactions stay under SQLite's automatic checkpoint.
    """
    path = tmp_path_factory.mktemp("crashed") / "resurgo.db"
    store = Store.open(path)
    try:
        fill(store)
        database, log = path.read_bytes(), wal_path(path).read_bytes()
    finally:
        store.close()
    assert len(log) > 100 * 4096, "the transactions must be in the log, not the file"
    return database, log


@contextlib.contextmanager
def placed(database: bytes, log: bytes | None = None) -> Iterator[Path]:
    """A database (and its log) written into a fresh directory, removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="store-"))
    try:
        path = directory / "resurgo.db"
        path.write_bytes(database)
        if log is not None:
            wal_path(path).write_bytes(log)
        yield path
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def assert_refused_untouched(path: Path, before: dict[str, str]) -> StoreCorrupt:
    with pytest.raises(StoreError) as raised:
        Store.open(path)
    error = raised.value
    assert isinstance(error, StoreCorrupt), error
    message = str(error)
    assert str(path) in message
    assert "backup" in message or "delete the file" in message
    assert_untouched(path.parent, before)
    return error


# -- damage strategies --------------------------------------------------------------


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with one to three of: a range overwritten, zeroed, a byte flipped, a cut."""
    damaged = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        if not damaged:
            break
        at = draw(st.integers(0, len(damaged) - 1))
        kind = draw(st.sampled_from(["overwrite", "zero", "flip", "cut"]))
        if kind == "overwrite":
            garbage = draw(st.binary(min_size=1, max_size=8192))
            damaged[at : at + len(garbage)] = garbage
        elif kind == "zero":
            length = draw(st.integers(1, 8192))
            damaged[at : at + length] = bytes(len(damaged[at : at + length]))
        elif kind == "flip":
            damaged[at] ^= draw(st.integers(1, 255))
        else:
            del damaged[at:]
    return bytes(damaged)


# -- the database file -----------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_a_damaged_store_file_is_refused_untouched_or_opens(
    closed_store: bytes, data: st.DataObject
) -> None:
    with placed(data.draw(damaged(closed_store))) as path:
        before = snapshot(path.parent)
        try:
            store = Store.open(path)
        except StoreError:
            assert_refused_untouched(path, before)
        else:
            # SQLite pages carry no checksums: a flip inside a stored value reads
            # back as another value (docs/security.md). Structure damage is refused.
            store.close()


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("header zeroed", lambda data: bytes(100) + data[100:]),
        ("page size field", lambda data: data[:16] + b"\x00\x03" + data[18:]),
        ("cut in half", lambda data: data[: len(data) // 2]),
        ("cut inside the header", lambda data: data[:60]),
        ("page count too small", lambda data: data[:28] + b"\x00\x00\x00\x01" + data[32:]),
        ("second page garbage", lambda data: data[:4096] + bytes(range(256)) * 16 + data[8192:]),
        ("random garbage file", lambda data: random.Random(7).randbytes(len(data))),
        ("empty file", lambda data: b""),
    ],
)
def test_structural_damage_to_the_store_file_is_always_refused(
    closed_store: bytes, name: str, damage: Callable[[bytes], bytes]
) -> None:
    with placed(damage(closed_store)) as path:
        assert_refused_untouched(path, snapshot(path.parent))


def test_an_existing_sqlite_file_without_tables_is_refused_not_made_a_new_store() -> None:
    # What is left when the log holding every table was lost: a header page only.
    with placed(b"") as path:
        path.unlink()
        db = sqlite3.connect(path)
        db.execute("PRAGMA journal_mode = WAL")
        db.close()
        error = assert_refused_untouched(path, snapshot(path.parent))
        assert "without any tables" in str(error)


# -- the write-ahead log ------------------------------------------------------------------


@FUZZ
@given(data=st.data())
def test_a_damaged_log_is_refused_untouched_or_loses_at_most_the_last_transaction(
    crashed_store: tuple[bytes, bytes], data: st.DataObject
) -> None:
    database, log = crashed_store
    damaged_log = bytearray(log)
    at = data.draw(st.integers(0, len(log) - 1), label="offset")
    if data.draw(st.booleans(), label="range"):
        garbage = data.draw(st.binary(min_size=1, max_size=4096), label="garbage")
        damaged_log[at : at + len(garbage)] = garbage
    else:
        damaged_log[at] ^= data.draw(st.integers(1, 255), label="flip")
    with placed(database, bytes(damaged_log)) as path:
        before = snapshot(path.parent)
        try:
            seqs = stored_seqs(path)
        except StoreError:
            assert bytes(damaged_log) != log
            assert_refused_untouched(path, before)
            return
    # Opened: what SQLite dropped can only be the tail a crash leaves (the
    # last transaction, when the damage sits in it), never a hole.
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) >= (BATCHES - 1) * PER_BATCH


@settings(FUZZ, max_examples=50)
@given(fraction=st.floats(0.0, 1.0))
def test_a_log_cut_short_keeps_a_prefix_of_the_transactions_or_is_refused(
    crashed_store: tuple[bytes, bytes], fraction: float
) -> None:
    # A cut tail is what a power loss leaves of unsynced commits: SQLite keeps
    # the transactions before it. If the cut took the store's first
    # transaction (its tables), the store is refused rather than made anew.
    database, log = crashed_store
    with placed(database, log[: int(len(log) * fraction)]) as path:
        before = snapshot(path.parent)
        try:
            seqs = stored_seqs(path)
        except StoreError:
            error = assert_refused_untouched(path, before)
            assert "without any tables" in str(error)
            return
    assert seqs == list(range(1, len(seqs) + 1))
    assert len(seqs) % PER_BATCH == 0


def test_a_log_with_a_damaged_header_is_refused_instead_of_dropped_whole(
    crashed_store: tuple[bytes, bytes],
) -> None:
    database, log = crashed_store
    with placed(database, b"\x00" * 32 + log[32:]) as path:
        error = assert_refused_untouched(path, snapshot(path.parent))
    assert "write-ahead log" in str(error) and "every transaction" in str(error)


def test_a_damaged_frame_hiding_later_commits_is_refused_naming_what_would_be_lost(
    crashed_store: tuple[bytes, bytes],
) -> None:
    database, log = crashed_store
    with placed(database, damage_frame_41(log)) as path:
        error = assert_refused_untouched(path, snapshot(path.parent))
    assert "frame 41" in str(error) and "committed transactions" in str(error)


def test_an_undamaged_crashed_store_opens_with_every_transaction(
    crashed_store: tuple[bytes, bytes],
) -> None:
    with placed(*crashed_store) as path:
        assert stored_seqs(path) == list(range(1, BATCHES * PER_BATCH + 1))


def test_a_log_without_its_database_file_is_refused(crashed_store: tuple[bytes, bytes]) -> None:
    with placed(*crashed_store) as path:
        path.unlink()
        before = snapshot(path.parent)
        with pytest.raises(StoreCorrupt, match="does not exist but its write-ahead log"):
            Store.open(path)
        assert_untouched(path.parent, before)


def test_the_backup_the_refusal_names_restores_the_store(
    closed_store: bytes, tmp_path: Path
) -> None:
    backup = tmp_path / "backup.db"
    with placed(closed_store) as path:
        with Store.open(path) as store:
            store.backup(backup)
        path.write_bytes(bytes(100) + path.read_bytes()[100:])
        assert_refused_untouched(path, snapshot(path.parent))
        shutil.copyfile(backup, path)
        assert stored_seqs(path) == list(range(1, BATCHES * PER_BATCH + 1))


def damage_frame_41(log: bytes) -> bytes:
    """``log`` with one bit flipped in frame 41, which many committed frames follow."""
    at = 32 + (24 + 4096) * 40 + 100
    return log[:at] + bytes([log[at] ^ 1]) + log[at + 1 :]


# -- the daemon ---------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["header", "page", "log frame"])
def test_resurgo_supervisor_refuses_to_start_on_a_damaged_store(
    crashed_store: tuple[bytes, bytes], closed_store: bytes, tmp_path: Path, damage: str
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    store = state / "resurgo.db"
    if damage == "log frame":
        database, log = crashed_store
        store.write_bytes(database)
        wal_path(store).write_bytes(damage_frame_41(log))
    elif damage == "header":
        store.write_bytes(b"not a database " * 10 + closed_store[150:])
    else:
        garbage = random.Random(3).randbytes(4096)
        store.write_bytes(closed_store[:8192] + garbage + closed_store[12288:])
    before = snapshot(state)
    done = subprocess.run(
        [sys.executable, "-m", "supervisor.daemon", "--state-dir", str(state)],
        cwd=REPO,
        env={**os.environ, "RESURGO_SUPERVISOR_LISTEN_PORT": "0"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert str(store) in done.stderr
    assert "resurgo store backup" in done.stderr
    assert "Traceback" not in done.stderr
    assert_untouched(state, before)
