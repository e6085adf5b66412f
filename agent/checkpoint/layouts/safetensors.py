"""Checks of one ``.safetensors`` file without reading its tensors.

The format is an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and ``data_offsets`` (relative to the end of the
header), then the bytes. A whole file ends exactly where its last tensor does:
a truncated one is shorter, which the header shows without reading the data.
"""

from __future__ import annotations

import json
import os
import struct

# The header of a model with tens of thousands of tensors is a few MiB.
_HEADER_LIMIT_BYTES = 100 << 20
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def check_safetensors(path: str | os.PathLike[str], *, read_all: bool = False) -> str | None:
    """Why the safetensors file at ``path`` is unusable (None: whole as far as its header says).

    ``read_all`` also reads every byte (an I/O error is a finding; the format
    has no checksum to compare).
    """
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        head = file.read(8)
        if len(head) < 8:
            return f"{size} bytes: shorter than a safetensors header"
        (length,) = struct.unpack("<Q", head)
        if length > _HEADER_LIMIT_BYTES or 8 + length > size:
            return f"its header claims {length} bytes, past the file's {size}: truncated"
        try:
            header = json.loads(file.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return f"its header is not JSON ({error}): corrupt"
        if not isinstance(header, dict):
            return "its header is not a JSON object: corrupt"
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            problem = _tensor_problem(name, info)
            if problem is not None:
                return problem
            end = max(end, info["data_offsets"][1])
        if 8 + length + end != size:
            return (
                f"its tensors end at byte {8 + length + end} but the file has {size}: "
                f"{'truncated' if size < 8 + length + end else 'trailing bytes'}"
            )
        if read_all:
            while file.read(1 << 20):
                pass
    return None


def _tensor_problem(name: str, info: object) -> str | None:
    if not isinstance(info, dict):
        return f"tensor {name!r}: no description in the header"
    offsets, shape, dtype = info.get("data_offsets"), info.get("shape"), info.get("dtype")
    if not (isinstance(offsets, list) and _offsets_ok(offsets)):
        return f"tensor {name!r}: bad data_offsets {offsets!r}"
    start, end = offsets
    if isinstance(shape, list) and all(isinstance(v, int) for v in shape) and dtype in _DTYPE_BYTES:
        count = 1
        for dim in shape:
            count *= dim
        if count * _DTYPE_BYTES[dtype] != end - start:
            return f"tensor {name!r}: {dtype}{shape} does not fill bytes {offsets}"
    return None


def _offsets_ok(offsets: list[object]) -> bool:
    if len(offsets) != 2:
        return False
    start, end = offsets
    return isinstance(start, int) and isinstance(end, int) and 0 <= start <= end
