"""The modes of the supervisor's own state: the directory and the store's files.

The store holds every job's events, command lines, stack dumps and paths;
under a umask of 022 SQLite creates it 0644 in a 0755 directory, readable by
every local user. :func:`make_private` sets the modes whatever the umask:
the directory 0700 and ``resurgo.db``, ``-wal`` and ``-shm`` 0600, or, with
a group of operators who may read the store (``state_group``), 0750 (with
the setgid bit, so files SQLite creates later, such as a new ``-wal``, get
the group too) and 0640. SQLite creates ``-wal`` and ``-shm`` with the
database file's mode, so they stay private after the first call.

When the jobs directory lies inside the state directory (the single-machine
default), users must reach it to submit: the state directory then also gets
the search bit for others (0701 / 2751), which lets them open a path they
know inside it but not list it; the store's files stay 0600 / 0640.
"""

from __future__ import annotations

import grp
import os
import stat
from pathlib import Path

from agent.wire.errors import ConfigError

STORE_SUFFIXES = ("", "-wal", "-shm")


def group_id(name: str) -> int:
    """The id of group ``name``; ConfigError naming the setting when there is none."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ConfigError(
            f"supervisor setting state_group: no group {name!r} on this host; create it "
            "or leave the setting empty (only the supervisor's user reads the store)"
        ) from None


def directory_mode(*, group: bool, others_search: bool) -> int:
    """The state directory's mode."""
    mode = 0o2750 if group else 0o700
    return mode | stat.S_IXOTH if others_search else mode


def file_mode(*, group: bool) -> int:
    """The mode of ``resurgo.db`` and its ``-wal``/``-shm``."""
    return 0o640 if group else 0o600


def make_private(
    state_dir: Path, store_path: Path, *, group: str = "", others_search: bool = False
) -> None:
    """Create ``state_dir`` if needed and set its mode and the store files' modes (those
    that exist); ``group`` names the operators' group, "" for none."""
    gid = group_id(group) if group else None
    state_dir.mkdir(parents=True, exist_ok=True)
    if gid is not None:
        os.chown(state_dir, -1, gid)
    os.chmod(state_dir, directory_mode(group=gid is not None, others_search=others_search))
    for path in (store_path.with_name(store_path.name + suffix) for suffix in STORE_SUFFIXES):
        if not path.exists():
            continue
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, file_mode(group=gid is not None))
