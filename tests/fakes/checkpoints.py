"""Fake framework checkpoints: what the Hugging Face Trainer and Lightning save, written by hand.

The files have the frameworks' layouts and are written with the real writers
(``torch.save``, ``safetensors``), then broken the ways saves break (cut short,
a flipped byte), for the unit tests of layouts, quarantine, the scan and the
driver. The real frameworks write them instead in
tests/integration/test_framework_checkpoints.py and the live tier's
tests/e2e/test_frameworks.py (the scripts in tests/frameworks/).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHTS = {"layer.weight": torch.ones(64, 64), "layer.bias": torch.zeros(64)}


def hf_checkpoint(root: Path, step: int, *, mtime: float | None = None) -> Path:
    """A Hugging Face Trainer checkpoint-N/ as its save writes one."""
    directory = root / f"checkpoint-{step}"
    directory.mkdir(parents=True)
    save_file(WEIGHTS, directory / "model.safetensors")
    state = {0: {"exp_avg": torch.ones(4096)}}
    torch.save({"state": state, "param_groups": [{"lr": 0.1}]}, directory / "optimizer.pt")
    torch.save({"last_epoch": step}, directory / "scheduler.pt")
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if mtime is not None:
        for path in (directory, *directory.iterdir()):
            os.utime(path, (mtime, mtime))
    return directory


def lightning_file(path: Path, step: int, mtime: float) -> Path:
    """A Lightning ``.ckpt`` file at ``path`` as ``Trainer.save_checkpoint`` writes one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"global_step": step, "epoch": 0, "state_dict": WEIGHTS, "callbacks": {}}, path)
    os.utime(path, (mtime, mtime))
    return path


def cut(path: Path, keep: float = 0.5) -> None:
    """``path`` cut short to ``keep`` of its size, as a save killed mid-write leaves it."""
    os.truncate(path, int(path.stat().st_size * keep))


def flip(path: Path, at: float = 0.5) -> None:
    """One byte of ``path`` flipped at ``at`` of its size, as bit rot leaves it."""
    with open(path, "r+b") as file:
        file.seek(int(path.stat().st_size * at))
        byte = file.read(1)
        file.seek(-1, os.SEEK_CUR)
        file.write(bytes([byte[0] ^ 0xFF]))
