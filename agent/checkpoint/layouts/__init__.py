"""Checkpoint layouts: how each framework's checkpoints are found, stepped and validated.

A training script under Resurgo saves the way its framework does. Each layout
is a module with one :class:`Layout` object that says, for a checkpoint root,

- ``find``: which checkpoints lie there (a directory or a file each), with
  the step each holds and whether its save looks complete;
- ``check``: whether one passes a validation :class:`~agent.checkpoint.report.Level`,
  cheapest first: the files exist, their sizes and headers agree (quick), every
  byte reads back and matches its checksum where the format has one (full),
  a test load (load);
- ``steer``: after checkpoints were moved to quarantine
  (:mod:`agent.checkpoint.quarantine`), what the framework's own "latest"
  pointer needs so that it resumes from the chosen one.

The layouts, in the order a path is matched: Resurgo's own ``step-N/`` and a
plain DCP ``step-N/`` (torchtitan), Hugging Face Trainer's ``checkpoint-N/``,
DeepSpeed's ``global_stepN/`` with ``latest``, Lightning's ``*.ckpt`` (also
``last.ckpt``, in the root or below it), and a single ``torch.save`` file in
the root (nanoGPT's ``ckpt.pt``).

Nothing here imports torch, except a DCP check and a load test, which import
it when they run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from agent.checkpoint.layouts.base import QUARANTINE_DIR, Found, Ladder, Layout, step_in_path
from agent.checkpoint.report import Level, Report

__all__ = [
    "QUARANTINE_DIR", "Found", "Layout", "all_layouts", "check", "find_all", "layout_of",
    "step_in_path",
]  # fmt: skip


def all_layouts() -> Sequence[Layout]:
    """Every layout, in the order a path is matched."""
    from agent.checkpoint.layouts import dcp, deepspeed, huggingface, lightning, torch_save

    return (dcp.LAYOUT, huggingface.LAYOUT, deepspeed.LAYOUT, lightning.LAYOUT, torch_save.LAYOUT)


def layout_of(path: str | os.PathLike[str]) -> Layout | None:
    """The layout whose checkpoint ``path`` is (None: none)."""
    candidate = Path(path)
    return next((layout for layout in all_layouts() if layout.owns(candidate)), None)


def find_all(root: str | os.PathLike[str]) -> list[Found]:
    """Every checkpoint under ``root``, of every layout, newest first.

    Newest is the highest step, the later modification breaking a tie (a
    Lightning ``last.ckpt`` before the ``step=N.ckpt`` it copies). A
    checkpoint whose step cannot be told (a ``torch.save`` file cut short
    before its pickle could be read) goes before every checkpoint modified
    before it: it is most likely the newest save, and the one its script would
    load.
    """
    root_path = Path(root)
    if not root_path.is_dir():
        return []
    known: list[Found] = []
    unknown: list[Found] = []
    for layout in all_layouts():
        for found in layout.find(root_path):
            (unknown if found.step is None else known).append(found)
    known.sort(key=lambda f: (f.step, f.mtime_s), reverse=True)
    unknown.sort(key=lambda f: f.mtime_s, reverse=True)
    ordered: list[Found] = []
    for found in known:
        while unknown and unknown[0].mtime_s > found.mtime_s:
            ordered.append(unknown.pop(0))
        ordered.append(found)
    return ordered + unknown


def check(path: str | os.PathLike[str], level: Level) -> Report:
    """Validate the checkpoint at ``path`` by its layout; one no layout owns is invalid."""
    layout = layout_of(path)
    if layout is None:
        return Ladder(Path(path), level).fail(
            Level.QUICK, "not a checkpoint of any known layout (step-N/, checkpoint-N/, "
            "global_stepN/, *.ckpt, or a torch.save file)",
        )  # fmt: skip
    try:
        return layout.check(Path(path), level)
    except OSError as error:
        # Permissions, a file deleted mid-run, an I/O error: unreadable means unusable.
        return Ladder(Path(path), level).fail(Level.QUICK, f"cannot be read: {error}")
