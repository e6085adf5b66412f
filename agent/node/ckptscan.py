"""Checkpoints a framework wrote itself, found by looking: node rank 0's agent scans the root.

The bootstrap notes a ``torch.save`` to a path under the checkpoint root, but
not every framework saves that way: Lightning serializes into a buffer and
writes the bytes itself, DeepSpeed and Hugging Face write safetensors through
their own writers. Every :data:`SCAN_S` the agent of node rank 0 lists the
root by :mod:`agent.checkpoint.layouts` and reports each checkpoint that is
new or rewritten since (Lightning's ``last.ckpt`` is rewritten at each save),
complete, and of a known step, as ``checkpoint_written``. What lay there when
the agent started was reported by an earlier one. What the ranks note
themselves is not reported twice: Resurgo's commits, DCP saves and
``torch.save`` files (:data:`SEEN_BY_HOOKS`), and a Trainer's or DeepSpeed's
directory the bootstrap already noted by a ``torch.save`` into it. The agent
looks once more when its launcher has ended: a run's last save is written
after its last periodic look.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from pathlib import Path

from agent.checkpoint import layouts
from agent.checkpoint.layouts import Found

log = logging.getLogger(__name__)

SCAN_S = 10.0
# Layouts whose every save the ranks note themselves: Resurgo's commits, and the
# bootstrap's notes of a dcp.save and of a torch.save to a path.
SEEN_BY_HOOKS = frozenset({"resurgo", "dcp", "torch_save"})


class CheckpointScan:
    """The checkpoints under one root not yet reported (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self._root = Path(root)
        self._seen = {self._key(found) for found in self._list()}

    def new(self, noted: Collection[str] = ()) -> list[Found]:
        """Complete checkpoints of a known step written or rewritten since the last call,
        but for those the ranks' own notes reported (``noted``: their paths)."""
        fresh = []
        for found in self._list():
            key = self._key(found)
            if key in self._seen or found.layout in SEEN_BY_HOOKS:
                continue
            if not found.complete or found.step is None:
                continue  # a save in progress is looked at again next time
            self._seen.add(key)
            if found.path not in noted:
                fresh.append(found)
        return sorted(fresh, key=lambda found: found.mtime_s)

    def _list(self) -> list[Found]:
        try:
            return layouts.find_all(self._root)
        except OSError as error:
            log.warning("could not list checkpoints under %s: %s", self._root, error)
            return []

    @staticmethod
    def _key(found: Found) -> tuple[str, float]:
        return found.path, found.mtime_s
