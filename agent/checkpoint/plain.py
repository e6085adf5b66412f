"""A training script's own ``torch.save`` checkpoints: found and validated without our format.

A script that imports nothing of Resurgo keeps its checkpoint as one file
(nanoGPT's ``out_dir/ckpt.pt``, ``model.pth``, Lightning's ``last.ckpt``).
Such a file has no manifest and no commit marker, so the levels that apply
are:

- quick: the file is not empty, and has not changed for :data:`SETTLE_S`
  (a file still growing is a save in progress, not a checkpoint);
- load: ``torch.load(weights_only=True, mmap=True)`` reads it whole (mmap
  needs torch's zip format; an older file is read without). A file that
  pickles Python objects (``weights_only`` refuses it) is complete as far as
  can be told without running its code: kept, with that said. The step is
  read from the loaded dict when it names one (``iter_num``, ``step``, ...).
"""

from __future__ import annotations

import os
import pickle
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agent.train.autohooks import step_named

SUFFIXES = (".pt", ".pth", ".ckpt", ".tar", ".bin")
# A file modified more recently than this may still be being written.
SETTLE_S = 5.0


@dataclass(frozen=True)
class PlainCheckpoint:
    """One ``torch.save`` file and what validation found (``reason`` None: nothing wrong)."""

    path: str
    total_bytes: int
    mtime_unix_s: float
    valid: bool
    loaded: bool
    step: int | None
    reason: str | None

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_plain(root: str | os.PathLike[str]) -> list[Path]:
    """The checkpoint-like files directly under ``root``, newest first (temporaries left out)."""
    found = []
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_file(follow_symlinks=False) and entry.name.endswith(SUFFIXES):
                found.append((entry.stat().st_mtime, Path(entry.path)))
    return [path for _, path in sorted(found, reverse=True)]


def check_plain(path: str | os.PathLike[str], now_s: float, *, load: bool) -> PlainCheckpoint:
    """Validate one file at quick, or with ``load`` also test-load it; a bad file is a
    finding, never an exception."""
    try:
        stat = os.stat(path)
    except OSError as error:
        return PlainCheckpoint(os.fspath(path), 0, 0.0, False, False, None, f"cannot read: {error}")

    def result(
        valid: bool, reason: str | None, loaded: bool = False, step: int | None = None
    ) -> PlainCheckpoint:
        return PlainCheckpoint(
            os.fspath(path), stat.st_size, stat.st_mtime, valid, loaded, step, reason
        )

    if stat.st_size == 0:
        return result(False, "the file is empty: its save never wrote anything")
    age_s = now_s - stat.st_mtime
    if age_s < SETTLE_S:
        return result(
            False, f"modified {max(0.0, age_s):.1f} s ago: a save may still be writing it"
        )
    if not load:
        return result(True, None)
    try:
        state = _load(path)
    except pickle.UnpicklingError as error:
        if "weights_only" in str(error) or "Weights only load failed" in str(error):
            return result(
                True,
                "not test-loaded: it pickles Python objects, which torch.load(weights_only=True) "
                "refuses to run",
            )
        return result(False, _corrupt(error))
    except Exception as error:  # any failure to read the file is the finding
        return result(False, _corrupt(error))
    return result(True, None, loaded=True, step=step_named(state))


def _load(path: str | os.PathLike[str]) -> Any:
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap" not in str(error):
            raise
        # Written in torch's legacy (pre-zip) format, which mmap cannot read.
        return torch.load(path, map_location="cpu", weights_only=True)


def _corrupt(error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"torch.load cannot read it ({first}): truncated or corrupt; use an older checkpoint"
