"""What the bootstrap notes of a DCP save, from the call alone (no process group here:
every process saves alone, so it is its own coordinator)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.train.autohooks import AutoProgress, step_in_name


@pytest.mark.parametrize(
    ("path", "step"),
    [
        ("/out/step-120", 120),
        ("/out/step-120/", 120),
        ("/out/checkpoint-7", 7),
        ("/out/global_step300", 300),
        ("/out/iter_0042", 42),
        ("/out/latest", None),
        ("/out/step-120/final", None),
        ("/out/ckpt.pt", None),
    ],
)
def test_the_step_a_checkpoint_directory_is_named_for(path: str, step: int | None) -> None:
    assert step_in_name(path) == step


class Writer:
    """Shaped like DCP's FileSystemWriter, which keeps its directory as ``.path``."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)


ROOT = "/ckpt/job"


@pytest.mark.parametrize(
    ("args", "kwargs", "note"),
    [
        (({"step": 30},), {"checkpoint_id": f"{ROOT}/step-120"}, (f"{ROOT}/step-120", 30)),
        (({},), {"checkpoint_id": f"{ROOT}/step-120"}, (f"{ROOT}/step-120", 120)),
        ((), {"state_dict": {}, "storage_writer": Writer(f"{ROOT}/a")}, (f"{ROOT}/a", 5)),
        (({},), {"checkpoint_id": ROOT}, (ROOT, 5)),
        (({},), {"checkpoint_id": "/ckpt/jobs-other/step-1"}, None),
        (({},), {"checkpoint_id": "s3://bucket/ckpt/job/step-1"}, None),
        (({},), {}, None),
    ],
)
def test_a_dcp_save_is_noted_with_its_directory_and_step_only_under_the_root(
    monkeypatch: pytest.MonkeyPatch,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    note: tuple[str, int] | None,
) -> None:
    monkeypatch.setenv("RESURGO_CKPT_ROOT", ROOT)
    progress = AutoProgress(beats=None)  # type: ignore[arg-type]  # dcp_note sends nothing
    progress.step = 5
    assert progress.dcp_note(args, kwargs) == note
