"""Small JSON documents exchanged between the ranks of a save, over a gloo group.

Votes, outcomes and file lists travel as JSON in uint8 tensors rather than
through ``all_gather_object``: no pickle crosses a process boundary, and
gloo moves plain CPU tensors.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import torch
import torch.distributed as dist

# Votes, outcomes and file lists are a few hundred bytes: each rank sends a
# fixed-size frame (length + inline payload), so one all_gather suffices; only
# a longer document costs a second, exact-size round.
_GATHER_INLINE_BYTES = 4096
_GATHER_LENGTH = struct.Struct("<q")


def all_gather_json(
    group: dist.ProcessGroup | None, document: dict[str, Any], world_size: int
) -> list[dict[str, Any]]:
    """Every rank's ``document``, in rank order, over ``group`` of ``world_size`` ranks."""
    payload = json.dumps(document).encode()
    frame = bytearray(_GATHER_LENGTH.size + _GATHER_INLINE_BYTES)
    _GATHER_LENGTH.pack_into(frame, 0, len(payload))
    inline = payload[:_GATHER_INLINE_BYTES]
    frame[_GATHER_LENGTH.size : _GATHER_LENGTH.size + len(inline)] = inline
    frames = _all_gather_bytes(group, frame, world_size)
    lengths = [_GATHER_LENGTH.unpack_from(received)[0] for received in frames]
    longest = max(lengths)
    if longest <= _GATHER_INLINE_BYTES:
        bodies = [received[_GATHER_LENGTH.size :] for received in frames]
    else:
        bodies = _all_gather_bytes(group, bytearray(payload.ljust(longest, b"\0")), world_size)
    return [json.loads(body[:n]) for body, n in zip(bodies, lengths, strict=True)]


def _all_gather_bytes(
    group: dist.ProcessGroup | None, data: bytearray, world_size: int
) -> list[bytes]:
    """Every rank's ``data`` (the same length on every rank), in rank order."""
    local = torch.frombuffer(data, dtype=torch.uint8)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local, group=group)
    return [tensor.numpy().tobytes() for tensor in gathered]
