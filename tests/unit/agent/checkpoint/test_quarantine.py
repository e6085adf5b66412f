"""Quarantine: rejected checkpoints moved aside inside the root, the frameworks steered to the
chosen one, every move recorded and reversible, nothing outside the root touched."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent.checkpoint import layouts
from agent.checkpoint.quarantine import quarantine, quarantined, release
from agent.wire.errors import ConfigError
from supervisor.cli.main import main
from tests.fakes.checkpoints import hf_checkpoint, lightning_file

NOW = 1_700_000_500.0


def test_a_rejected_hugging_face_checkpoint_is_moved_so_get_last_checkpoint_finds_the_valid_one(
    tmp_path: Path,
) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    hf_checkpoint(tmp_path, 20)
    broken = hf_checkpoint(tmp_path, 40)
    assert get_last_checkpoint(str(tmp_path)) == str(broken)
    moves, steered = quarantine(tmp_path, {str(broken): "model.safetensors: truncated"},
                                str(tmp_path / "checkpoint-20"), NOW)  # fmt: skip
    assert [(m.source, m.target) for m in moves] == [
        ("checkpoint-40", ".resurgo-quarantine/checkpoint-40.1700000500")
    ]
    assert steered == []
    assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-20")
    assert [f.name for f in layouts.find_all(tmp_path)] == ["checkpoint-20"]
    assert (
        tmp_path / ".resurgo-quarantine" / "checkpoint-40.1700000500" / "optimizer.pt"
    ).is_file()


def test_a_quarantined_last_ckpt_is_replaced_by_a_copy_of_the_chosen_checkpoint(
    tmp_path: Path,
) -> None:
    chosen = lightning_file(tmp_path / "step=40.ckpt", 40, 1_700_000_100)
    last = lightning_file(tmp_path / "last.ckpt", 60, 1_700_000_200)
    last.write_bytes(last.read_bytes()[:100])
    _, steered = quarantine(tmp_path, {str(last): "cut short"}, str(chosen), NOW)
    assert steered == ["last.ckpt is now a copy of step=40.ckpt"]
    assert not last.is_symlink() and last.read_bytes() == chosen.read_bytes()
    # What Lightning's ckpt_path="last" now loads holds the chosen step.
    assert torch.load(last, weights_only=True)["global_step"] == 40


def test_a_rollback_finds_every_checkpoint_newer_than_the_one_it_resumes_from(
    tmp_path: Path,
) -> None:
    from agent.checkpoint.quarantine import newer_than

    for step in (20, 40, 60):
        lightning_file(tmp_path / f"step={step}.ckpt", step, 1_700_000_000 + step)
    last = lightning_file(tmp_path / "last.ckpt", 60, 1_700_000_100)
    aside = newer_than(tmp_path, 20)
    assert sorted(Path(p).name for p in aside) == ["last.ckpt", "step=40.ckpt", "step=60.ckpt"]
    assert aside[str(last)].startswith("step 60 lies past the rollback to step 20")
    _, steered = quarantine(tmp_path, aside, str(tmp_path / "step=20.ckpt"), NOW)
    assert steered == ["last.ckpt is now a copy of step=20.ckpt"]
    assert torch.load(last, weights_only=True)["global_step"] == 20
    assert newer_than(tmp_path, 20) == {}


def test_deepspeeds_latest_is_pointed_at_the_chosen_tag(tmp_path: Path) -> None:
    for step in (30, 60):
        tag = tmp_path / f"global_step{step}"
        tag.mkdir()
        torch.save({"module": {}}, tag / "mp_rank_00_model_states.pt")
    (tmp_path / "latest").write_text("global_step60")
    _, steered = quarantine(tmp_path, {str(tmp_path / "global_step60"): "cut short"},
                            str(tmp_path / "global_step30"), NOW)  # fmt: skip
    assert (tmp_path / "latest").read_text() == "global_step30"
    assert steered == ["latest now names global_step30 (was global_step60)"]


def test_a_path_outside_the_root_or_through_a_link_out_of_it_is_never_moved(
    tmp_path: Path,
) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    victim = hf_checkpoint(elsewhere, 40)
    (root / "out").symlink_to(elsewhere)
    paths = (victim, root / "out" / "checkpoint-40", root / ".." / "elsewhere" / "checkpoint-40")
    moves, _ = quarantine(root, {str(path): "x" for path in paths}, None, NOW)
    assert moves == [] and victim.is_dir()


def test_a_move_is_recorded_and_released_back_by_its_name(tmp_path: Path) -> None:
    broken = hf_checkpoint(tmp_path, 40)
    quarantine(tmp_path, {str(broken): "truncated"}, None, NOW)
    # Asked twice (a driver that retried): the second is a no-op.
    assert quarantine(tmp_path, {str(broken): "truncated"}, None, NOW + 1)[0] == []
    [held] = quarantined(tmp_path)
    assert (held.source, held.reason) == ("checkpoint-40", "truncated")
    record = (tmp_path / ".resurgo-quarantine" / "moves.jsonl").read_text().splitlines()
    assert [json.loads(line)["source"] for line in record] == ["checkpoint-40"]
    release(tmp_path, "checkpoint-40")
    assert broken.is_dir() and quarantined(tmp_path) == []
    with pytest.raises(ConfigError, match="no checkpoint 'checkpoint-40' in quarantine"):
        release(tmp_path, "checkpoint-40")


def test_release_refuses_to_overwrite_a_newer_save_of_the_same_name(tmp_path: Path) -> None:
    broken = hf_checkpoint(tmp_path, 40)
    quarantine(tmp_path, {str(broken): "truncated"}, None, NOW)
    hf_checkpoint(tmp_path, 40)  # the resumed run saved checkpoint-40 again
    with pytest.raises(ConfigError, match="exists again"):
        release(tmp_path, "checkpoint-40")


def test_the_cli_lists_and_releases_quarantined_checkpoints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = hf_checkpoint(tmp_path, 40)
    quarantine(tmp_path, {str(broken): "model.safetensors: truncated"}, None, NOW)
    assert main(["ckpt", "quarantined", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "checkpoint-40" in out and "model.safetensors: truncated" in out
    assert "resurgo ckpt release" in out
    assert main(["ckpt", "release", str(tmp_path), "checkpoint-9"]) == 1
    assert "held: checkpoint-40" in capsys.readouterr().err
    assert main(["ckpt", "release", str(tmp_path), "checkpoint-40"]) == 0
    assert broken.is_dir()
