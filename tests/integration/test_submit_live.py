"""`resurgo submit` against the live cluster: Resurgo reads options as sbatch does."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from supervisor.jobs import JobSpec, batch_script, sbatch_options
from supervisor.sbatch import parse_request
from tests.conftest import LiveCluster

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
