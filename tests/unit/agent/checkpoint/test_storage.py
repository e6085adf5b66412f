"""agent.checkpoint.storage: filesystem identification and the pure storage rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.checkpoint.storage import (
    FsKind,
    can_stage,
    describe_magic,
    filesystem_of,
    kind_of_magic,
    statfs_magic,
    storage_warning,
)

# /proc/self/mountinfo spells filesystem types the way the kernel registers them.
_KERNEL_NAMES = {
    "nfs": FsKind.NFS,
    "nfs4": FsKind.NFS,
    "lustre": FsKind.LUSTRE,
    "gpfs": FsKind.GPFS,
    "beegfs": FsKind.BEEGFS,
    "ceph": FsKind.CEPHFS,
    "ext2": FsKind.EXT4,
    "ext3": FsKind.EXT4,
    "ext4": FsKind.EXT4,
    "xfs": FsKind.XFS,
    "btrfs": FsKind.BTRFS,
    "zfs": FsKind.ZFS,
    "tmpfs": FsKind.TMPFS,
    "overlay": FsKind.OVERLAYFS,
    "proc": FsKind.PROCFS,
}


def _mount_type(path: Path) -> str:
    """Filesystem type of the mount holding ``path``, per /proc/self/mountinfo."""
    best, best_type = "", ""
    resolved = str(path.resolve())
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        mount_point = fields[4]
        fs_type = fields[fields.index("-") + 1]
        inside = resolved == mount_point or resolved.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best):
            best, best_type = mount_point, fs_type
    return best_type


def test_proc_is_recognised_as_procfs():
    assert filesystem_of(Path("/proc")) is FsKind.PROCFS


def test_tmp_path_is_identified_as_the_kernel_mounted_it(tmp_path):
    expected = _KERNEL_NAMES.get(_mount_type(tmp_path), FsKind.UNKNOWN)
    assert filesystem_of(tmp_path) is expected


def test_a_path_not_yet_created_is_judged_by_its_nearest_existing_parent(tmp_path):
    assert statfs_magic(tmp_path / "ckpt" / "step-1") == statfs_magic(tmp_path)


@pytest.mark.parametrize(
    ("magic", "kind"),
    [
        (0x6969, FsKind.NFS),
        (0x0BD00BD0, FsKind.LUSTRE),
        (0x47504653, FsKind.GPFS),
        (0x19830326, FsKind.BEEGFS),
        (0xEF53, FsKind.EXT4),
        (0x58465342, FsKind.XFS),
        (0x01021994, FsKind.TMPFS),
        (0x794C7630, FsKind.OVERLAYFS),
        (0x9123683E, FsKind.BTRFS),
        (0x2FC12FC1, FsKind.ZFS),
        (0x00C36400, FsKind.CEPHFS),
        # f_type is a signed long: a magic with the top bit set may come back negative.
        (0x9123683E - (1 << 32), FsKind.BTRFS),
        (0x12345678, FsKind.UNKNOWN),
    ],
)
def test_statfs_magic_maps_to_its_filesystem(magic, kind):
    assert kind_of_magic(magic) is kind


def test_an_unknown_magic_is_described_with_its_hex_value():
    assert describe_magic(0x62656572) == "unknown (0x62656572)"
    assert describe_magic(0x6969) == "nfs"


@pytest.mark.parametrize(
    ("fs", "ranks", "throughput", "threshold", "warns"),
    [
        (FsKind.NFS, 8, 250e6, 8, True),
        (FsKind.NFS, 64, None, 8, True),
        (FsKind.NFS, 7, 250e6, 8, False),
        (FsKind.NFS, 4, 250e6, 4, True),
        (FsKind.LUSTRE, 1024, 250e6, 8, False),
        (FsKind.GPFS, 1024, 250e6, 8, False),
        (FsKind.EXT4, 8, 250e6, 8, False),
        (FsKind.UNKNOWN, 8, 250e6, 8, False),
    ],
)
def test_storage_warning_fires_only_for_many_ranks_on_a_single_metadata_server(
    fs, ranks, throughput, threshold, warns
):
    warning = storage_warning(fs, ranks, throughput, threshold=threshold)
    assert (warning is not None) is warns
    if warns:
        assert f"{ranks} ranks" in warning
        assert "metadata server" in warning
        assert "Lustre" in warning


def test_storage_warning_reports_the_measured_throughput():
    assert "250.0 MB/s" in (storage_warning(FsKind.NFS, 16, 250e6) or "")
    assert "not measured yet" in (storage_warning(FsKind.NFS, 16, None) or "")


@pytest.mark.parametrize(
    ("tensor_bytes", "available", "headroom", "fits"),
    [
        (100, 125, 1.25, True),
        (100, 124, 1.25, False),
        (0, 0, 1.0, True),
        (1 << 30, 1 << 30, 1.0, True),
        (1 << 30, (1 << 30) - 1, 1.0, False),
    ],
)
def test_can_stage_needs_the_tensor_bytes_times_headroom(tensor_bytes, available, headroom, fits):
    assert can_stage(tensor_bytes, available, headroom) is fits


def test_a_headroom_below_one_is_refused():
    with pytest.raises(ValueError, match="headroom"):
        can_stage(1, 1, 0.5)
