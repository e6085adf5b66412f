"""A rank's uncaught exception, noted the moment it reaches the top of the rank; and
the end of its script.

The rank that raises is not always the first to die. Its peers see its
connections close and abort while its own interpreter still unwinds, and
torchrun then stops it with SIGTERM: its exit reads as a stop, and a peer's
abort as the root cause (seen with gloo: the raising rank ended by SIGTERM 80 ms
after a peer's SIGABRT). The bootstrap (``agent/bootstrap/sitecustomize.py``)
calls :func:`install` in every rank: on an uncaught exception the hook writes
``raised-rank-<RANK>.json`` (the exception's type, its message's start, its
``errno`` when it is an ``OSError``, and when) into the agent's exit directory
before Python prints the traceback, and the agent attaches it to the rank's
exit (:mod:`agent.node.procs`). The message and errno are what tells a full
disk or a missing module from a fault of the node.

Launchers' own errors (torchrun's ``ChildFailedError``, raised because a rank
failed) are not a rank's exception and are not noted.

A rank whose script ran to its end without an uncaught exception writes
``ended-rank-<RANK>`` there too, as Python begins its normal shutdown (first
thing, before the ``atexit`` handlers, any of which may crash). What comes
after (gloo's or CUDA's destructors) can still kill it by a signal: the
supervisor then knows its training had ended (:mod:`supervisor.core.clean_end`).
A rank killed, or ended by ``os._exit``, writes nothing. Never raises.

Among what the ranks and their agent share (``agent/wire/``): the rank writes
these notes, the agent reads them; nothing here imports either side.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from agent.wire.environ import ENV_EXIT_DIR, ENV_RANK

TYPE_CHARS = 200
MESSAGE_CHARS = 500


@dataclass(frozen=True)
class Note:
    """A rank's uncaught exception: its type, the start of its message, its errno (an
    ``OSError``'s, else None), and when it reached the top."""

    type: str
    time_unix_s: float
    message: str = ""
    errno: int | None = None


def path_of(exit_dir: Path, global_rank: int) -> Path:
    """Where rank ``global_rank``'s note goes."""
    return exit_dir / f"raised-rank-{global_rank}.json"


def ended_path(exit_dir: Path, global_rank: int) -> Path:
    """Where rank ``global_rank`` notes that its script ran to its end."""
    return exit_dir / f"ended-rank-{global_rank}"


def ended(exit_dir: Path, global_rank: int) -> bool:
    """Whether rank ``global_rank``'s script ran to its end."""
    return ended_path(exit_dir, global_rank).exists()


def install() -> None:
    """Note this rank's uncaught exception (when it is a rank of a Resurgo launch)."""
    exit_dir, rank = os.environ.get(ENV_EXIT_DIR), os.environ.get(ENV_RANK, "")
    if not exit_dir or not rank.isdigit():
        return
    previous = sys.excepthook
    failed = False

    def hook(
        kind: type[BaseException], value: BaseException, traceback: TracebackType | None
    ) -> None:
        nonlocal failed
        failed = True
        if issubclass(kind, Exception) and not kind.__module__.startswith(
            "torch.distributed.elastic"
        ):
            with contextlib.suppress(Exception):
                note(Path(exit_dir), int(rank), kind.__qualname__, _message(value), _errno(value))
        previous(kind, value, traceback)

    sys.excepthook = hook

    owner = os.getpid()

    def script_ended() -> None:
        # A forked child (a DataLoader worker) runs this too as it exits: not the script.
        if not failed and os.getpid() == owner:
            with contextlib.suppress(Exception):
                ended_path(Path(exit_dir), int(rank)).touch()

    # Called as the interpreter shuts down, before the atexit handlers (CPython 3.9+;
    # else as the last of those).
    register = getattr(threading, "_register_atexit", None) or atexit.register
    register(script_ended)


def _message(value: BaseException) -> str:
    try:
        return str(value)[:MESSAGE_CHARS]
    except Exception:  # a __str__ that raises: the type says enough
        return ""


def _errno(value: BaseException) -> int | None:
    number = getattr(value, "errno", None) if isinstance(value, OSError) else None
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def note(
    exit_dir: Path,
    global_rank: int,
    type_name: str,
    message: str = "",
    errno: int | None = None,
) -> None:
    """Write the note atomically: the agent may read it at any moment."""
    document = {
        "type": type_name[:TYPE_CHARS],
        "time_unix_s": time.time(),
        "message": message[:MESSAGE_CHARS],
        "errno": errno,
    }
    final = path_of(exit_dir, global_rank)
    temporary = final.with_name(f".{final.name}.tmp")
    temporary.write_text(json.dumps(document))
    os.replace(temporary, final)


def read(exit_dir: Path, global_rank: int) -> tuple[str, float] | None:
    """The rank's note as (exception type, when), or None: none, or unreadable."""
    found = read_note(exit_dir, global_rank)
    return None if found is None else (found.type, found.time_unix_s)


def read_note(exit_dir: Path, global_rank: int) -> Note | None:
    """The rank's whole note, or None: none, or unreadable."""
    try:
        document = json.loads(path_of(exit_dir, global_rank).read_text())
        kind, when = document["type"], document["time_unix_s"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(kind, str) or isinstance(when, bool) or not isinstance(when, int | float):
        return None
    message, errno = document.get("message"), document.get("errno")
    return Note(
        kind[:TYPE_CHARS],
        float(when),
        message[:MESSAGE_CHARS] if isinstance(message, str) else "",
        errno if isinstance(errno, int) and not isinstance(errno, bool) else None,
    )
