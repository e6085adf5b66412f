"""`resurgo submit` against the live cluster: Resurgo reads options as sbatch does."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from supervisor.jobs import JobSpec, batch_script, sbatch_options
from supervisor.sbatch import parse_request
from tests.conftest import LiveCluster
from tests.supervisor_harness import SupervisorProcess

pytestmark = pytest.mark.slurm

FORMS = [
    "-N 3",
    "-N3",
    "--nodes=3",
    "--nodes 3",
    "--nodes=2-3",
    "-N 3 --comment 'two words' --time=10",
    "--job-name='a b' -N 2 --dependency=singleton",
]


@pytest.mark.parametrize("form", FORMS)
def test_the_node_count_resurgo_reads_is_the_one_sbatch_allocates(
    slurm_cluster: LiveCluster, tmp_path: Path, form: str
) -> None:
    options = shlex.split(form)
    request = parse_request(options)
    spec = JobSpec(
        name="probe", nodes=request.nodes, command=("true",), ckpt_root="/ckpt",
        min_nodes=request.min_nodes, sbatch_options=tuple(options), supervisor_url="http://x",
    )  # fmt: skip
    script = tmp_path / "job.sh"
    script.write_text(batch_script(spec, tmp_path))
    done = slurm_cluster.run(["sbatch", "--test-only", *sbatch_options(spec), str(script)])
    found = re.search(r"using (\d+) processors on nodes (\S+)", done.stderr)
    assert found, done.stderr
    nodes = slurm_cluster.run(["scontrol", "show", "hostnames", found.group(2)]).stdout.split()
    if request.min_nodes is None:
        assert len(nodes) == request.nodes, (form, done.stderr)
    else:
        # A MIN-MAX range is Slurm's to choose within (it may start small); Resurgo
        # keeps the job at MIN or more and grows it to MAX once nodes are idle.
        assert request.min_nodes <= len(nodes) <= request.nodes, (form, done.stderr)


def _jobs_named(slurm_cluster: LiveCluster, name: str) -> list[int]:
    """Jobs of that name Slurm would still run (cancelled ones stay listed a while)."""
    jobs = slurm_cluster.json(["squeue", "--json"]).get("jobs", [])
    live = ("PENDING", "CONFIGURING", "RUNNING", "SUSPENDED")
    return [job["job_id"] for job in jobs if job["name"] == name and job["job_state"] in live]


def test_submit_to_a_supervisor_watching_another_jobs_dir_is_refused_and_leaves_no_job(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    supervisor = SupervisorProcess(slurm_cluster, tmp_path / "state", {})
    supervisor.start()
    name = f"wiring-{tmp_path.name}"[:40]
    submit = [
        "submit", "-N", "1", f"--job-name={name}", f"--output={tmp_path / 'out.txt'}",
        "--register-wait-s", "4", "--ckpt-root", str(tmp_path / "ckpt"), "--", "sleep", "60",
    ]  # fmt: skip
    try:
        elsewhere = tmp_path / "elsewhere"
        env = {**supervisor.cli_env(), "RESURGO_STATE_DIR": str(elsewhere)}
        refused = subprocess.run(
            [sys.executable, "-m", "supervisor.cli.main", *submit],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert refused.returncode == 1, refused
        message = refused.stderr
        assert "was cancelled" in message and "did not register it" in message, message
        assert str((tmp_path / "state" / "jobs").resolve()) in message, message
        assert str(elsewhere / "jobs") in message and "--jobs-dir" in message, message
        assert _jobs_named(slurm_cluster, name) == [], "the held job was left in Slurm"
        assert not any(elsewhere.joinpath("jobs").iterdir()), "its directory was left"

        accepted = supervisor.resurgo(*submit)
        assert accepted.returncode == 0, accepted
        job_id = int(accepted.stdout.split()[-1])
        try:
            assert f"job {job_id} registered" in supervisor.log()
            assert slurm_cluster.job(job_id) is not None
        finally:
            slurm_cluster.run(["scancel", str(job_id)])
    finally:
        for job_id in _jobs_named(slurm_cluster, name):
            slurm_cluster.run(["scancel", str(job_id)])
        supervisor.stop()


def test_a_request_no_node_can_run_is_refused_at_submit_and_one_that_waits_is_not(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    """Held, any request is accepted: 8 tasks per node on 2-CPU nodes sat pending for
    ever. Slurm's own verdict decides, and a drained node (a wait) is no refusal."""
    supervisor = SupervisorProcess(slurm_cluster, tmp_path / "state", {})
    supervisor.start()
    name = f"never-{tmp_path.name}"[:40]

    def submit(*options: str) -> subprocess.CompletedProcess[str]:
        return supervisor.resurgo(
            "submit", *options, f"--job-name={name}", f"--output={tmp_path / 'out.txt'}",
            "--ckpt-root", str(tmp_path / "ckpt"), "--", "sleep", "60",
        )  # fmt: skip

    try:
        refused = submit("-N", "1", "--ntasks-per-node=8")
        assert refused.returncode == 1, refused
        assert "can never run it as requested" in refused.stderr, refused.stderr
        assert "BadConstraints" in refused.stderr and "sinfo" in refused.stderr, refused.stderr
        assert _jobs_named(slurm_cluster, name) == [], "the impossible job was left in Slurm"

        slurm_cluster.run(["scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=t"])
        waits = submit("-N", "4")
        assert waits.returncode == 0, waits.stderr
        (job_id,) = _jobs_named(slurm_cluster, name)
        job = slurm_cluster.job(job_id)
        assert job is not None and job["job_state"] == "PENDING", job
    finally:
        slurm_cluster.run(["scontrol", "update", "NodeName=node4", "State=RESUME"])
        for job_id in _jobs_named(slurm_cluster, name):
            slurm_cluster.run(["scancel", str(job_id)])
        supervisor.stop()
