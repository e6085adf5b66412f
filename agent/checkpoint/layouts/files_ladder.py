"""The ladder over a set of weight and state files, shared by the directory layouts.

Each file is checked by its kind: a ``.safetensors`` file by its header (quick)
and by reading every byte (full); a ``torch.save`` zip archive by its central
directory (quick), its CRCs (full) and a test load (load); a legacy ``torch.save``
file by its size, then a load. JSON files must parse.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from agent.checkpoint.layouts.base import Ladder
from agent.checkpoint.layouts.safetensors import check_safetensors
from agent.checkpoint.layouts.torchfile import check_zip, is_zip, load_problem
from agent.checkpoint.report import Level, Report

TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def run(ladder: Ladder, paths: Sequence[Path]) -> Report:
    """Check ``paths`` level by level; the first problem ends the ladder."""
    for path in paths:
        problem = _quick(path)
        if problem is not None:
            return ladder.fail(Level.QUICK, _named(ladder, path, problem))
    ladder.passed(Level.QUICK)
    if not ladder.wants(Level.FULL):
        return ladder.ok()
    for path in paths:
        problem = _full(path)
        if problem is not None:
            return ladder.fail(Level.FULL, _named(ladder, path, problem))
    if any(path.suffix == ".safetensors" for path in paths):
        ladder.skipped.append("safetensors files carry no checksum: every byte read, none compared")
    ladder.passed(Level.FULL)
    if not ladder.wants(Level.LOAD):
        return ladder.ok()
    for path in paths:
        if path.suffix in TORCH_SUFFIXES:
            problem, note = load_problem(path)
            if problem is not None:
                return ladder.fail(Level.LOAD, _named(ladder, path, problem))
            if note is not None:
                ladder.skipped.append(note)
    ladder.passed(Level.LOAD)
    return ladder.ok()


def _named(ladder: Ladder, path: Path, problem: str) -> str:
    """The problem, with the file's name where the checkpoint is a directory of files."""
    return problem if path == ladder.path else f"{path.name}: {problem}"


def _quick(path: Path) -> str | None:
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size == 0:
        return "empty: its save never wrote anything"
    if path.suffix == ".safetensors":
        return check_safetensors(path)
    if path.suffix == ".json":
        try:
            json.loads(path.read_bytes())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return f"not JSON ({error}): cut short or overwritten"
        return None
    if path.suffix in TORCH_SUFFIXES and is_zip(path):
        return check_zip(path, crc=False)
    return None


def _full(path: Path) -> str | None:
    if path.suffix == ".safetensors":
        return check_safetensors(path, read_all=True)
    if path.suffix in TORCH_SUFFIXES and is_zip(path):
        return check_zip(path, crc=True)
    return None
