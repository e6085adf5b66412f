"""What failed decides what happens: one live job per failure class, on the 4-node cluster.

A rank's ``rank_exited`` carries its evidence (the exception, its stderr's
tail, the kernel's out-of-memory kill line), the supervisor classifies it
(supervisor.core.failure_rules, the operator's ``[[failure_rules]]`` first)
and the class decides (supervisor.core.failures):

- a script that cannot import what it needs fails the same way on every node
  before its first step: ``user_error``, the job FAILED at once (the driver's
  exit 93), no node blamed, the verdict quoting the error;
- a rank the kernel killed for memory: ``oom``, relaunched on the same nodes
  without blame (here the script only runs out of memory before its first
  checkpoint, so the retry completes; the budget's stop is a unit test in
  tests/unit/supervisor/core/test_failures.py);
- a rank that prints the site's own fault signature: ``hardware`` by the
  operator's rule from the supervisor's TOML, its node drained with the rule
  named in Slurm's reason, the job resumed on the other nodes;
- two jobs whose checkpoint roots share a file system that fills up (a tmpfs
  with a ballast file): ``storage``, no node blamed, one storage incident with
  one alert for both, each job waiting until the ballast is gone and then
  resuming from its own checkpoint.

Every job here runs under one supervisor started with that TOML.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cgroups import memory_cgroup
from tests.conftest import LiveCluster
from tests.e2e.jobs import (
    AGENTS,
    DAEMON,
    POLICY,
    attempts,
    drained,
    ended,
    status,
    story_of,
    submit_job,
    victim_of,
)
from tests.supervisor_harness import TORCHRUN, SupervisorProcess

pytestmark = pytest.mark.slurm

PLAIN = Path(__file__).resolve().parents[1] / "workers" / "ddp_plain.py"

SITE_RULE = """
[[failure_rules]]
name = "site-gpu-fault"
class = "hardware"
match_log = "SITE GPU FAULT"
"""
ITERS = 20
SAVE_EVERY = 5  # the script's own checkpoint; every fault here comes after the first


@pytest.fixture
def supervisor(slurm_cluster: LiveCluster, tmp_path: Path) -> Iterator[SupervisorProcess]:
    """The e2e supervisor started with ``--config`` naming a TOML of one operator rule."""
    config = tmp_path / "supervisor.toml"
    config.write_text(SITE_RULE)
    # The storage test's checkpoint file system is 24 MiB: the agents' health gate asks
    # for 1 GB free on the checkpoint root by default.
    # The storage look, alike.
    agents = AGENTS | {"RESURGO_AGENT_HEALTH_MIN_FREE_GB": "0.001"}
    policy = POLICY | {"storage_min_free_gb": "0.001"}
    process = SupervisorProcess(
        slurm_cluster, tmp_path / "state", policy, agents | DAEMON, args=("--config", str(config))
    )
    process.start()
    try:
        yield process
    finally:
        process.stop()
        slurm_cluster.restore()


def submit_plain(supervisor: SupervisorProcess, where: Path, *script_args: str) -> tuple[int, Path]:
    out_dir = where / "out"
    out_dir.mkdir()
    return submit_job(supervisor, where, [
        *TORCHRUN, str(PLAIN), "--out-dir", str(out_dir), "--max-iters", str(ITERS),
        "--eval-interval", str(SAVE_EVERY), *script_args,
    ])  # fmt: skip


def decisions(supervisor: SupervisorProcess, job_id: int) -> list[tuple[str, str, str]]:
    """(from state -> to state, cause, explanation) of the job's decisions, oldest first."""
    with supervisor.store() as store:
        return [
            (f"{d.from_state}->{d.to_state}", d.cause, str(d.detail.get("explanation", "")))
            for d in store.decisions_for(str(job_id))
        ]


def draining(cluster: LiveCluster) -> dict[str, str]:
    """Node -> Slurm's reason, for every node Slurm holds drained."""
    return {
        name: node.get("reason", "")
        for name, node in cluster.nodes().items()
        if "DRAIN" in node.get("state_flags", [])
    }


