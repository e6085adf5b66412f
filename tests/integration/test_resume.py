"""Acceptance: a killed-and-resumed run is the run that never failed.

Real torchrun ranks (gloo, CPU, FSDP2) train tests/workers/train_worker.py with
a checkpoint every 5 steps. Each test compares an uninterrupted reference run
with a run SIGKILLed right after the step-20 checkpoint committed and resumed
from it by a fresh torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from agent.checkpoint.catalog import list_checkpoints

pytestmark = pytest.mark.slow

WORKER = Path(__file__).resolve().parents[1] / "workers" / "train_worker.py"
STEPS = 40
KILL_AFTER = 20


def train(root: Path, out: Path, ranks: int, *extra: str, expect_killed: bool = False) -> None:
    env = dict(os.environ, RESURGO_CKPT_EVERY_STEPS="5", OMP_NUM_THREADS="1")
    env.pop("RESURGO_RESUME_FROM", None)
    done = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", str(WORKER),
            "--root", str(root), "--out", str(out), "--steps", str(STEPS), *extra,
        ],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if expect_killed:
        assert done.returncode != 0, "the run was meant to be killed after step 20"
        assert "Signals.SIGKILL" in done.stderr or "-9" in done.stderr, done.stderr[-3000:]
    else:
        progress = {
            path.name: path.read_text().splitlines()[-1][:40]
            for path in sorted(out.glob("steps.rank*.jsonl"))
            if path.read_text()
        }
        assert done.returncode == 0, f"last steps {progress}\n{done.stderr[-5000:]}"


def steps(out: Path) -> dict[int, dict[str, Any]]:
    """Step -> record from rank 0's log (the last record wins for a repeated step)."""
    records = [json.loads(line) for line in (out / "steps.rank0.jsonl").read_text().splitlines()]
    return {record["step"]: record for record in records}


def final_state(out: Path) -> dict[str, Any]:
    return torch.load(out / "final.pt", weights_only=False)


def flat_tensors(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    if isinstance(tree, torch.Tensor):
        found[prefix] = tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            found.update(flat_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            found.update(flat_tensors(value, f"{prefix}[{index}]"))
    return found


def interrupted_then_resumed(tmp_path: Path, first: int, second: int, *extra: str) -> Path:
    root, out = tmp_path / "ckpt", tmp_path / "run"
    train(root, out, first, "--kill-after", str(KILL_AFTER), *extra, expect_killed=True)
    newest = list_checkpoints(root)[0]
    assert newest.step == KILL_AFTER and newest.committed
    assert max(steps(out)) == KILL_AFTER
    train(root, out, second, *extra)
    return out


def test_killed_and_resumed_run_is_bitwise_identical_to_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    reference = tmp_path / "reference"
    train(reference / "ckpt", reference / "run", 4, "--dropout", "0.1")
    resumed = interrupted_then_resumed(tmp_path / "faulted", 4, 4, "--dropout", "0.1")

    want, got = steps(reference / "run"), steps(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert got[step]["loss"] == want[step]["loss"], f"loss differs at step {step}"
        assert got[step]["samples"] == want[step]["samples"], f"data differs at step {step}"

    want_state = flat_tensors(final_state(reference / "run"))
    got_state = flat_tensors(final_state(resumed))
    assert want_state.keys() == got_state.keys()
    assert any(".exp_avg_sq" in key for key in want_state)  # optimizer state is compared too
    for key, tensor in want_state.items():
        assert torch.equal(got_state[key], tensor), f"{key} differs"


def test_resume_with_fewer_ranks_sees_the_same_global_samples_and_converges_alike(
    tmp_path: Path,
) -> None:
    """4 ranks -> 3 ranks (FSDP2, so DCP really reshards).

    The global sample sequence must be identical at every step. Parameters are
    compared within a tolerance: with 3 ranks FSDP2 reduce-scatters gradients
    over a different partition of the global batch, so float sums are taken in
    a different order (about 1e-7 relative per step, float32); over 20 AdamW
    steps that stays below 1e-4 absolute on parameters of order 0.1-1, while a
    skipped or repeated batch moves them by more than 1e-2.
    """
    reference = tmp_path / "reference"
    train(reference / "ckpt", reference / "run", 4)
    resumed = interrupted_then_resumed(tmp_path / "faulted", 4, 3)

    want, got = steps(reference / "run"), steps(resumed)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert {got[s]["world"] for s in range(KILL_AFTER + 1, STEPS + 1)} == {3}
    for step in range(1, STEPS + 1):
        assert got[step]["samples"] == want[step]["samples"], f"data differs at step {step}"
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-4, abs=1e-5)

    want_model = flat_tensors(final_state(reference / "run")["model"])
    got_model = flat_tensors(final_state(resumed)["model"])
    assert want_model.keys() == got_model.keys()
    for key, tensor in want_model.items():
        torch.testing.assert_close(got_model[key], tensor, rtol=1e-4, atol=1e-4, msg=key)
