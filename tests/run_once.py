"""Expensive results made once per pytest run and shared by every xdist worker.

The unfaulted reference runs of the e2e tests take a minute each on the local
cluster. Every worker that runs a test needing one would otherwise make its
own; here the first worker to ask makes it under a file lock while the others
wait, and every later ask (any worker, any module) reads the same folder. The
folder is keyed by a hash of everything that decides the result (the trainer's
source, its arguments, the policy), so two different references never share.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from filelock import FileLock

from tests.conftest import worker_id

DONE = ".made"
# Longer than any reference run takes; a worker waiting past it fails naming the lock.
LOCK_TIMEOUT_S = 900.0


def key_of(parts: Iterable[object], files: Iterable[Path] = ()) -> str:
    """A short hash of ``parts`` (by ``repr``) and the bytes of ``files``."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(repr(part).encode())
    for path in files:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def run_root(factory: pytest.TempPathFactory) -> Path:
    """A folder of this pytest run that every worker shares (xdist's workers each get
    their own base temp folder below it)."""
    base = factory.getbasetemp()
    return base.parent if worker_id() is not None else base


def once_per_run(
    factory: pytest.TempPathFactory, name: str, key: str, make: Callable[[Path], None]
) -> Path:
    """The folder ``make`` filled for ``name``/``key`` in this run; made here if no worker
    has made it yet. A ``make`` that raised leaves nothing behind: the next ask tries again."""
    where = run_root(factory) / f"once-{name}-{key}"
    with FileLock(f"{where}.lock", timeout=LOCK_TIMEOUT_S):
        if not (where / DONE).exists():
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            make(where)
            (where / DONE).touch()
    return where
