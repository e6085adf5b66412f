"""Checks of one ``torch.save`` file without torch: its zip archive and what its pickle names.

Since torch 1.6, ``torch.save`` writes a zip archive (stored, not compressed)
whose ``<name>/data.pkl`` holds the pickled object and whose ``data/<k>``
members hold the tensors' bytes. That gives three checks cheaper than a load:

- the archive's central directory, written last, sits at the end of the file:
  a truncated or half-written file has none (:func:`check_zip`, quick);
- each member carries a CRC-32: reading every byte checks them all (full);
- the pickle names the step a framework keeps in the dict (Lightning's
  ``global_step``, nanoGPT's ``iter_num``): :func:`peek` reads it with an
  unpickler that builds plain containers and nothing else, never a class
  from the file, so a file any job user wrote cannot run code here.

A file in torch's legacy (pre-zip) format has none of this: only its size
and age are checked before a load.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from typing import Any, ClassVar

# Keys under which public training scripts keep their step in a checkpoint dict.
STEP_KEYS = ("iter_num", "global_step", "step", "iteration", "iter", "steps")
# The pickle of a checkpoint holds names and references, not tensor bytes:
# Lightning's for a 7B model is ~100 KiB. A larger one is not read for its step
# (each pickled opcode can become an object: memory grows far past the file).
PEEK_LIMIT_BYTES = 4 << 20
# Members read per chunk while checking CRCs.
_CHUNK_BYTES = 1 << 20


def step_named(state: object) -> int | None:
    """The step a loaded checkpoint dict names under one of :data:`STEP_KEYS` (None: none)."""
    if not isinstance(state, dict):
        return None
    for key in STEP_KEYS:
        value = state.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def is_zip(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` starts like a zip archive (torch's format since 1.6)."""
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"PK\x03\x04"
    except OSError:
        return False


def whole(path: str | os.PathLike[str], size: int) -> bool:
    """Whether a torch.save file looks complete: not empty, and its zip archive whole."""
    return size > 0 and (not is_zip(path) or check_zip(path, crc=False) is None)


def check_zip(path: str | os.PathLike[str], *, crc: bool) -> str | None:
    """Why the zip archive at ``path`` is unusable (None: it is whole).

    Without ``crc`` only the central directory is read (the file's end) and
    every member checked to lie inside the file; with it every member is read
    and its CRC-32 compared.
    """
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as archive:
            members = archive.infolist()
            if not any(member.filename.endswith("data.pkl") for member in members):
                return "the archive holds no data.pkl: not a torch.save file, or cut short"
            for member in members:
                if member.header_offset + member.compress_size > size:
                    return f"member {member.filename} runs past the end of the file: truncated"
            if crc:
                for member in members:
                    with archive.open(member) as data:
                        while data.read(_CHUNK_BYTES):
                            pass
    except zipfile.BadZipFile as error:
        if "CRC" in str(error):
            return f"its bytes no longer match their CRC-32 ({error}): corrupt"
        return f"not a whole zip archive ({error}): truncated or overwritten"
    except (zipfile.LargeZipFile, EOFError, ValueError, NotImplementedError) as error:
        return f"the archive cannot be read ({error})"
    return None


def peek(path: str | os.PathLike[str]) -> Any:
    """The pickled object of a torch zip file with tensors and classes left out (None: unreadable).

    Dicts, lists, tuples, strings and numbers come out as they are; every
    tensor and every object of a class is None. Nothing from the file runs.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(m for m in archive.namelist() if m.endswith("/data.pkl") or m == "data.pkl")
            if archive.getinfo(name).file_size > PEEK_LIMIT_BYTES:
                return None
            data = archive.read(name)
    except (OSError, StopIteration, zipfile.BadZipFile, ValueError, EOFError):
        return None
    try:
        return _Plain(io.BytesIO(data)).load()
    except Exception:  # any malformed pickle: nothing to read from it
        return None


class _Opaque:
    """Stands for any object the pickle names a class for; keeps nothing."""

    def __new__(cls, *args: object, **kwargs: object) -> _Opaque:
        return object.__new__(cls)

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        pass

    def __setitem__(self, key: object, value: object) -> None:
        pass

    def append(self, value: object) -> None:
        pass

    def extend(self, values: object) -> None:
        pass


def _opaque(*args: object, **kwargs: object) -> None:
    return None


class _Plain(pickle.Unpickler):
    """Builds dicts, lists and scalars; any class or function from the file becomes a stub."""

    _KEPT: ClassVar[dict[tuple[str, str], type]] = {
        ("collections", "OrderedDict"): collections.OrderedDict
    }

    def find_class(self, module: str, name: str) -> Any:
        kept = self._KEPT.get((module, name))
        if kept is not None:
            return kept
        # A function the pickle calls (torch's tensor rebuilders) gives None; a class
        # it instantiates gives an inert object.
        return _Opaque if name[:1].isupper() else _opaque

    def persistent_load(self, pid: object) -> None:
        return None


def load_problem(path: str | os.PathLike[str]) -> tuple[str | None, str | None]:
    """Test-load ``path`` with ``torch.load(weights_only=True)``: (why it failed, a note).

    A file that pickles Python objects, which ``weights_only`` refuses to run,
    is complete as far as can be told without running its code: no failure,
    and a note that says so.
    """
    import torch

    try:
        try:
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            # Written in torch's legacy (pre-zip) format, which mmap cannot read.
            torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights_only" in str(error) or "Weights only load failed" in str(error):
            name = os.path.basename(path)
            return None, (f"{name} not test-loaded: it pickles Python objects, which "
                          "torch.load(weights_only=True) refuses to run")  # fmt: skip
        return corrupt(error), None
    except Exception as error:  # any failure to read the file is the finding
        return corrupt(error), None
    return None, None


def corrupt(error: BaseException) -> str:
    """The finding for a file torch cannot read."""
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"torch.load cannot read it ({first}): truncated or corrupt; use an older checkpoint"
