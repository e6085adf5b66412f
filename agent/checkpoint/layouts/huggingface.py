"""Hugging Face ``Trainer`` checkpoints: ``checkpoint-N/`` directories in the output directory.

A checkpoint holds the model's weights (``model.safetensors``, or
``pytorch_model.bin``, or shards named by an ``*.index.json``, or a PEFT
adapter), the optimizer, scheduler and RNG states (``torch.save`` files) and
``trainer_state.json``, written last, whose ``global_step`` is the step the
Trainer resumes at. ``get_last_checkpoint`` takes the highest ``N`` among the
directories in the output directory, valid or not.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from agent.checkpoint.layouts import files_ladder
from agent.checkpoint.layouts.base import Found, Ladder, named_directories
from agent.checkpoint.report import Level, Report

_NAME = re.compile(r"^checkpoint-(\d+)$")
STATE = "trainer_state.json"
_WEIGHTS = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors",
            "adapter_model.bin")  # fmt: skip
_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_STATE_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt")


def trainer_step(directory: Path) -> int | None:
    """The ``global_step`` in a checkpoint's ``trainer_state.json`` (None: unreadable)."""
    try:
        state = json.loads((directory / STATE).read_bytes())
    except (OSError, ValueError):
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


class _HuggingFace:
    name = "huggingface"

    def owns(self, path: Path) -> bool:
        return _NAME.match(path.name) is not None and path.is_dir()

    def find(self, root: Path) -> Iterator[Found]:
        for child, named, mtime_s, total in named_directories(root, _NAME):
            step = trainer_step(child)
            complete = step is not None
            yield Found(self.name, str(child), child.name, named if step is None else step,
                        mtime_s, total, complete)  # fmt: skip

    def check(self, path: Path, level: Level) -> Report:
        ladder = Ladder(path, level, step=int(_NAME.match(path.name).group(1)))  # type: ignore[union-attr]
        if not (path / STATE).is_file():
            return ladder.fail(Level.QUICK, f"no {STATE}: the Trainer's save did not finish")
        step = trainer_step(path)
        if step is None:
            return ladder.fail(Level.QUICK, f"{STATE} has no global_step: cut short or corrupt")
        ladder.step = step
        weights = self._weights(path)
        if isinstance(weights, str):
            return ladder.fail(Level.QUICK, weights)
        states = [path / name for name in _STATE_FILES if (path / name).exists()]
        states += sorted(path.glob("rng_state*.pth"))
        return files_ladder.run(ladder, [path / STATE, *weights, *states])

    def _weights(self, path: Path) -> list[Path] | str:
        for index_name in _INDEXES:
            index = path / index_name
            if index.is_file():
                try:
                    weight_map = json.loads(index.read_bytes())["weight_map"]
                    shards = sorted(set(weight_map.values()))
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                    return f"{index_name} cannot be read ({error!r}): cut short or corrupt"
                if any("/" in shard or shard.startswith(".") for shard in shards):
                    return f"{index_name} names a shard outside the checkpoint"
                return [index, *(path / shard for shard in shards)]
        present = [path / name for name in _WEIGHTS if (path / name).exists()]
        if not present:
            return "no model weights (model.safetensors, pytorch_model.bin, shards or adapter)"
        return present

    def steer(self, root: Path, chosen: Path | None) -> list[str]:
        return []  # get_last_checkpoint lists the directories: a quarantined one is gone


LAYOUT = _HuggingFace()
