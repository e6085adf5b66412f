"""Disk primitives below everything else: open a regular file and nothing else, and
fsync a directory.

Here rather than with the checkpoint code, because the job secret
(:mod:`agent.wire.auth`), the Reporter's spool and the checkpoint writer all
need them, and what the agent side and the supervisor share imports nothing
above it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading, refusing (OSError) anything but a regular file.

    Opened non-blocking, so a FIFO or a device put where a file belongs (by
    whoever owns the directory) costs an error instead of a reader blocked
    forever; the flag is cleared once the file is known to be regular.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def fsync_dir(directory: Path) -> None:
    """fsync a directory so that entries created or renamed in it are durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
