"""Quarantine: checkpoints that failed validation, moved aside inside the root, never deleted.

A script that imports nothing of Resurgo resumes by its framework's own
"latest" logic: Hugging Face's ``get_last_checkpoint`` takes the highest
``checkpoint-N`` whatever it holds, Lightning loads ``last.ckpt``, nanoGPT
loads ``ckpt.pt``. When the supervisor rejected the newest ones, the in-job
driver (the job's own user, before the relaunch) moves them into
``<root>/.resurgo-quarantine/`` so that the framework finds the valid one,
and each layout's ``steer`` mends what pointed at a moved one (Lightning's
``last.ckpt``, DeepSpeed's ``latest``).

Each move is one line in ``.resurgo-quarantine/moves.jsonl`` (where from,
where to, when, why); :func:`release` moves one back, which is what
``resurgo ckpt release ROOT NAME`` does. Nothing outside the root is touched:
a path that does not lie inside it (after resolving links in its parent
directories) is refused.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.checkpoint.layouts import QUARANTINE_DIR, all_layouts, find_all
from agent.wire.diskio import fsync_dir
from agent.wire.errors import ConfigError

log = logging.getLogger(__name__)

RECORD = "moves.jsonl"


@dataclass(frozen=True)
class Move:
    """One checkpoint moved into quarantine: names relative to the checkpoint root."""

    source: str
    target: str
    time_unix_s: float
    reason: str

    def to_json_dict(self) -> dict[str, object]:
        return asdict(self)


def quarantine(
    root: str | os.PathLike[str],
    rejected: dict[str, str],
    chosen: str | None,
    now_unix_s: float | None = None,
) -> tuple[list[Move], list[str]]:
    """Move each rejected checkpoint (path -> why) into quarantine; steer to ``chosen``.

    Returns the moves made and what the layouts changed to point at ``chosen``
    (None: the job starts from scratch). A path already gone, outside the
    root, or already quarantined is skipped with a log line.
    """
    base = Path(root).resolve()
    hold = base / QUARANTINE_DIR
    now = time.time() if now_unix_s is None else now_unix_s
    moves = []
    for path, reason in rejected.items():
        source = _inside(base, Path(path))
        if source is None:
            log.warning("not quarantined: %s does not lie inside %s", path, base)
            continue
        if not os.path.lexists(source):
            continue  # moved already (a driver that asked twice), or deleted
        relative = source.relative_to(base)
        if relative.parts[0] == QUARANTINE_DIR:
            continue
        hold.mkdir(mode=0o755, exist_ok=True)
        target = _free(hold / f"{'__'.join(relative.parts)}.{int(now)}")
        source.rename(target)
        move = Move(str(relative), str(target.relative_to(base)), now, reason)
        _append(hold, move)
        log.warning("checkpoint %s quarantined to %s: %s", relative, move.target, reason)
        moves.append(move)
    steered: list[str] = []
    if moves:
        fsync_dir(base)
        target_path = None if chosen is None else _inside(base, Path(chosen))
        for layout in all_layouts():
            steered.extend(layout.steer(base, target_path))
    for change in steered:
        log.warning("checkpoint root %s: %s", base, change)
    return moves, steered


def newer_than(root: str | os.PathLike[str], step: int) -> dict[str, str]:
    """Every checkpoint under ``root`` of a step after ``step`` (path -> why): a rollback
    resumes from ``step``, and a framework's own "latest" must not find these."""
    return {
        found.path: (
            f"step {found.step} lies past the rollback to step {step}: the run resumes before it"
        )
        for found in find_all(root)
        if found.step is not None and found.step > step
    }


def quarantined(root: str | os.PathLike[str]) -> list[Move]:
    """Every move recorded under ``root`` whose checkpoint is still in quarantine."""
    base = Path(root).resolve()
    moves = []
    for move in _read(base / QUARANTINE_DIR):
        if os.path.lexists(base / move.target):
            moves.append(move)
    return moves


def release(root: str | os.PathLike[str], name: str) -> Move:
    """Move the quarantined checkpoint ``name`` (its original or quarantine name) back.

    Raises :class:`ConfigError` saying what to do when nothing by that name is
    in quarantine, or its original place is taken again.
    """
    base = Path(root).resolve()
    for move in reversed(quarantined(base)):
        if name in (move.source, move.target, Path(move.target).name):
            back = base / move.source
            if os.path.lexists(back):
                raise ConfigError(
                    f"{back} exists again (a newer save took its name): move it away first, "
                    f"or copy {base / move.target} where you want it"
                )
            (base / move.target).rename(back)
            fsync_dir(back.parent)
            log.warning("checkpoint %s released from quarantine", move.source)
            return move
    held = ", ".join(move.source for move in quarantined(base)) or "none"
    raise ConfigError(f"no checkpoint {name!r} in quarantine under {base} (held: {held})")


def _inside(base: Path, path: Path) -> Path | None:
    """``path`` with its parent's links resolved, if that lies inside ``base`` (else None).

    The last component is kept as it is: a link named ``last.ckpt`` is moved
    itself, never what it points at.
    """
    candidate = path if path.is_absolute() else base / path
    resolved = candidate.parent.resolve() / candidate.name
    return resolved if resolved.is_relative_to(base) and resolved != base else None


def _free(target: Path) -> Path:
    suffix = 1
    free = target
    while os.path.lexists(free):
        free = target.with_name(f"{target.name}-{suffix}")
        suffix += 1
    return free


def _append(hold: Path, move: Move) -> None:
    with open(hold / RECORD, "a", encoding="utf-8") as record:
        record.write(json.dumps(move.to_json_dict()) + "\n")
        record.flush()
        os.fsync(record.fileno())


def _read(hold: Path) -> list[Move]:
    try:
        lines = (hold / RECORD).read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    moves = []
    for line in lines:
        try:
            document = json.loads(line)
            moves.append(Move(str(document["source"]), str(document["target"]),
                              float(document["time_unix_s"]), str(document["reason"])))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a crash: that move's record is lost, not the data
    return moves
