"""The agent's run directory: private to its user, and one per job, node and launch.

It holds the ranks' heartbeat socket, their exit records, the save-request
and checkpoint-interval files and the event spool; :mod:`agent.node.agent` makes
it at start.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import tempfile
from pathlib import Path

from agent.node.config import AgentConfig

log = logging.getLogger(__name__)


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can enter, created 0700 if missing.

    The run directory holds the ranks' heartbeat socket, their exit records
    and the event spool, and its default name under ``/tmp`` is predictable.
    A directory of that name that another user made (or a symlink) would let
    them forge exits, read the spool or take the socket: it is left alone and
    a fresh private directory beside it is used instead (an event spool left
    in the usual one is then not resumed). One of ours is made 0700.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    found = os.lstat(path)
    if stat.S_ISDIR(found.st_mode) and found.st_uid == os.getuid():
        if stat.S_IMODE(found.st_mode) & 0o077:
            os.chmod(path, 0o700)  # ours (an explicit --run-dir, say): made private
        return path
    fresh = Path(tempfile.mkdtemp(prefix=f"{path.name}-", dir=path.parent))
    log.warning(
        "run directory %s is not this user's (owner uid %d, mode %04o, %s); using %s instead",
        path,
        found.st_uid,
        stat.S_IMODE(found.st_mode),
        "a directory" if stat.S_ISDIR(found.st_mode) else "not a directory",
        fresh,
    )
    return fresh


def default_run_dir(config: AgentConfig) -> str:
    """``/tmp/resurgo-agent-<job>-<node>-<launch>[-<job secret tag>]``.

    Job ids start over when a cluster's Slurm state is reset; the tag (from
    the job's secret, new at every submission) keeps a later job with the
    same id from resuming an earlier one's event spool, which the new
    secret would sign and the supervisor would take for this job's events.
    """
    name = f"/tmp/resurgo-agent-{config.job_id}-{config.node}-{config.launch_nonce}"
    if config.secret_file:
        with contextlib.suppress(OSError):
            digest = hashlib.sha256(Path(config.secret_file).read_bytes()).hexdigest()
            name += f"-{digest[:12]}"
    return name
