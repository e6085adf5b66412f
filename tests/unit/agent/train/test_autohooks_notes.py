"""What the bootstrap notes of a DCP save, from the call alone (no process group here:
every process saves alone, so it is its own coordinator)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint.layouts import step_in_path
from agent.train.autohooks import AutoProgress


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
        ("/out/epoch=2-step=120.ckpt", 120),
        ("/out/step=40.ckpt", 40),
        ("/out/last.ckpt", None),
    ],
)
def test_the_step_a_checkpoint_is_named_for(path: str, step: int | None) -> None:
    assert step_in_path(path) == step


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


class Beats:
    """Records what the bootstrap would tell the agent."""

    def __init__(self) -> None:
        self.written: list[tuple[str, int | None]] = []
        self.beats: list[int] = []

    def file_written(self, path: str, step: int | None = None) -> None:
        self.written.append((path, step))

    def beat(self, step: int, phase: object = None) -> None:
        self.beats.append(step)


@pytest.mark.parametrize(
    ("saved", "note"),
    [
        # A Hugging Face checkpoint's state files: the checkpoint, with the step its name gives.
        (f"{ROOT}/checkpoint-60/rng_state.pth", (f"{ROOT}/checkpoint-60", 60)),
        (f"{ROOT}/checkpoint-60/optimizer.pt", (f"{ROOT}/checkpoint-60", 60)),
        (f"{ROOT}/global_step60/mp_rank_00_model_states.pt", (f"{ROOT}/global_step60", 60)),
        # A file in the root (nanoGPT), or in a directory that names no step: itself.
        (f"{ROOT}/ckpt.pt", (f"{ROOT}/ckpt.pt", None)),
        (f"{ROOT}/run/model.pt", (f"{ROOT}/run/model.pt", None)),
    ],
)
def test_a_file_saved_into_a_checkpoint_directory_is_noted_as_that_checkpoint(
    monkeypatch: pytest.MonkeyPatch, saved: str, note: tuple[str, int | None]
) -> None:
    monkeypatch.setenv("RESURGO_CKPT_ROOT", ROOT)
    beats = Beats()
    progress = AutoProgress(beats=beats)  # type: ignore[arg-type]
    progress.saved(saved)
    assert beats.written == [note]


def test_a_trainer_resuming_from_checkpoint_40_counts_on_from_step_40(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its step is in trainer_state.json, which torch.load never reads; its optimizer.pt is."""
    from agent.train import heartbeat

    monkeypatch.setenv("RESURGO_CKPT_ROOT", ROOT)
    # Not a rank of the in-rank library (an earlier test in this process may have made one).
    monkeypatch.setattr(heartbeat, "instrumented", False)
    beats = Beats()
    progress = AutoProgress(beats=beats)  # type: ignore[arg-type]
    progress.resumed_at({"state": {}, "param_groups": []}, f"{ROOT}/checkpoint-40/optimizer.pt")
    assert progress.step == 40 and beats.beats == [40]
    # A dict that names its step says it better than a name.
    progress.resumed_at({"iter_num": 7}, f"{ROOT}/checkpoint-40/other.pt")
    assert progress.step == 7
