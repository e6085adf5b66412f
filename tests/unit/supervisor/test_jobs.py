"""Job specs, job directories and submission (Slurm replaced by a recording runner)."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from agent.wire.errors import ConfigError
from supervisor.jobs import (
    SubmitError,
    batch_script,
    job_dir,
    read_secret,
    read_spec,
    submit,
    write_job_dir,
)
from supervisor.slurm import SlurmClient
from tests.fakes.slurm_runner import Recorder
from tests.unit.job_specs import spec


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"nodes": 0}, "at least 1 node"),
        ({"min_nodes": 5}, "--min-nodes must be 1..4"),
        ({"unit": 3}, "--unit 3 must divide --nodes 4"),
        ({"command": ()}, "no command to run"),
        ({"ckpt_root": "relative/dir"}, "absolute path"),
    ],
)
def test_a_spec_that_cannot_run_is_refused_with_what_to_fix(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        spec(**changes)


def test_a_job_directory_holds_a_private_secret_and_the_spec(tmp_path: Path) -> None:
    directory = write_job_dir(tmp_path, "4711", spec())
    assert directory == job_dir(tmp_path, "4711")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((directory / "spec.json").stat().st_mode) == 0o600
    assert len(read_secret(directory)) == 32
    assert read_spec(directory) == spec()
    (directory / "spec.json").write_text('{"version": 9}')
    with pytest.raises(ConfigError, match="job spec is malformed"):
        read_spec(directory)
    with pytest.raises(FileExistsError):
        write_job_dir(tmp_path, "4711", spec())  # never two secrets for one job


def test_the_batch_script_runs_the_driver_with_the_command_quoted(tmp_path: Path) -> None:
    script = batch_script(
        spec(command=("torchrun", "train.py", "--note", "a b; rm -rf /")), tmp_path
    )
    assert script.startswith("#!/bin/bash\n")
    assert "-m agent.driver" in script
    assert "'a b; rm -rf /'" in script


def test_submit_holds_the_job_until_its_secret_exists_then_releases_it(tmp_path: Path) -> None:
    runner = Recorder()
    job_id = asyncio.run(submit(spec(), tmp_path, SlurmClient(runner=runner)))
    assert job_id == "4711"
    test_only, sbatch, release = runner.calls
    assert test_only[:2] == ["sbatch", "--test-only"] and test_only[2:] == sbatch[3:]
    assert sbatch[:3] == ["sbatch", "--parsable", "--hold"]
    assert "--nodes=4" in sbatch and "--requeue" in sbatch
    assert release == ["scontrol", "release", "4711"]
    stored = read_spec(job_dir(tmp_path, "4711"))
    assert stored.user and stored.submitted_s > 0
    assert not list(tmp_path.glob(".batch-*"))  # the script was temporary


def test_a_refused_submission_says_why_and_leaves_nothing(tmp_path: Path) -> None:
    runner = Recorder(sbatch_answer="")
    with pytest.raises(SubmitError, match=r"sbatch refused the job.*bad partition"):
        asyncio.run(submit(spec(), tmp_path, SlurmClient(runner=runner)))
    assert list(tmp_path.iterdir()) == []


def test_a_job_whose_directory_cannot_be_written_is_cancelled(tmp_path: Path) -> None:
    runner = Recorder()
    write_job_dir(tmp_path, "4711", spec())  # a stale directory with that id is in the way
    with pytest.raises(SubmitError, match="job 4711 was cancelled"):
        asyncio.run(submit(spec(), tmp_path, SlurmClient(runner=runner)))
    assert runner.calls[-1] == ["scancel", "4711"]
    assert ["scontrol", "release", "4711"] not in runner.calls
