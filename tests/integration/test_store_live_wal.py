"""A store read while its supervisor writes: the write-ahead log check never cries damage.

``resurgo status``, the tests and a restarting supervisor open the store while
another process appends to its log. A log that an earlier generation made
longer keeps its size and header while it is written, and a frame read half
written, with whole frames after it by the time they are read, looks like
damage. Measured before the fix with this writer: 95 false refusals in 5,492
checks (20 s); the check must refuse none, and still refuse a log that really
is damaged (tests/unit/supervisor/store/test_fuzz_store.py).
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path

from supervisor.errors import StoreCorrupt
from supervisor.store.wal import check_wal


def test_a_log_being_written_is_never_judged_damaged(tmp_path: Path) -> None:
    database = tmp_path / "resurgo.db"
    writer = sqlite3.connect(database, check_same_thread=False)
    writer.execute("PRAGMA journal_mode=WAL")
    # Small generations: the log restarts often over frames of the previous one.
    writer.execute("PRAGMA wal_autocheckpoint=50")
    writer.execute("CREATE TABLE t (x BLOB)")
    writer.commit()
    stop = threading.Event()
    commits = [0]

    def write() -> None:
        while not stop.is_set():
            writer.execute("INSERT INTO t VALUES (?)", (os.urandom(3000),))
            writer.commit()
            commits[0] += 1

    thread = threading.Thread(target=write)
    thread.start()
    refused, checks, started = [], 0, time.monotonic()
    try:
        while time.monotonic() - started < 5.0:
            checks += 1
            try:
                check_wal(database, "restore a backup")
            except StoreCorrupt as error:
                refused.append(str(error))
    finally:
        stop.set()
        thread.join()
        writer.close()
    assert commits[0] > 100 and checks > 100, (commits, checks)  # they did overlap
    assert refused == [], f"{len(refused)} of {checks} checks refused a live log: {refused[0]}"
