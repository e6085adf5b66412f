"""A single ``torch.save`` file in the checkpoint root: nanoGPT's ``ckpt.pt``, ``model.pth``.

The script writes one file and overwrites it at each save. Its step is the
one the dict names (``iter_num``, ``global_step``, ``step``...), read without
running the pickle. A file in torch's legacy format (no zip archive) is
checked by its size and age, then by a load.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

from agent.checkpoint.layouts import files_ladder
from agent.checkpoint.layouts.base import Found, Ladder
from agent.checkpoint.layouts.torchfile import is_zip, peek, step_named, whole
from agent.checkpoint.report import Level, Report

SUFFIXES = (".pt", ".pth", ".tar", ".bin")
# Files in an output directory that are not checkpoints (Hugging Face's arguments).
_NOT_CHECKPOINTS = frozenset({"training_args.bin"})
# A legacy-format file modified more recently than this may still be being written.
SETTLE_S = 5.0


class _TorchSave:
    name = "torch_save"

    def owns(self, path: Path) -> bool:
        return (path.suffix in SUFFIXES and path.name not in _NOT_CHECKPOINTS
                and not path.is_dir())  # fmt: skip

    def find(self, root: Path) -> Iterator[Found]:
        for path in root.iterdir():
            if not self.owns(path) or path.is_symlink():
                continue
            try:
                status = path.stat()
            except OSError:
                continue
            yield Found(self.name, str(path), path.name, step_named(peek(path)), status.st_mtime,
                        status.st_size, complete=whole(path, status.st_size))  # fmt: skip

    def check(self, path: Path, level: Level) -> Report:
        ladder = Ladder(path, level, step=step_named(peek(path)))
        if path.stat().st_size > 0 and not is_zip(path):
            age_s = time.time() - path.stat().st_mtime
            if age_s < SETTLE_S:
                return ladder.fail(Level.QUICK, f"modified {max(0.0, age_s):.1f} s ago: a save "
                                   "may still be writing it")  # fmt: skip
        return files_ladder.run(ladder, [path])

    def steer(self, root: Path, chosen: Path | None) -> list[str]:
        return []  # the script names its one file itself


LAYOUT = _TorchSave()
