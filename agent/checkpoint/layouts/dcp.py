"""Resurgo's own ``step-N/`` checkpoints and plain DCP ``step-N/`` directories (torchtitan).

Both are ``torch.distributed.checkpoint`` directories; Resurgo's carry a
manifest and a commit marker besides. :mod:`agent.checkpoint.validate` runs
their ladder (checksums only where a manifest lists them).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from agent.checkpoint import format as fmt
from agent.checkpoint.layouts.base import Found, named_directories
from agent.checkpoint.report import Level, Report


class _Dcp:
    name = "dcp"

    def owns(self, path: Path) -> bool:
        return fmt.parse_step_dir_name(path.name) is not None and path.is_dir()

    def find(self, root: Path) -> Iterator[Found]:
        for child, step, mtime_s, total in named_directories(root, fmt.STEP_DIR):
            resurgo = (child / fmt.MANIFEST_NAME).is_file()
            complete = (child / (fmt.MARKER_NAME if resurgo else ".metadata")).is_file()
            layout = "resurgo" if resurgo else "dcp"
            yield Found(layout, str(child), child.name, step, mtime_s, total, complete)

    def check(self, path: Path, level: Level) -> Report:
        from agent.checkpoint.validate import validate  # torch: only where a check runs

        return validate(path, level)

    def steer(self, root: Path, chosen: Path | None) -> list[str]:
        return []  # the newest valid step-N is found by listing: nothing points at one


LAYOUT = _Dcp()