def test_a_script_that_cannot_import_fails_at_once_on_its_first_attempt_and_drains_nothing(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\nimport tansformers\n")
    job_id, output = submit_job(
        supervisor, tmp_path, [*TORCHRUN, str(script)], sizes=("-N", "2", "--min-nodes", "1")
    )
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text) + "\n--- supervisor ---\n" + supervisor.log()[-4000:]
    assert job["job_state"] == "FAILED", told
    assert job["exit_code"] >> 8 == 93, (job["exit_code"], told)  # the driver's: no requeue
    assert len(attempts(supervisor, job_id)) == 1, told
    assert drained(supervisor, job_id) == [] and draining(slurm_cluster) == {}, told
    shown = status(supervisor, job_id)
    assert shown["state"] == "failed", shown
    reason = shown["final_reason"]
    assert "user_error (rule script-error-at-start)" in reason, reason
    assert "ModuleNotFoundError: No module named 'tansformers'" in reason, reason
    assert "on every node" in reason and "before the first step" in reason, reason
    # The stop is the first and only decision out of the launch: no recovery was tried.
    (stop,) = [d for d in decisions(supervisor, job_id) if d[0].endswith("->failed")]
    assert stop[1] == "user_error", told
    assert not any("relaunching" in d[0] for d in decisions(supervisor, job_id)), told


