"""Node rank 0's scan of the checkpoint root: each checkpoint a framework wrote itself
reported once, when complete; a rewritten last.ckpt again; nothing that lay there before."""

from __future__ import annotations

import os
from pathlib import Path

from agent.node.ckptscan import CheckpointScan
from tests.ckpt_helpers import make_committed_checkpoint
from tests.fakes.checkpoints import hf_checkpoint, lightning_file


def test_new_complete_checkpoints_are_reported_once_and_a_rewritten_one_again(
    tmp_path: Path,
) -> None:
    lightning_file(tmp_path / "step=20.ckpt", 20, 1_700_000_000)
    scan = CheckpointScan(tmp_path)
    assert scan.new() == []  # there before the agent started
    last = lightning_file(tmp_path / "last.ckpt", 40, 1_700_000_100)
    lightning_file(tmp_path / "step=40.ckpt", 40, 1_700_000_050)
    assert [(f.name, f.step) for f in scan.new()] == [("step=40.ckpt", 40), ("last.ckpt", 40)]
    assert scan.new() == []
    lightning_file(last, 60, 1_700_000_200)  # rewritten at the next save
    assert [(f.name, f.step) for f in scan.new()] == [("last.ckpt", 60)]


def test_a_save_in_progress_waits_and_resurgos_own_commits_are_left_to_their_event(
    tmp_path: Path,
) -> None:
    scan = CheckpointScan(tmp_path)
    directory = hf_checkpoint(tmp_path, 20)
    state = directory / "trainer_state.json"
    text = state.read_text()
    state.unlink()  # the Trainer writes it last
    make_committed_checkpoint(tmp_path, 30)
    assert scan.new() == []
    state.write_text(text)
    os.utime(directory, (1_700_000_300, 1_700_000_300))
    assert [(f.name, f.step) for f in scan.new()] == [("checkpoint-20", 20)]


def test_what_the_ranks_noted_themselves_is_not_reported_again(tmp_path: Path) -> None:
    """DCP saves and torch.save files are noted by the bootstrap; a Trainer's directory once
    its torch.save of optimizer.pt was noted."""
    from tests.ckpt_helpers import save_plain_dcp, small_state

    scan = CheckpointScan(tmp_path)
    save_plain_dcp(tmp_path / "step-10", small_state(10))
    noted = hf_checkpoint(tmp_path, 20)
    unnoted = hf_checkpoint(tmp_path, 40)
    assert [f.name for f in scan.new(noted={str(noted)})] == [unnoted.name]
