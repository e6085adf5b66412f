"""PyTorch Lightning checkpoints: ``*.ckpt`` files, ``last.ckpt`` among them.

``ModelCheckpoint`` writes one ``torch.save`` file per checkpoint, named by its
``filename`` template (``epoch=3-step=120.ckpt`` by default) in its
``dirpath`` (by default ``lightning_logs/version_K/checkpoints/`` below the
root), plus ``last.ckpt`` (a copy, or a link with ``save_last="link"``).
``trainer.fit(ckpt_path="last")`` loads the newest ``last*.ckpt``. The step is
the ``step=N`` in the name, else the ``global_step`` the file's pickle names,
read without running it (:func:`~agent.checkpoint.layouts.torchfile.peek`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from agent.checkpoint.layouts import files_ladder
from agent.checkpoint.layouts.base import Found, Ladder, step_in_path
from agent.checkpoint.layouts.torchfile import peek, step_named, whole
from agent.checkpoint.report import Level, Report

SUFFIX = ".ckpt"
LAST = "last.ckpt"
# Lightning's default directory is three levels below the root.
_DEPTH = 4


def step_of(path: Path) -> int | None:
    """The step a ``.ckpt`` holds: from its name, else from its pickle (None: unknown)."""
    named = step_in_path(path)
    return named if named is not None else step_named(peek(path))


class _Lightning:
    name = "lightning"

    def owns(self, path: Path) -> bool:
        return path.suffix == SUFFIX and not path.is_dir()

    def find(self, root: Path) -> Iterator[Found]:
        for path in _ckpt_files(root):
            try:
                status = path.stat()
            except OSError:
                continue
            name = str(path.relative_to(root))
            yield Found(self.name, str(path), name, step_of(path), status.st_mtime,
                        status.st_size, complete=whole(path, status.st_size))  # fmt: skip

    def check(self, path: Path, level: Level) -> Report:
        return files_ladder.run(Ladder(path, level, step=step_of(path)), [path])

    def steer(self, root: Path, chosen: Path | None) -> list[str]:
        """Give each directory that lost its ``last.ckpt`` one again: a copy of ``chosen``.

        A copy, not a link: Lightning writes the next ``last.ckpt`` by opening
        the path for writing, which would overwrite the chosen checkpoint
        through a link.
        """
        if chosen is None or not self.owns(chosen):
            return []
        last = chosen.parent / LAST
        if last.exists() or last == chosen:
            return []
        temporary = last.with_name(f".{LAST}.resurgo-tmp")
        shutil.copyfile(chosen, temporary)
        os.replace(temporary, last)
        return [f"{last.relative_to(root)} is now a copy of {chosen.relative_to(root)}"]


def _ckpt_files(root: Path) -> Iterator[Path]:
    base = len(root.parts)
    for directory, subdirectories, names in os.walk(root):
        here = Path(directory)
        deeper = len(here.parts) - base < _DEPTH
        # Dot-directories (the quarantine among them) hold no checkpoints to resume from.
        subdirectories[:] = [name for name in subdirectories if deeper and name[:1] != "."]
        for name in names:
            if name.endswith(SUFFIX):
                yield here / name


LAYOUT = _Lightning()
