"""DeepSpeed checkpoints: ``global_stepN/`` directories and the ``latest`` file naming one.

``engine.save_checkpoint(dir)`` writes ``dir/global_stepN/`` (model states
``mp_rank_XX_model_states.pt``, ZeRO optimizer partitions ``*_optim_states.pt``)
and then ``dir/latest``, which ``load_checkpoint(dir)`` reads to find the tag
to load. All are ``torch.save`` files.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from agent.checkpoint.layouts import files_ladder
from agent.checkpoint.layouts.base import Found, Ladder, named_directories
from agent.checkpoint.report import Level, Report

_NAME = re.compile(r"^global_step(\d+)$")
LATEST = "latest"


class _DeepSpeed:
    name = "deepspeed"

    def owns(self, path: Path) -> bool:
        return _NAME.match(path.name) is not None and path.is_dir()

    def find(self, root: Path) -> Iterator[Found]:
        for child, step, mtime_s, total in named_directories(root, _NAME):
            complete = any(child.glob("*model_states.pt"))
            yield Found(self.name, str(child), child.name, step, mtime_s, total, complete)

    def check(self, path: Path, level: Level) -> Report:
        ladder = Ladder(path, level, step=int(_NAME.match(path.name).group(1)))  # type: ignore[union-attr]
        files = sorted(path.glob("*.pt"))
        if not any(file.name.endswith("model_states.pt") for file in files):
            return ladder.fail(Level.QUICK, "no *model_states.pt: the save did not finish")
        return files_ladder.run(ladder, files)

    def steer(self, root: Path, chosen: Path | None) -> list[str]:
        """Rewrite ``latest`` when the tag it names was moved away."""
        latest = root / LATEST
        try:
            tag = latest.read_text().strip()
        except OSError:
            return []
        if (root / tag).is_dir() or chosen is None or not self.owns(chosen):
            return []
        temporary = latest.with_name(f".{LATEST}.resurgo-tmp")
        temporary.write_text(chosen.name)
        os.replace(temporary, latest)
        return [f"{LATEST} now names {chosen.name} (was {tag})"]


LAYOUT = _DeepSpeed()
