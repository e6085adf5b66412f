"""CUDA paths of the checkpoint library; run wherever a GPU is present, skipped visibly elsewhere.

Run on a GPU machine with ``deploy/test -m gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from agent.checkpoint import format as fmt
from agent.checkpoint.save import Checkpointer, SaveMode
from agent.checkpoint.validate import Level, validate
from agent.train.rng import capture_rng_state, restore_rng_state

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def test_cuda_tensors_stage_through_pinned_memory_and_save_exactly(tmp_path: Path) -> None:
    state = {"w": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(7, device="cuda")}
    expected = {key: value.clone() for key, value in state.items()}
    checkpointer = Checkpointer(tmp_path)
    assert checkpointer._stager is not None
    # Pinned host buffers make the device-to-host copy a DMA the GPU can overlap.
    assert checkpointer._stager._config.use_pinned_memory
    result = checkpointer.save(1, state, [fmt.StateKind.MODEL])
    assert result.mode is SaveMode.ASYNC
    for value in state.values():
        value.add_(1.0)  # the training loop moves on while the write runs
    checkpointer.close()
    assert validate(result.path, Level.FULL).valid
    loaded = {key: torch.zeros_like(value) for key, value in expected.items()}
    dcp.load(loaded, checkpoint_id=str(result.path))
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key


def test_every_devices_rng_is_restored(tmp_path: Path) -> None:
    saved = capture_rng_state()
    want = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    restore_rng_state(saved)
    got = [torch.rand(4, device=f"cuda:{d}") for d in range(torch.cuda.device_count())]
    for device, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"cuda:{device}"
