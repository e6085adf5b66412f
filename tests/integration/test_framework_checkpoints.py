"""The checkpoints Hugging Face's Trainer and Lightning write themselves: found, stepped,
validated, and a broken newest one quarantined so that the unchanged script resumes from the
valid one before it.

The scripts (tests/frameworks/) import nothing of Resurgo and resume the way their docs show:
``trainer.train(resume_from_checkpoint=get_last_checkpoint(out))`` and
``trainer.fit(..., ckpt_path="last")``. Each runs under ``torchrun --standalone`` on CPU.
The same on a live cluster under ``resurgo submit``: tests/e2e/test_frameworks.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.checkpoint import layouts
from agent.checkpoint.quarantine import quarantine
from agent.checkpoint.report import Level

# Four real training runs (a minute and more): started first in their tier.
pytestmark = pytest.mark.long

FRAMEWORKS = Path(__file__).resolve().parents[1] / "frameworks"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def train(script: str, out: Path, steps: int) -> str:
    """Run a framework script to ``steps`` (saving every 20); its output."""
    result = subprocess.run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node=1", str(FRAMEWORKS / script),
         "--out", str(out), "--steps", str(steps), "--save-steps", "20"],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def first_step(output: str) -> int:
    return int(re.search(r"step (\d+) loss \S+ t \d", output).group(1))  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hf") / "out"
    train("hf_trainer.py", out, 45)
    return out


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pl") / "out"
    train("lightning_fit.py", out, 45)
    return out


def test_a_trainers_checkpoints_are_found_with_their_steps_and_pass_every_level(
    hf_run: Path,
) -> None:
    found = layouts.find_all(hf_run)
    assert [(f.layout, f.name, f.step) for f in found] == [
        ("huggingface", "checkpoint-45", 45), ("huggingface", "checkpoint-40", 40),
        ("huggingface", "checkpoint-20", 20),
    ]  # fmt: skip
    for checkpoint in found:
        report = layouts.check(checkpoint.path, Level.LOAD)
        assert report.valid and report.checked == (Level.QUICK, Level.FULL, Level.LOAD), report


def test_lightnings_checkpoints_are_found_with_their_steps_and_pass_every_level(
    lightning_run: Path,
) -> None:
    found = layouts.find_all(lightning_run)
    assert [(f.layout, f.name, f.step) for f in found] == [
        ("lightning", "last.ckpt", 40), ("lightning", "step=40.ckpt", 40),
        ("lightning", "step=20.ckpt", 20),
    ]  # fmt: skip
    for checkpoint in found:
        assert layouts.check(checkpoint.path, Level.LOAD).valid


def _newest_valid(root: Path) -> tuple[Path, dict[str, str]]:
    rejected = {}
    for found in layouts.find_all(root):
        report = layouts.check(found.path, Level.QUICK)
        if report.valid:
            return Path(found.path), rejected
        rejected[found.path] = str(report.reason)
    raise AssertionError(f"no valid checkpoint under {root}")


def test_a_trainer_whose_newest_checkpoint_is_cut_short_resumes_from_the_one_before(
    hf_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(hf_run, out)
    weights = out / "checkpoint-45" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    chosen, rejected = _newest_valid(out)
    assert chosen.name == "checkpoint-40"
    assert list(rejected) == [str(out / "checkpoint-45")]
    moves, _ = quarantine(out, rejected, str(chosen))
    assert [move.source for move in moves] == ["checkpoint-45"]
    output = train("hf_trainer.py", out, 50)
    assert f"resume from {chosen}" in output
    assert first_step(output) == 41  # its own trainer_state.json said 40


def test_lightning_whose_last_ckpt_is_cut_short_resumes_from_the_newest_valid_one(
    lightning_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(lightning_run, out)
    last = out / "last.ckpt"
    os.truncate(last, last.stat().st_size // 3)
    chosen, rejected = _newest_valid(out)
    assert chosen.name == "step=40.ckpt" and list(rejected) == [str(last)]
    _, steered = quarantine(out, rejected, str(chosen))
    assert steered == ["last.ckpt is now a copy of step=40.ckpt"]
    output = train("lightning_fit.py", out, 50)
    assert first_step(output) == 41
