"""Running Resurgo as a local user other than the test's own (root): its interpreter and
the checkout it must be able to read.

A checkout may sit in a 0700 directory (``mktemp -d``) and the venv's interpreter
may be a pyenv build under /root: neither is reachable by another user. The
tests then give others read and search permission on the checkout and the
venv's packages (search only on the directories above them) for their
duration, and run Debian's ``python3`` of the same version with the venv's
packages on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock

from tests.conftest import REPO

LOCK = "/tmp/resurgo-tests-reachable-by-others.lock"
# Longer than the longest module that holds it (test_unprivileged.py).
LOCK_TIMEOUT_S = 1800.0


@contextlib.contextmanager
def reachable_by_others() -> Iterator[None]:
    """Others may read the checkout and the venv's packages while the block runs.

    Directories on ``PYTHONPATH`` need read permission too (the import system
    lists them); those above them only search. The modes are put back after.
    Blocks of several pytest-xdist workers take turns (a file lock): one that
    put the modes back would otherwise take them from under another.
    """
    with FileLock(LOCK, timeout=LOCK_TIMEOUT_S):
        yield from _reachable()


def _reachable() -> Iterator[None]:
    imported = [REPO, Path(sysconfig.get_paths()["purelib"])]
    wanted: dict[Path, int] = {}
    for path in imported:
        for directory in path.parents:
            wanted[directory] = wanted.get(directory, 0) | stat.S_IXOTH
        wanted[path] = wanted.get(path, 0) | stat.S_IXOTH | stat.S_IROTH
    changed = []
    for directory, bits in sorted(wanted.items(), key=lambda item: len(item[0].parts)):
        mode = stat.S_IMODE(directory.stat().st_mode)
        if mode & bits != bits:
            changed.append((directory, mode))
            directory.chmod(mode | bits)
    try:
        yield
    finally:
        for directory, mode in reversed(changed):
            directory.chmod(mode)


def python_for(user: str, group: str | None = None) -> tuple[str, str]:
    """An interpreter ``user`` can import Resurgo and torch with, and its ``PYTHONPATH``.

    Call it inside :func:`reachable_by_others`. The venv's own interpreter
    first; else the system's of the same version with the venv's packages.
    """
    site = sysconfig.get_paths()["purelib"]
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/bin:/bin") or ""
    tried = []
    for python, path in ((sys.executable, str(REPO)), (system, f"{REPO}:{site}")):
        if not python:
            continue
        env = {"PYTHONPATH": path, "PATH": os.environ["PATH"], "HOME": "/nonexistent"}
        try:
            probe = subprocess.run(
                [python, "-c", "import supervisor, torch"], env=env, cwd="/",
                user=user, group=group or user, extra_groups=[],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
        except OSError as error:  # it may not even execute it
            tried.append(f"{python}: {error}")
            continue
        if probe.returncode == 0:
            return python, path
        tried.append(f"{python}: {probe.stderr.strip()[-300:]}")
    raise AssertionError(
        f"user {user} can run no {version} that imports Resurgo and torch (deploy/setup "
        f"installs Debian's python3): {tried}"
    )
