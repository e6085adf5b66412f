"""What validating a checkpoint says: its depth (:class:`Level`) and outcome (:class:`Report`).

Torch-free, so that what only lists checkpoints or reads reports (the node
agent, the driver, the CLI) starts without importing torch;
:mod:`agent.checkpoint.validate` does the checking.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from agent.checkpoint import format as fmt


class Level(enum.Enum):
    """How deep validation goes; each level includes every level before it."""

    QUICK = "quick"
    FULL = "full"
    LOAD = "load"


@dataclass(frozen=True)
class Report:
    """The outcome of validating one checkpoint directory (a value, never an exception).

    ``checked`` lists the levels actually applied (a plain DCP directory never
    gets FULL); ``failed_level`` and ``reason`` name the first failure;
    ``skipped`` says, one sentence each, what did not apply and why.
    """

    path: str
    valid: bool
    level: Level
    checked: tuple[Level, ...]
    failed_level: Level | None
    reason: str | None
    step: int | None
    has_manifest: bool
    skipped: tuple[str, ...] = ()
    manifest: fmt.Manifest | None = field(default=None, compare=False, repr=False)

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-ready form with stable keys; enums by value; the manifest left out."""
        return {
            "path": self.path,
            "valid": self.valid,
            "level": self.level.value,
            "checked": [level.value for level in self.checked],
            "failed_level": None if self.failed_level is None else self.failed_level.value,
            "reason": self.reason,
            "step": self.step,
            "has_manifest": self.has_manifest,
            "skipped": list(self.skipped),
        }
