"""Real DCP checkpoints for tests, with the Resurgo manifest and marker written
the way the checkpoint writer does (``agent.checkpoint.save`` is not imported:
these helpers mimic it with the same format and file primitives).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from agent.checkpoint import files
from agent.checkpoint import format as fmt

CREATED_UNIX_S = 1_700_000_000.0


def small_state(seed: int = 0) -> dict[str, Any]:
    """A small training-like state: float tensors, an int tensor, plain objects."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "w": torch.randn(16, 8, generator=generator),
            "b": torch.randn(8, generator=generator),
        },
        "optimizer": {"exp_avg": torch.randn(16, 8, generator=generator)},
        "counts": torch.arange(10),
        "step": seed,
        "data_position": {"consumed": 1024 * seed, "epoch": 0},
    }


def save_plain_dcp(directory: Path, state: dict[str, Any], thread_count: int = 2) -> Path:
    """``dcp.save`` into a fresh ``directory`` in one process (no process group)."""
    directory.mkdir(parents=True, exist_ok=False)
    with warnings.catch_warnings():
        # DCP warns that it assumes a single process when no group exists: it does.
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=FileSystemWriter(directory, thread_count=thread_count))
    return directory


def write_manifest_and_marker(
    directory: Path, step: int, stats: fmt.SaveStats | None = None, world_size: int = 1
) -> fmt.Manifest:
    """Describe every DCP file of ``directory``, then write manifest and marker durably."""
    names = sorted(
        child.name
        for child in directory.iterdir()
        if child.name.endswith(fmt.DCP_DATA_SUFFIX) or child.name == fmt.DCP_METADATA_NAME
    )
    manifest = fmt.Manifest(
        step=step,
        world_size=world_size,
        contents=(fmt.StateKind.MODEL, fmt.StateKind.OPTIMIZER, fmt.StateKind.STEP),
        files=tuple(files.describe_file(directory, name) for name in names),
        created_unix_s=CREATED_UNIX_S,
        stats=stats,
    )
    data = fmt.manifest_to_bytes(manifest)
    files.write_durably(directory / fmt.MANIFEST_NAME, data)
    files.write_durably(directory / fmt.MARKER_NAME, fmt.marker_bytes(data))
    return manifest


def make_committed_checkpoint(
    root: Path,
    step: int,
    state: dict[str, Any] | None = None,
    stats: fmt.SaveStats | None = None,
    world_size: int = 1,
) -> Path:
    """A committed Resurgo checkpoint ``root/step-<step>/``; returns its path."""
    directory = save_plain_dcp(
        root / fmt.step_dir_name(step), small_state(step) if state is None else state
    )
    write_manifest_and_marker(directory, step, stats, world_size)
    return directory


def data_files(directory: Path) -> list[Path]:
    """The DCP data files of ``directory``, sorted by name."""
    return sorted(directory.glob(f"*{fmt.DCP_DATA_SUFFIX}"))


def tensor_payload_offset(directory: Path, fqn: str) -> tuple[Path, int]:
    """File and absolute offset of the raw element bytes of tensor ``fqn``.

    Finds the tensor's storage record inside DCP's torch.save blob by looking
    for its exact bytes, so a flip there changes a value, not the zip framing.
    """
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(directory).read_metadata()
    for index, info in metadata.storage_data.items():
        if index.fqn == fqn:
            path = directory / info.relative_path
            blob = path.read_bytes()[info.offset : info.offset + info.length]
            tensor = torch.load(__import__("io").BytesIO(blob), weights_only=True)
            raw = tensor.contiguous().numpy().tobytes()
            at = blob.find(raw)
            assert at >= 0, "tensor bytes not found in its item"
            return path, info.offset + at
    raise KeyError(fqn)
