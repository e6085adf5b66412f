"""Acceptance: a killed-and-resumed run is the run that never failed.

Real torchrun ranks (gloo, CPU, FSDP2) train tests/workers/train_worker.py with
a checkpoint every 5 steps. Each test compares an uninterrupted reference run
with a run SIGKILLed right after the step-20 checkpoint committed and resumed
from it by a fresh torchrun.

Training is seeded, so a relaunch that ignored the checkpoint and trained
from step 1 again would log the same records. Each check therefore first
reads what every rank loaded (``loads.rank<r>.jsonl``: the step-20
checkpoint, the world size that saved it and the one that loads it) and that
the relaunch's own first step is 21; only then are its steps and final state
compared with the reference. Resumes broken on purpose (no restore, RNGs,
optimizer moments or data cursor left out) must fail those same checks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
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


def records(out: Path) -> list[dict[str, Any]]:
    """Rank 0's step records, in the order written (every run appends)."""
    return [json.loads(line) for line in (out / "steps.rank0.jsonl").read_text().splitlines()]


def steps(out: Path) -> dict[int, dict[str, Any]]:
    """Step -> record from rank 0's log (the last record wins for a repeated step)."""
    return {record["step"]: record for record in records(out)}


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


@dataclass(frozen=True)
class Killed:
    """A run SIGKILLed just after its step-20 checkpoint committed."""

    root: Path
    out: Path
    ranks: int
    extra: tuple[str, ...]


def killed_run(where: Path, ranks: int, *extra: str) -> Killed:
    root, out = where / "ckpt", where / "run"
    train(root, out, ranks, "--kill-after", str(KILL_AFTER), *extra, expect_killed=True)
    newest = list_checkpoints(root)[0]
    assert newest.step == KILL_AFTER and newest.committed
    assert max(steps(out)) == KILL_AFTER
    return Killed(root, out, ranks, extra)


def resume(killed: Killed, where: Path, ranks: int, *broken: str) -> tuple[Path, Path, int]:
    """A fresh torchrun of ``ranks`` on a copy of ``killed``: (root, out, records before it)."""
    root, out = where / "ckpt", where / "run"
    if "restore" in broken:
        root.mkdir(parents=True)  # a relaunch that looks elsewhere starts afresh
    else:
        shutil.copytree(killed.root, root)
    shutil.copytree(killed.out, out)
    before = len(records(out))
    # The copy's checkpoints name their own directory: the paths in a manifest are relative.
    train(root, out, ranks, *killed.extra, *broken)
    return root, out, before


def check_resumed(
    root: Path, out: Path, before: int, reference: Path, saved: int, world: int, exact: bool
) -> None:
    """The relaunch loaded step 20 on every rank, trained 21..40 only, and matches ``reference``."""
    for rank in range(world):
        lines = (out / f"loads.rank{rank}.jsonl").read_text().splitlines()
        loaded = json.loads(lines[-1])
        want = {"path": str(root / "step-20"), "step": KILL_AFTER,
                "saved_world_size": saved, "world_size": world}  # fmt: skip
        assert loaded == want, f"rank {rank} loaded {loaded}"
    relaunched = [record["step"] for record in records(out)[before:]]
    assert relaunched == list(range(KILL_AFTER + 1, STEPS + 1)), (
        f"the relaunch trained steps {relaunched[:3]}..{relaunched[-1:]}, not 21..40"
    )
    want_steps, got_steps = steps(reference), steps(out)
    assert {got_steps[s]["world"] for s in range(KILL_AFTER + 1, STEPS + 1)} == {world}
    for step in range(1, STEPS + 1):
        got, want_record = got_steps[step], want_steps[step]
        assert got["samples"] == want_record["samples"], f"data differs at step {step}"
        if exact:
            assert got["loss"] == want_record["loss"], f"loss differs at step {step}"
        else:
            assert got["loss"] == pytest.approx(want_record["loss"], rel=1e-4, abs=1e-5), (
                f"loss differs at step {step}"
            )
    want_state, got_state = flat_tensors(final_state(reference)), flat_tensors(final_state(out))
    assert want_state.keys() == got_state.keys()
    assert any(".exp_avg_sq" in key for key in want_state)  # optimizer state is compared too
    for key, tensor in want_state.items():
        if exact:
            assert torch.equal(got_state[key], tensor), f"{key} differs"
        else:
            torch.testing.assert_close(got_state[key], tensor, rtol=1e-4, atol=1e-4, msg=key)


@pytest.fixture(scope="module")
def dropout_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Killed]:
    """4 ranks with dropout (the RNG matters): the reference and the killed run."""
    where = tmp_path_factory.mktemp("dropout")
    train(where / "reference" / "ckpt", where / "reference" / "run", 4, "--dropout", "0.1")
    return where / "reference" / "run", killed_run(where / "faulted", 4, "--dropout", "0.1")


def test_killed_and_resumed_run_is_bitwise_identical_to_the_uninterrupted_one(
    dropout_runs: tuple[Path, Killed], tmp_path: Path
) -> None:
    reference, killed = dropout_runs
    root, out, before = resume(killed, tmp_path, 4)
    check_resumed(root, out, before, reference, saved=4, world=4, exact=True)


@pytest.mark.parametrize(
    ("broken", "caught"),
    [
        ("restore", "loaded {'path': None}"),  # a fresh start from step 1
        ("rng", "loss differs at step 21"),  # other dropout masks from the first step
        ("optimizer", "loss differs at step 22"),  # AdamW's moments start over at 21
        ("cursor", "data differs at step 21"),  # the epoch's first batch again
    ],
)
def test_a_resume_broken_on_purpose_fails_the_same_checks(
    dropout_runs: tuple[Path, Killed], tmp_path: Path, broken: str, caught: str
) -> None:
    reference, killed = dropout_runs
    root, out, before = resume(killed, tmp_path, 4, "--break", broken)
    with pytest.raises(AssertionError, match=re.escape(caught)):
        check_resumed(root, out, before, reference, saved=4, world=4, exact=True)


def test_resume_with_fewer_ranks_reshards_and_sees_the_same_global_samples(
    tmp_path: Path,
) -> None:
    """4 ranks -> 3 ranks (FSDP2, so DCP really reshards): every rank of the 3 loaded the
    step-20 checkpoint that 4 ranks saved, and trained 21..40 only.

    The global sample sequence must be identical at every step. Losses and
    parameters are compared within a tolerance: with 3 ranks FSDP2
    reduce-scatters gradients over a different partition of the global batch,
    so float sums are taken in a different order (about 1e-7 relative per step,
    float32); over 20 AdamW steps that stays below 1e-4 absolute on parameters
    of order 0.1-1, while a skipped or repeated batch moves them by more than
    1e-2.
    """
    reference = tmp_path / "reference"
    train(reference / "ckpt", reference / "run", 4)
    killed = killed_run(tmp_path / "faulted", 4)
    root, out, before = resume(killed, tmp_path / "resumed", 3)
    check_resumed(root, out, before, reference / "run", saved=4, world=3, exact=False)
