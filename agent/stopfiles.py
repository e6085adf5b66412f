"""The files of the planned stop before the time limit (:mod:`agent.timelimit`).

- the notice: the driver writes ``<job dir>/time-limit.json`` (the job's
  directory is on a filesystem every node sees); each node agent polls it;
- the save request: the node agent writes ``save-request.json`` in its run
  directory (``RESURGO_SAVE_REQUEST_FILE`` names it to the ranks); the
  in-rank library polls it and saves at the next step boundary.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from agent.checkpoint import files
from agent.timelimit import Notice
from agent.wire.environ import ENV_SAVE_REQUEST_FILE

NOTICE_NAME = "time-limit.json"


def notice_path(job_dir: Path) -> Path:
    """Where the driver writes the notice: the job's directory, which every node sees."""
    return job_dir / NOTICE_NAME


def write_notice(job_dir: Path, notice: Notice) -> None:
    """Write the notice durably and atomically (the agents poll for it)."""
    files.write_durably(notice_path(job_dir), notice.to_json().encode())


def clear_notice(job_dir: Path) -> None:
    """Remove a notice left by an earlier run of the job (a requeued job starts afresh)."""
    with contextlib.suppress(FileNotFoundError):
        notice_path(job_dir).unlink()


def read_notice(path: Path) -> Notice | None:
    """The notice at ``path``; None when there is none or it cannot be read whole."""
    try:
        with path.open("rb") as handle:
            data = handle.read(4096)
        return Notice.from_json(data.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None


class SaveRequest:
    """The file the node agent writes to ask its ranks for a checkpoint now.

    The in-rank library polls it (a ``stat`` at most every ``poll_s``) and
    saves at the next step boundary once per request id; the agent writes
    ``{"id": N}`` with a new N for each request.
    """

    def __init__(self, path: str | None, poll_s: float = 1.0) -> None:
        self._path = Path(path) if path else None
        self._poll_s = poll_s
        self._last_poll_s: float | None = None
        self._seen: tuple[int, int, int] | None = None
        self._honoured: int | None = None
        self._pending: int | None = None

    @classmethod
    def from_env(cls, environ: Any = None) -> SaveRequest:
        """The request file named by ``RESURGO_SAVE_REQUEST_FILE`` (none when unset)."""
        env = os.environ if environ is None else environ
        return cls(env.get(ENV_SAVE_REQUEST_FILE) or None)

    def pending(self, now_s: float) -> bool:
        """Whether a request not yet honoured is waiting (polls the file when due)."""
        if self._path is not None and (
            self._last_poll_s is None or now_s - self._last_poll_s >= self._poll_s
        ):
            self._last_poll_s = now_s
            self._poll(self._path)
        return self._pending is not None and self._pending != self._honoured

    def honoured(self) -> None:
        """The save for the pending request started."""
        self._honoured = self._pending

    def mark_held(self, rank: int) -> None:
        """This rank committed the requested checkpoint and waits to be stopped."""
        if self._path is not None:
            with contextlib.suppress(OSError):
                held_path(self._path, rank).touch()

    def _poll(self, path: Path) -> None:
        try:
            status = path.stat()
        except OSError:
            return
        signature = (status.st_mtime_ns, status.st_size, status.st_ino)
        if signature == self._seen:
            return
        self._seen = signature
        try:
            data = json.loads(path.read_bytes()[:4096])
            request = data["id"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        if isinstance(request, int) and not isinstance(request, bool):
            self._pending = request


def held_path(request_path: Path, rank: int) -> Path:
    """The file a rank leaves beside the request once it holds after the final save."""
    return request_path.with_name(f"{request_path.name}.held.{rank}")


def held_ranks(request_path: Path) -> set[int]:
    """The global ranks holding after the requested checkpoint."""
    prefix = f"{request_path.name}.held."
    found = set()
    with contextlib.suppress(OSError):
        for child in request_path.parent.iterdir():
            if child.name.startswith(prefix) and child.name[len(prefix) :].isdigit():
                found.add(int(child.name[len(prefix) :]))
    return found


def clear_save_request(request_path: Path) -> None:
    """Remove a request and its held marks (a new launch starts without them)."""
    for rank in held_ranks(request_path):
        with contextlib.suppress(OSError):
            held_path(request_path, rank).unlink()
    with contextlib.suppress(FileNotFoundError):
        request_path.unlink()


def write_save_request(path: Path, request_id: int) -> None:
    """Ask the ranks reading ``path`` for a checkpoint at their next step boundary."""
    files.write_durably(path, json.dumps({"id": request_id}).encode())
