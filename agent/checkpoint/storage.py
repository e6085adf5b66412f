"""Where checkpoints land: which filesystem, whether it suits sharded writes, staging room.

Sharded saves make every rank create and write its own file at the same moment.
On a filesystem with a single metadata server (NFS) every one of those creates
and fsyncs is serialised through that one server, so the parallel write the
sharding was for never happens; Lustre, GPFS and BeeGFS spread metadata over
many servers for exactly this load. The saver asks :func:`filesystem_of` once
and logs :func:`storage_warning` when the combination is a known bottleneck.

:func:`storage_warning`, :func:`can_stage` and :func:`kind_of_magic` are pure;
only :func:`statfs_magic` touches the OS (one ``statfs(2)`` call through ctypes,
because ``os.statvfs`` does not expose ``f_type``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
from pathlib import Path

# Ranks writing at once beyond which a single metadata server is worth a warning.
DEFAULT_RANKS_WARNING_THRESHOLD = 8


class FsKind(enum.Enum):
    """A filesystem family, recognised by the ``f_type`` magic of ``statfs(2)``."""

    NFS = "nfs"
    LUSTRE = "lustre"
    GPFS = "gpfs"
    BEEGFS = "beegfs"
    CEPHFS = "cephfs"
    EXT4 = "ext4"
    XFS = "xfs"
    BTRFS = "btrfs"
    ZFS = "zfs"
    TMPFS = "tmpfs"
    OVERLAYFS = "overlayfs"
    PROCFS = "procfs"
    UNKNOWN = "unknown"


# f_type values from linux/magic.h and the vendors' sources. ext2/ext3/ext4 share
# 0xEF53; the kernel cannot tell them apart here and neither can we.
_MAGIC: dict[int, FsKind] = {
    0x6969: FsKind.NFS,
    0x0BD00BD0: FsKind.LUSTRE,
    0x47504653: FsKind.GPFS,
    0x19830326: FsKind.BEEGFS,
    0x00C36400: FsKind.CEPHFS,
    0xEF53: FsKind.EXT4,
    0x58465342: FsKind.XFS,
    0x9123683E: FsKind.BTRFS,
    0x2FC12FC1: FsKind.ZFS,
    0x01021994: FsKind.TMPFS,
    0x794C7630: FsKind.OVERLAYFS,
    0x9FA0: FsKind.PROCFS,
}

# Filesystems whose metadata (create, rename, fsync of directories) goes through
# one server, serialising the per-rank file creation of a sharded save.
SINGLE_METADATA_SERVER = frozenset({FsKind.NFS})

# struct statfs is 120 bytes on x86_64 and aarch64; a larger buffer costs nothing
# and keeps a libc with extra spare fields from writing past our memory.
_STATFS_BUFFER_BYTES = 512


def kind_of_magic(magic: int) -> FsKind:
    """The filesystem family of a ``statfs`` ``f_type`` value (UNKNOWN if not in the table)."""
    return _MAGIC.get(magic & 0xFFFFFFFF, FsKind.UNKNOWN)


def describe_magic(magic: int) -> str:
    """Human spelling for manifests and logs: ``"ext4"`` or ``"unknown (0x1234abcd)"``."""
    kind = kind_of_magic(magic)
    if kind is FsKind.UNKNOWN:
        return f"unknown (0x{magic & 0xFFFFFFFF:08x})"
    return kind.value


def statfs_magic(path: Path) -> int:
    """``f_type`` of the filesystem holding ``path`` (or its nearest existing parent).

    The checkpoint root may not exist yet on the first save, so the nearest
    existing ancestor stands in for it: a new directory lives on its parent's
    filesystem.
    """
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    buffer = ctypes.create_string_buffer(_STATFS_BUFFER_BYTES)
    if libc.statfs(os.fsencode(probe), buffer) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"statfs failed: {os.strerror(errno)}", str(probe))
    # f_type is the first member, a C long (__fsword_t) on every Linux ABI.
    return ctypes.c_long.from_buffer(buffer).value


def filesystem_of(path: Path) -> FsKind:
    """The filesystem family holding ``path``."""
    return kind_of_magic(statfs_magic(path))


def storage_warning(
    fs: FsKind,
    ranks_writing: int,
    throughput_bytes_per_s: float | None,
    *,
    threshold: int = DEFAULT_RANKS_WARNING_THRESHOLD,
) -> str | None:
    """A warning when ``ranks_writing`` sharded writers meet a single metadata server, else None.

    ``throughput_bytes_per_s`` is the write throughput measured on the last save
    (None before the first one); it goes into the message so an operator can
    see the cost, not just the rule.
    """
    if fs not in SINGLE_METADATA_SERVER or ranks_writing < threshold:
        return None
    measured = (
        "not measured yet"
        if throughput_bytes_per_s is None
        else f"{throughput_bytes_per_s / 1e6:.1f} MB/s"
    )
    return (
        f"{ranks_writing} ranks write sharded checkpoints to {fs.value}, whose single "
        f"metadata server serialises every rank's file creation and fsync (measured "
        f"write throughput: {measured}); put the checkpoint root on a parallel "
        "filesystem (Lustre, GPFS, BeeGFS) or expect saves to scale with the rank count"
    )


def can_stage(tensor_bytes: int, available_bytes: int, headroom: float) -> bool:
    """True when host memory can hold a staged copy of ``tensor_bytes`` with ``headroom``.

    ``headroom`` (>= 1) covers what the copy costs beyond the tensor bytes
    (allocator slack, the serialiser's buffers) and what training allocates
    meanwhile; an async save that pushes the node into the OOM killer loses
    the job it was meant to protect.
    """
    if headroom < 1.0:
        raise ValueError(f"headroom must be >= 1.0, got {headroom}")
    return tensor_bytes * headroom <= available_bytes
