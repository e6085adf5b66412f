"""The kernel's word on a dead rank (agent.node.kernlog), from real kernel and cgroup text."""

from __future__ import annotations

from pathlib import Path

from agent.node import kernlog

# dmesg of this machine after a rank (pid 689) ran past its cgroup's memory limit.
CGROUP_OOM = """\
[72637.207059] [    689]     0   689    20589    19702    18048     1654         0   204800        0             0 python3
[72637.207064] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/resurgo-probe,task_memcg=/resurgo-probe,task=python3,pid=689,uid=0
[72637.207093] Memory cgroup out of memory: Killed process 689 (python3) total-vm:82356kB, anon-rss:72192kB, file-rss:6616kB, shmem-rss:0kB, UID:0 pgtables:200kB oom_score_adj:0
"""  # noqa: E501
# The host-wide form (no cgroup limit), as the kernel writes it since 5.x.
HOST_OOM = """\
[ 1234.500000] Out of memory: Killed process 4242 (python) total-vm:9000000kB, anon-rss:8000000kB, file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:16000kB oom_score_adj:0
"""  # noqa: E501
# NVIDIA's documented forms: 79 (fallen off the bus), 48 (double-bit ECC), 13 (an application's).
XIDS = """\
[  100.000001] NVRM: Xid (PCI:0000:3b:00): 13, pid=1911, Graphics Exception: ESR 0x405840=0x3c
[  200.000002] NVRM: Xid (PCI:0000:3b:00): 48, pid=1911, An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 0, subpartition 0.
[  300.000003] NVRM: Xid (PCI:0000:86:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
"""  # noqa: E501


def test_the_kill_line_of_the_rank_itself_is_found_in_either_form() -> None:
    assert kernlog.oom_kill_line(CGROUP_OOM, 689) == (
        "Memory cgroup out of memory: Killed process 689 (python3) total-vm:82356kB, "
        "anon-rss:72192kB, file-rss:6616kB, shmem-rss:0kB, UID:0 pgtables:200kB oom_score_adj:0"
    )
    assert kernlog.oom_kill_line(HOST_OOM, 4242) is not None
    assert kernlog.oom_kill_line(HOST_OOM, 424) is None  # another pid's prefix is not it
    assert kernlog.oom_kill_line(CGROUP_OOM + HOST_OOM, 7) is None


def test_an_older_processs_kill_under_the_same_pid_is_not_the_ranks() -> None:
    # Pids are reused: a kill stamped before the agent started was another process's.
    assert kernlog.oom_kill_line(CGROUP_OOM, 689, since_boot_s=72637.0) is not None
    assert kernlog.oom_kill_line(CGROUP_OOM, 689, since_boot_s=72638.0) is None
    assert kernlog.oom_kill_line(HOST_OOM, 4242, since_boot_s=2000.0) is None


def test_hardware_xids_leave_out_the_applications_and_the_ones_before_the_start() -> None:
    assert [kernlog.xid_code(line) for line in kernlog.hardware_xids(XIDS)] == [48, 79]
    assert [kernlog.xid_code(line) for line in kernlog.hardware_xids(XIDS, 250.0)] == [79]
    assert kernlog.hardware_xids(XIDS)[-1].startswith("NVRM: Xid (PCI:0000:86:00): 79")


def _proc(tmp_path: Path, pid: int, text: str) -> Path:
    (tmp_path / "proc" / str(pid)).mkdir(parents=True)
    (tmp_path / "proc" / str(pid) / "cgroup").write_text(text)
    return tmp_path / "proc"


def test_the_counter_of_a_cgroup_v1_memory_controller(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 5, "9:name=systemd:/\n4:memory:/slurm/uid_0/job_7/step_0\n0::/\n")
    control = tmp_path / "cg" / "memory" / "slurm" / "uid_0" / "job_7" / "step_0"
    control.mkdir(parents=True)
    (control / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    found = kernlog.memory_cgroup(5, proc, tmp_path / "cg")
    assert found == control / "memory.oom_control"
    assert kernlog.oom_kills(found) == 2


def test_the_counter_of_a_cgroup_v2_hierarchy(tmp_path: Path) -> None:
    proc = _proc(tmp_path, 6, "0::/system.slice/slurmstepd.scope/job_7/step_0/user/task_0\n")
    group = tmp_path / "cg" / "system.slice" / "slurmstepd.scope" / "job_7" / "step_0" / "user"
    (group / "task_0").mkdir(parents=True)
    (group / "task_0" / "memory.events").write_text(
        "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\n"
    )
    assert kernlog.oom_kills(kernlog.memory_cgroup(6, proc, tmp_path / "cg")) == 1


def test_no_cgroup_or_an_unreadable_one_is_unknown_not_an_error(tmp_path: Path) -> None:
    assert kernlog.memory_cgroup(99, tmp_path, tmp_path) is None
    assert kernlog.oom_kills(None) is None
    assert kernlog.oom_kills(tmp_path / "gone") is None
