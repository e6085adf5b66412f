"""The time limit, end to end, on the live 4-node cluster: a planned stop, twice over.

A 4-node job whose training takes several times its one-minute limit runs
under ``resurgo submit``. Before each limit the driver's notice makes the
ranks save a final checkpoint at the next step boundary and stop; the
supervisor requeues the job at 4 nodes; the next allocation resumes from that
very checkpoint. The first crossing starts from nothing; the second from the
first one's final checkpoint, in a requeued allocation: every later crossing
would take that same path again (an allocation whose start-up on a loaded machine
takes all its time trains nothing, saves nothing and is not counted: the next one
starts from nothing again). After the second crossing the test raises the
limit, as an operator may, and the job trains to its end. Checked against an
unfaulted run of the same job: every step trained exactly once (no step lost,
none replayed), on the same global samples, with bitwise-equal final
parameters; nothing drained, nothing blamed, no restart budget spent, every
restart counted as ``time_limit``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.conftest import LiveCluster
from tests.e2e.jobs import AGENTS, DAEMON, POLICY, ended, story_of
from tests.e2e.time_limits import raise_limit_after_crossings
from tests.supervisor_harness import TORCHRUN, TOY, SupervisorProcess

# Minutes of waiting (limits, outages): started first, so other tests fill the wait.
pytestmark = [pytest.mark.slurm, pytest.mark.long]

# A one-minute allocation trains at most 60 - 15 (the warning's lead) - start-up
# (>= 8 s) seconds, so at most 37 steps of 1 s: 90 steps cross the limit >= 2 times.
# On a 2-core machine start-up takes ~35 s and an allocation trains ~5-10 steps:
# after the second crossing the test raises the limit, as an operator would, and the
# rest trains in one allocation (else 90 steps would take ~10 allocations). A third
# crossing would repeat the second: a requeued allocation, resumed from a requested
# save, stops at its notice again; time-limit restarts spend no budget, so no count
# of them reaches a threshold.
STEPS = 90
CROSSINGS = 2
STEP_S = 1.0
SAVE_EVERY = 50  # the scheduled saves; the final one before each limit comes on request
STARTS = re.compile(r"toy: world (\d+), starting at step (\d+)(?: from (\S+))?")


def resumes_in(output: Path) -> list[str]:
    """The checkpoints the job's launches resumed from, as the trainer printed them: one
    per crossing that trained a step (the final save before the limit)."""
    text = output.read_text() if output.is_file() else ""
    return [path for _, _, path in STARTS.findall(text) if path]


def submit(
    supervisor: SupervisorProcess, where: Path, *sbatch: str, steps: int = STEPS
) -> tuple[int, Path, Path]:
    """``resurgo submit`` the demo trainer on 4 nodes; (job id, output file, record dir)."""
    where.mkdir(parents=True, exist_ok=True)
    output, record = where / "job.out", where / "record"
    done = supervisor.resurgo(
        "submit", "-N", "4", *sbatch, f"--output={output}", "--ckpt-root", str(where / "ckpt"),
        "--parsable", "--",
        *TORCHRUN, str(TOY), "--steps", str(steps), "--step-s", str(STEP_S),
        "--save-every", str(SAVE_EVERY), "--record", str(record),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return int(done.stdout.strip()), output, record


def reference_run(where: Path, record: Path) -> subprocess.Popen[bytes]:
    """The same training without a time limit or Slurm: 4 ranks on this host, with no
    padding sleep per step (it changes nothing that is trained)."""
    where.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "RESURGO_CKPT_ROOT": str(where / "ckpt"), "OMP_NUM_THREADS": "1"}
    for name in ("RESURGO_AGENT_SOCKET", "RESURGO_SAVE_REQUEST_FILE", "RESURGO_RESUME_FROM"):
        env.pop(name, None)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        str(TOY), "--steps", str(STEPS), "--step-s", "0",
        "--save-every", str(SAVE_EVERY), "--record", str(record),
    ]  # fmt: skip
    with (where / "out.txt").open("wb") as out:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


@pytest.mark.timeout(1200)
def test_a_job_crosses_its_time_limit_twice_losing_no_step(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    # The unfaulted run first, as 4 local ranks on gloo: the same world and reduction
    # order as 4 one-rank nodes of this one-host cluster. Run alongside the job, it
    # slowed every launch so much that each one-minute allocation trained a few
    # steps only, and the job needed twice the crossings to finish.
    ref_record = tmp_path / "reference" / "record"
    ref = reference_run(tmp_path / "reference", ref_record)
    assert ref.wait(timeout=300) == 0, (tmp_path / "reference" / "out.txt").read_text()
    supervisor = SupervisorProcess(slurm_cluster, tmp_path / "state", POLICY, AGENTS | DAEMON)
    supervisor.start()
    try:
        job_id, output, record = submit(supervisor, tmp_path / "timed", "--time=1")
        raise_limit_after_crossings(
            slurm_cluster, job_id, CROSSINGS, counted=lambda: len(resumes_in(output))
        )
        job, text = ended(slurm_cluster, supervisor, job_id, output, timeout_s=480)
        story = story_of(supervisor, job_id, text)
        assert job["job_state"] == "COMPLETED", story
        assert job["restart_cnt"] >= CROSSINGS, story

        with supervisor.store() as store:
            row = store.get_job(str(job_id))
            assert row is not None and row.state == "completed"
            drains = [d for d in store.drains_since(0) if d.job_id == str(job_id)]
            attempts = list(store.attempts_for(str(job_id)))
            decisions = store.decisions_for(str(job_id))
        assert drains == [], story
        restarts = Counter(d.cause for d in decisions if d.to_state == "recovering")
        assert set(restarts) == {"time_limit"}, story
        assert all(len(a.nodes) == 4 for a in attempts), story

        # What the trainer itself loaded: each launch starts where the previous one's
        # final checkpoint left it, and that checkpoint is the newest step it trained.
        text = output.read_text()
        starts = [(int(w), int(s), path) for w, s, path in STARTS.findall(text)]
        assert len(starts) == job["restart_cnt"] + 1, story
        assert starts[0][1] == 0 and not starts[0][2]
        lines = [json.loads(line) for line in (record / "steps.jsonl").read_text().splitlines()]
        trained = [line["step"] for line in lines]
        assert trained == list(range(1, STEPS + 1)), "a step was lost or trained twice"
        for world, start, path in starts[1:]:
            assert world == 4
            # An allocation whose start-up took all its time trained nothing and saved
            # nothing: the next one starts from nothing again, as the first did.
            expected = str(tmp_path / "timed" / "ckpt" / f"step-{start}") if start else ""
            assert path == expected, story
        assert sum(1 for *_, path in starts if path) >= CROSSINGS, story
        # Same global samples and bitwise-equal parameters as the unfaulted run.
        reference = {
            line["step"]: line
            for line in map(json.loads, (ref_record / "steps.jsonl").read_text().splitlines())
        }
        for line in lines:
            assert sorted(line["samples"]) == sorted(reference[line["step"]]["samples"])
        final = torch.load(record / "final.pt")
        expected = torch.load(ref_record / "final.pt")
        assert final.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(final[name], tensor), name
        resumes = [start for _, start, _ in starts[1:]]
        print("time-limit crossings:", json.dumps({"crossings": job["restart_cnt"],
              "resume_steps": resumes, "steps_lost": 0}))  # fmt: skip
    finally:
        supervisor.stop()
        slurm_cluster.restore()
