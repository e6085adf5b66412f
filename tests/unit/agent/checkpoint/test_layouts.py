"""Checkpoint layouts: each framework's checkpoints found, stepped and validated by level.

Built with the real writers (``torch.save``, ``safetensors``), then broken the
ways saves break: cut short, a flipped byte, a file missing. The same layouts
on checkpoints the frameworks themselves wrote: tests/integration/test_framework_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from agent.checkpoint import layouts
from agent.checkpoint.layouts.safetensors import check_safetensors
from agent.checkpoint.layouts.torchfile import check_zip, peek
from agent.checkpoint.report import Level
from tests.ckpt_helpers import make_committed_checkpoint
from tests.fakes.checkpoints import WEIGHTS, cut, flip, hf_checkpoint, lightning_file

# --- the file checks -----------------------------------------------------------------------


def test_a_safetensors_file_cut_short_or_padded_is_told_apart_by_its_header(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file(WEIGHTS, path)
    assert check_safetensors(path) is None
    data = path.read_bytes()
    path.write_bytes(data + b"\0")
    assert "trailing bytes" in str(check_safetensors(path))
    path.write_bytes(data[: len(data) - 10])
    assert "truncated" in str(check_safetensors(path))
    path.write_bytes(data[:20])
    assert "truncated" in str(check_safetensors(path))


def test_a_torch_file_cut_short_fails_quick_and_a_flipped_byte_fails_its_crc(
    tmp_path: Path,
) -> None:
    path = tmp_path / "ckpt.pt"
    torch.save(WEIGHTS, path)
    assert check_zip(path, crc=True) is None
    flip(path, 0.6)
    assert check_zip(path, crc=False) is None  # the central directory is still whole
    assert "CRC-32" in str(check_zip(path, crc=True))
    cut(path)
    assert "not a whole zip archive" in str(check_zip(path, crc=False))


class _Boom:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, ("touch /tmp/resurgo-peek-ran-code",))


def test_peek_reads_the_step_and_never_runs_code_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 120, "hyper_parameters": {"lr": 0.1}, "w": torch.ones(3)}, path)
    assert peek(path) == {"global_step": 120, "hyper_parameters": {"lr": 0.1}, "w": None}
    marker = Path("/tmp/resurgo-peek-ran-code")
    marker.unlink(missing_ok=True)
    torch.save({"step": 7, "evil": _Boom()}, path, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    state = peek(path)
    assert state is not None and state["step"] == 7
    assert not marker.exists()


# --- the layouts --------------------------------------------------------------------------


def test_every_layout_is_found_with_its_step_and_name(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path / "hf", 40)
    lightning_file(tmp_path / "pl" / "lightning_logs" / "version_0" / "checkpoints"
                   / "epoch=0-step=60.ckpt", 60, 1_700_000_000)  # fmt: skip
    lightning_file(tmp_path / "pl" / "last.ckpt", 60, 1_700_000_100)
    ds = tmp_path / "ds" / "global_step30"
    ds.mkdir(parents=True)
    torch.save({"module": WEIGHTS}, ds / "mp_rank_00_model_states.pt")
    (tmp_path / "nano").mkdir()
    torch.save({"iter_num": 250, "model": WEIGHTS}, tmp_path / "nano" / "ckpt.pt")
    make_committed_checkpoint(tmp_path / "own", 10)
    seen = {
        root: [(f.layout, f.name, f.step, f.complete) for f in layouts.find_all(tmp_path / root)]
        for root in ("hf", "pl", "ds", "nano", "own")
    }
    assert seen == {
        "hf": [("huggingface", "checkpoint-40", 40, True)],
        "pl": [
            ("lightning", "last.ckpt", 60, True),
            ("lightning", "lightning_logs/version_0/checkpoints/epoch=0-step=60.ckpt", 60, True),
        ],
        "ds": [("deepspeed", "global_step30", 30, True)],
        "nano": [("torch_save", "ckpt.pt", 250, True)],
        "own": [("resurgo", "step-10", 10, True)],
    }
    for root in seen:
        for found in layouts.find_all(tmp_path / root):
            report = layouts.check(found.path, Level.FULL)
            assert report.valid and report.step == found.step, report


def test_a_hugging_face_checkpoint_with_truncated_weights_is_rejected_at_quick(
    tmp_path: Path,
) -> None:
    hf_checkpoint(tmp_path, 20)
    broken = hf_checkpoint(tmp_path, 40)
    cut(broken / "model.safetensors")
    report = layouts.check(broken, Level.QUICK)
    assert not report.valid and report.failed_level is Level.QUICK
    assert "model.safetensors" in str(report.reason) and "truncated" in str(report.reason)


@pytest.mark.parametrize(
    ("damage", "failed", "words"),
    [
        (lambda d: (d / "trainer_state.json").unlink(), Level.QUICK, "did not finish"),
        (lambda d: (d / "trainer_state.json").write_text("{"), Level.QUICK, "global_step"),
        (lambda d: (d / "model.safetensors").unlink(), Level.QUICK, "no model weights"),
        (lambda d: cut(d / "optimizer.pt"), Level.QUICK, "optimizer.pt: not a whole zip"),
        (lambda d: flip(d / "optimizer.pt", 0.5), Level.FULL, "optimizer.pt: its bytes"),
    ],
)
def test_each_way_a_hugging_face_save_breaks_is_named(
    tmp_path: Path, damage: object, failed: Level, words: str
) -> None:
    directory = hf_checkpoint(tmp_path, 40)
    damage(directory)  # type: ignore[operator]
    report = layouts.check(directory, Level.LOAD)
    assert not report.valid and report.failed_level is failed, report
    assert words in str(report.reason), report.reason


def test_sharded_hugging_face_weights_are_checked_shard_by_shard(tmp_path: Path) -> None:
    directory = hf_checkpoint(tmp_path, 40)
    (directory / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({"layer.weight": WEIGHTS["layer.weight"]}, directory / first)
    save_file({"layer.bias": WEIGHTS["layer.bias"]}, directory / second)
    index = {"weight_map": {"layer.weight": first, "layer.bias": second}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert layouts.check(directory, Level.FULL).valid
    (directory / "model-00002-of-00002.safetensors").unlink()
    report = layouts.check(directory, Level.QUICK)
    assert not report.valid and f"{second}: missing" in str(report.reason)


def test_a_lightning_last_ckpt_cut_short_is_tried_first_and_rejected(tmp_path: Path) -> None:
    lightning_file(tmp_path / "step=20.ckpt", 20, 1_700_000_000)
    lightning_file(tmp_path / "step=40.ckpt", 40, 1_700_000_100)
    last = lightning_file(tmp_path / "last.ckpt", 40, 1_700_000_200)
    cut(last)
    found = layouts.find_all(tmp_path)
    # Its step unreadable, the newest file still comes first: it is what ckpt_path="last" loads.
    assert [(f.name, f.step, f.complete) for f in found] == [
        ("last.ckpt", None, False), ("step=40.ckpt", 40, True), ("step=20.ckpt", 20, True),
    ]  # fmt: skip
    assert not layouts.check(last, Level.QUICK).valid
    assert layouts.check(tmp_path / "step=40.ckpt", Level.LOAD).valid


def test_a_deepspeed_tag_without_model_states_is_an_unfinished_save(tmp_path: Path) -> None:
    tag = tmp_path / "global_step30"
    tag.mkdir()
    torch.save({"optimizer": {}}, tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    report = layouts.check(tag, Level.QUICK)
    assert not report.valid and "model_states" in str(report.reason)


def test_a_torch_save_file_in_the_root_that_is_no_checkpoint_is_not_listed(tmp_path: Path) -> None:
    torch.save({"lr": 0.1}, tmp_path / "training_args.bin")
    hf_checkpoint(tmp_path, 20)
    assert [f.name for f in layouts.find_all(tmp_path)] == ["checkpoint-20"]


def test_nothing_in_the_quarantine_directory_is_found(tmp_path: Path) -> None:
    hold = tmp_path / layouts.QUARANTINE_DIR
    lightning_file(hold / "last.ckpt.1700000000", 40, 1_700_000_000)
    hf_checkpoint(hold, 40)
    lightning_file(hold / "step=40.ckpt", 40, 1_700_000_000)
    assert layouts.find_all(tmp_path) == []
