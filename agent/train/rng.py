"""Capture and restore every random number generator a training rank draws from.

Deterministic resume needs, per rank, Python's ``random``, NumPy's global
RandomState, the torch CPU generator and the CUDA generator of every device
(DESIGN §5). Miss one and the resumed run diverges with no error anywhere:
dropout masks come from CUDA, shuffling from torch or Python, augmentation
from NumPy.

The captured state is a flat ``dict[str, Any]`` built to round-trip through
``torch.distributed.checkpoint`` (DCP): fixed-shape tensors and plain
ints/floats/bytes. DCP saves non-tensor values as pickled bytes and ``dcp.load``
replaces them in the state dict in place, so the usual pattern works::

    state = {"rng": {f"rank{rank}": capture_rng_state()}, ...}
    dcp.load(state, checkpoint_id=path)        # fills state in place
    restore_rng_state(state["rng"][f"rank{rank}"])

Keys (all present on every machine, CUDA or not, so that a checkpoint with
CUDA state loaded on a machine without it is detected rather than ignored):

``format``                   int, :data:`FORMAT_VERSION`.
``python_version``           int, first item of ``random.getstate()``.
``python_internal``          int64 tensor [625], the Mersenne Twister words and position.
``python_has_gauss``         int 0/1, whether ``random.gauss`` holds a cached value.
``python_gauss``             float, that cached value (0.0 when there is none).
``numpy_keys``               int64 tensor [624], MT19937 key of ``np.random.get_state()``.
``numpy_pos``                int, position in the key.
``numpy_has_gauss``          int 0/1, whether a cached Gaussian is held.
``numpy_cached_gaussian``    float, that cached value.
``torch_cpu``                uint8 tensor, ``torch.get_rng_state()``.
``torch_cuda_device_count``  int, devices captured (0 without CUDA).
``torch_cuda``               bytes, every device's state concatenated in device order
                             (each ``torch.cuda.get_rng_state(i)``, equal lengths).

The CUDA states are one ``bytes`` value rather than tensors on purpose: a
non-tensor value is replaced wholesale by ``dcp.load``, so a checkpoint from a
machine with a different device count still loads and :func:`restore_rng_state`
can refuse it with both counts named, instead of DCP failing on a shape or a
missing key.

Two rules for the caller:

- Key the dict per rank (``f"rank{rank}"``). DCP treats identical keys on
  several ranks as one replicated value and keeps a single copy, which would
  give every rank rank 0's generators.
- Restore AFTER the data iterators exist: creating a DataLoader iterator draws
  a base seed from the global torch generator, so restoring first and then
  calling ``iter(loader)`` leaves the generator one draw past the saved point.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from agent.wire.errors import ResurgoError

FORMAT_VERSION = 1

_MT_STATE_WORDS = 624


class RngStateMismatch(ResurgoError):
    """A captured RNG state cannot be restored on this machine; the message says why."""


def _cuda_available() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def capture_rng_state() -> dict[str, Any]:
    """Return the state of every generator this process draws from (keys: module docstring).

    Capturing draws nothing: the generators continue exactly as if this had not
    been called.
    """
    py_version, py_internal, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    if np_name != "MT19937":
        raise RngStateMismatch(f"NumPy's global generator is {np_name!r}, expected 'MT19937'")
    if _cuda_available():
        cuda_states = torch.cuda.get_rng_state_all()
        cuda_bytes = b"".join(state.cpu().numpy().tobytes() for state in cuda_states)
        cuda_count = len(cuda_states)
    else:
        cuda_bytes, cuda_count = b"", 0
    return {
        "format": FORMAT_VERSION,
        "python_version": int(py_version),
        "python_internal": torch.tensor(py_internal, dtype=torch.int64),
        "python_has_gauss": int(py_gauss is not None),
        "python_gauss": float(py_gauss) if py_gauss is not None else 0.0,
        # uint32 words, widened to int64 because torch has no general uint32 tensor.
        "numpy_keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
        "numpy_pos": int(np_pos),
        "numpy_has_gauss": int(np_has_gauss),
        "numpy_cached_gaussian": float(np_cached),
        "torch_cpu": torch.get_rng_state(),
        "torch_cuda_device_count": cuda_count,
        "torch_cuda": cuda_bytes,
    }


def _split_cuda_states(state: dict[str, Any]) -> list[torch.Tensor]:
    saved = int(state["torch_cuda_device_count"])
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if saved != here:
        raise RngStateMismatch(
            f"the checkpoint holds CUDA RNG state for {saved} device(s) but this process "
            f"sees {here}; resume on nodes with {saved} visible GPU(s) per process "
            "(check CUDA_VISIBLE_DEVICES), or the dropout streams would silently change"
        )
    data: bytes = state["torch_cuda"]
    if saved == 0:
        return []
    if len(data) % saved:
        raise RngStateMismatch(
            f"CUDA RNG state is {len(data)} bytes, not a multiple of {saved} devices"
        )
    size = len(data) // saved
    return [
        torch.frombuffer(bytearray(data[i * size : (i + 1) * size]), dtype=torch.uint8)
        for i in range(saved)
    ]


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator to ``state`` (from :func:`capture_rng_state`, possibly via DCP).

    Validates everything before setting anything, so a refused state leaves the
    generators untouched. Raises :class:`RngStateMismatch` when the format is
    unknown or the CUDA device count differs from the capture (both counts are
    named); a missing key raises KeyError.
    """
    if int(state["format"]) != FORMAT_VERSION:
        raise RngStateMismatch(
            f"RNG state format {state['format']!r} is not {FORMAT_VERSION}; "
            "it was written by a different Resurgo version"
        )
    cuda_states = _split_cuda_states(state)
    python_internal = tuple(int(word) for word in state["python_internal"].tolist())
    python_gauss = float(state["python_gauss"]) if int(state["python_has_gauss"]) else None
    numpy_keys = state["numpy_keys"].numpy().astype(np.uint32)
    if numpy_keys.shape != (_MT_STATE_WORDS,):
        raise RngStateMismatch(f"NumPy key has shape {numpy_keys.shape}, expected (624,)")

    random.setstate((int(state["python_version"]), python_internal, python_gauss))
    np.random.set_state(
        (
            "MT19937",
            numpy_keys,
            int(state["numpy_pos"]),
            int(state["numpy_has_gauss"]),
            float(state["numpy_cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch_cpu"].cpu())
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