@pytest.fixture
def small_cgroup() -> Iterator[Path]:
    """A memory cgroup of 200 MiB for one rank to join; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    cgroup = memory_cgroup(200 << 20)
    assert cgroup is not None, "no memory cgroup controller writable on this machine"
    try:
        yield cgroup
    finally:
        with contextlib.suppress(OSError):  # a rank still in it would keep it
            cgroup.rmdir()


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_a_rank_killed_for_memory_is_retried_on_the_same_nodes_without_blame(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path, small_cgroup: Path
) -> None:
    job_id, output = submit_plain(
        supervisor, tmp_path, "--oom-at", "8", "--oom-cgroup", str(small_cgroup),
        "--fault-rank", "2",
    )  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text) + "\n--- supervisor ---\n" + supervisor.log()[-4000:]
    assert job["job_state"] == "COMPLETED", told
    victim_of(output, "running out of memory")
    # The root cause's class decided the recovery, quoting the kernel's word on the rank.
    oom = [d for d in decisions(supervisor, job_id) if d[1] == "oom"]
    (verdict,) = [d for d in oom if "kernel-oom-kill" in d[2]]
    assert oom[-1][0] == "recovering->relaunching", told
    explanation = verdict[2]
    assert re.search(r'oom \(rule kernel-oom-kill\): "[^"]*Killed process \d+ \(', explanation), (
        explanation
    )
    assert "retry 1 of 1, no node blamed" in explanation, explanation
    assert drained(supervisor, job_id) == [] and draining(slurm_cluster) == {}, told
    shown = status(supervisor, job_id)
    assert shown["restarts"] == {"oom": 1}, shown
    tries = attempts(supervisor, job_id)
    assert len(tries) == 2 and tries[0].nodes == tries[1].nodes, tries
    assert re.search(rf"resuming training from \S+ckpt.pt at iter {SAVE_EVERY} ", text), told
    assert f"done at iter {ITERS} with world 4" in text, told


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_an_operators_rule_from_the_toml_makes_a_logged_fault_hardware_and_drains_its_node(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    job_id, output = submit_plain(
        supervisor, tmp_path, "--exit-at", "8", "--exit-words", "SITE GPU FAULT on bank 3",
        "--fault-rank", "2",
    )  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text) + "\n--- supervisor ---\n" + supervisor.log()[-4000:]
    assert job["job_state"] == "COMPLETED", told
    victim = victim_of(output, "exiting")
    assert drained(supervisor, job_id) == [(victim, "hardware")], told
    reasons = slurm_cluster.wait_for(f"{victim}'s drain", lambda: draining(slurm_cluster), 30)
    assert set(reasons) == {victim}, reasons
    assert "hardware" in reasons[victim] and "rule site-gpu-fault" in reasons[victim], reasons
    assert "SITE GPU FAULT on bank 3" in reasons[victim], reasons
    (verdict,) = [d for d in decisions(supervisor, job_id) if "rule site-gpu-fault" in d[2]]
    assert verdict[1] == "hardware" and f"drain {victim}" in verdict[2], verdict
    tries = attempts(supervisor, job_id)
    assert len(tries) == 2 and victim not in tries[1].nodes, tries
    assert re.search(rf"resuming training from \S+ckpt.pt at iter {SAVE_EVERY} ", text), told
    assert f"done at iter {ITERS} with world 3" in text, told


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs for checkpoint roots (mounting needs root); unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "resurgo-test", str(disk)],
                   check=True)  # fmt: skip
    try:
        yield disk
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """A ballast file that takes every free block of ``disk``."""
    ballast = disk / "ballast"
    with ballast.open("wb", buffering=0) as out:
        for chunk in (1 << 20, 4096):
            with contextlib.suppress(OSError):
                while True:
                    out.write(bytes(chunk))
    assert os.statvfs(disk).f_bavail == 0
    return ballast


def explanations(supervisor: SupervisorProcess, job_id: int) -> str:
    return "\n".join(d[2] for d in decisions(supervisor, job_id))


# The full-disk jobs' length: both must still train when the disk fills, right after the
# later one's first checkpoint (80 s at 0.2 s an iteration: on a loaded machine one job's
# start, its node's warm pool importing torch, has lagged the other's by 34 s).
DISK_ITERS = 400


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_a_full_checkpoint_disk_blames_no_node_and_its_jobs_wait_in_one_incident_then_resume(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path, small_disk: Path
) -> None:
    # Two 2-node jobs, their roots on one small file system: torch.save to a path says
    # only "unexpected pos" on a full disk; a script writing its bytes itself gets
    # OSError ENOSPC.
    jobs: dict[int, tuple[Path, Path]] = {}
    for name, extra in (("path", ()), ("buffered", ("--save-buffered",))):
        root, output = small_disk / name, tmp_path / f"{name}.out"
        done = supervisor.resurgo(
            "submit", "-N", "2", "--min-nodes", "1", f"--output={output}", "--parsable",
            "--ckpt-root", str(root), "--", *TORCHRUN, str(PLAIN), "--out-dir", str(root),
            "--max-iters", str(DISK_ITERS), "--eval-interval", "5", *extra,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        jobs[int(done.stdout.strip())] = (root, output)

    def told() -> str:
        return (
            "\n".join(
                story_of(supervisor, job_id, output.read_text(errors="replace"))
                for job_id, (_, output) in jobs.items()
            )
            + "\n--- supervisor ---\n"
            + supervisor.log()[-4000:]
        )

    slurm_cluster.wait_for(
        "both jobs' first checkpoint",
        lambda: all((root / "ckpt.pt").exists() for root, _ in jobs.values()),
        timeout_s=180,
    )
    ballast = fill(small_disk)
    slurm_cluster.wait_for(
        "both jobs waiting for the storage",
        lambda: all("storage not usable yet" in explanations(supervisor, j) for j in jobs),
        timeout_s=120,
    )
    # One incident: the first job to find the disk full pages; the other joins it.
    with supervisor.store() as store:
        alerts = [a.payload["message"] for j in jobs
                  for a in store.events_for(str(j), kinds=["alert"])]  # fmt: skip
    incident = [a for a in alerts if a.startswith(f"storage incident on {small_disk}:")]
    assert len(incident) == 1, (alerts, told())
    joined = [j for j in jobs if f"joins the storage incident on {small_disk}" in
              explanations(supervisor, j)]  # fmt: skip
    assert len(joined) == 1, told()
    # Waiting: the look runs again and again while the disk stays full.
    assert draining(slurm_cluster) == {}, told()
    ballast.unlink()
    rules = set()
    for job_id, (root, output) in jobs.items():
        job, text = ended(slurm_cluster, supervisor, job_id, output)
        assert job["job_state"] == "COMPLETED", told()
        assert drained(supervisor, job_id) == [], told()
        assert re.search(rf"resuming training from {root}/ckpt.pt at iter [1-9]\d* ", text), told()
        assert f"done at iter {DISK_ITERS} with world 2" in text, told()
        assert status(supervisor, job_id)["restarts"] == {"storage": 1}, told()
        tries = attempts(supervisor, job_id)
        assert len(tries) == 2 and tries[0].nodes == tries[1].nodes, tries
        rules |= set(re.findall(r"storage \(rule ([\w-]+)\)", explanations(supervisor, job_id)))
    assert rules == {"torch-save-write-failed", "disk-full"}, told()
