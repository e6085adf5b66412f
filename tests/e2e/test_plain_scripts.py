"""A training script that imports nothing from Resurgo, under ``resurgo submit`` on the
live 4-node cluster (tests/workers/ddp_plain.py: DDP on gloo, its own
``torch.save`` checkpoint and resume, ``iter N`` prints).

The ranks' progress comes from the bootstrap's optimizer-step hook
(agent.train.autohooks). One rank sleeping inside an iteration leaves its
peers waiting in DDP's backward, in native code: their agents confirm it with
native stacks, and the sleeping rank's node, the only one that reported no
waiting rank, is blamed. The script then resumes from its own checkpoint.
"""

from __future__ import annotations

import re
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import LiveCluster
from tests.e2e.jobs import attempts, drained, ended, status, story_of, submit_job, victim_of
from tests.supervisor_harness import TORCHRUN, SupervisorProcess

pytestmark = pytest.mark.slurm

PLAIN = Path(__file__).resolve().parents[1] / "workers" / "ddp_plain.py"
ITERS = 40


def submit_plain(supervisor: SupervisorProcess, where: Path, *script_args: str) -> tuple[int, Path]:
    out_dir = where / "out"
    out_dir.mkdir()
    command = [*TORCHRUN, str(PLAIN), "--out-dir", str(out_dir), "--max-iters", str(ITERS)]
    return submit_job(supervisor, where, [*command, *script_args])


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_a_rank_sleeping_in_ddp_backward_is_blamed_and_the_script_resumes_itself(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    job_id, output = submit_plain(
        supervisor, tmp_path, "--iter-s", "0.5", "--sleep-at", "15", "--sleep-rank", "2",
        "--sleep-s", "600",
    )  # fmt: skip
    seen = slurm_cluster.wait_for(
        "the job running on steps from the bootstrap",
        lambda: (job := status(supervisor, job_id))["state"] == "running" and job,
        timeout_s=120,
    )
    assert seen["attempt"] == 1
    (victim,) = slurm_cluster.wait_for(
        "rank 2 asleep",
        lambda: re.findall(
            r"rank 2 sleeping [\d.]+ s in iter 15 on (node\d) ", output.read_text(errors="replace")
        ),
        timeout_s=120,
    )
    asleep_at = time.monotonic()
    slurm_cluster.wait_for(
        f"{victim} drained",
        lambda: drained(supervisor, job_id),
        timeout_s=8 + 30 + 60,  # the adaptive timeout (floor 8 s) + 30 s, and evidence
    )
    detected_s = time.monotonic() - asleep_at
    assert drained(supervisor, job_id) == [(victim, "hang")], output.read_text()
    job, text = ended(slurm_cluster, supervisor, job_id, output, timeout_s=300)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    assert f"done at iter {ITERS} with world 3" in text, told
    # The script went on from its own checkpoint, not from iteration 0.
    assert re.search(r"resuming training from \S+ckpt.pt at iter 10 ", text), told
    assert len(attempts(supervisor, job_id)) == 2
    with supervisor.store() as store:
        hangs = store.events_for(str(job_id), kinds=["hang"])
    reported = {e.node for e in hangs if not e.payload.get("stalled")}
    assert victim not in reported and len(reported) == 3, reported
    # The sleeping rank's node told that its rank stopped outside any collective: the
    # evidence window closed on it, and blame named the rank the others wait for.
    assert {e.node for e in hangs if e.payload.get("stalled")} == {victim}, told
    assert "outside the collective the others wait in" in told, told
    # Asleep is idle: its node never said compute (which would hold the peers' reports).
    assert "is in compute" not in supervisor.log(), told
    print(f"detected and drained {detected_s:.1f} s after the rank fell asleep")


@pytest.mark.long
def test_a_60_s_evaluation_a_60_s_rank_0_save_and_a_60_s_loader_stall_are_no_hang(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """Ranks 1-3 wait in a barrier through rank 0's save, far past the 8 s floor: their
    reports are held while rank 0 is in its checkpoint, then dropped as training
    goes on. Later rank 2's data loader stalls 60 s while the others wait in DDP's
    backward: the bootstrap tells phase data, and the same holds."""
    job_id, output = submit_plain(
        supervisor, tmp_path, "--eval-pause-s", "60", "--save-pause-s", "60",
        "--data-stall-at", "15", "--data-stall-s", "60", "--fault-rank", "2",
    )  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output, timeout_s=420)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    assert f"done at iter {ITERS} with world 4" in text, told
    assert drained(supervisor, job_id) == [], told
    assert len(attempts(supervisor, job_id)) == 1, f"{told}\n--- supervisor ---\n" + "\n".join(
        line for line in supervisor.log().splitlines() if "held" in line or "hang" in line
    )
    assert "held" in supervisor.log(), "the save never kept the peers waiting long enough"
    assert "loader of rank 2 stalling 60.0 s in iter 15" in text, text
    assert "is in data, its peers may wait for it" in supervisor.log(), "no hold for the loader"
    # Goodput from the observed steps, and the script's own newest file as the checkpoint.
    shown_job = status(supervisor, job_id)
    assert shown_job["goodput"] > 0, shown_job
    newest = shown_job["last_checkpoint"]
    assert newest["kind"] == "torch.save" and newest["step"] == ITERS, newest
    assert newest["path"] == str(tmp_path / "out" / "ckpt.pt"), newest
    shown = supervisor.resurgo("status", str(job_id))
    assert f"ckpt.pt (step {ITERS}," in shown.stdout, shown.stdout


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_30_s_of_work_no_hook_sees_on_one_rank_is_no_hang(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """Rank 2 computes 30 s in plain Python (a rank-0-only upload, a recompile) while
    its peers wait in DDP's backward, far past the 8 s floor. Its agent tells phase
    compute (a busy core outside any collective, short of the 60 s busy floor): the
    peers' reports are held, then dropped as training goes on. It comes early in
    the run, while every rank's adaptive timeout is still the floor."""
    job_id, output = submit_plain(
        supervisor, tmp_path, "--max-iters", "20", "--busy-at", "5", "--busy-s", "30",
        "--fault-rank", "2",
    )  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output, timeout_s=300)
    told = story_of(supervisor, job_id, text)
    assert "rank 2 busy 30.0 s in iter 5" in text, text
    assert job["job_state"] == "COMPLETED", told
    assert "done at iter 20 with world 4" in text, told
    assert drained(supervisor, job_id) == [], told
    assert len(attempts(supervisor, job_id)) == 1, told
    log = supervisor.log()
    assert "is in compute, its peers may wait for it" in log, f"no hold for the work\n{log}"


def test_a_wrapper_scripts_torchrun_gets_the_jobs_world_and_a_killed_rank_is_recovered(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """`bash run.sh` ending in `exec torchrun --standalone ...`: Resurgo's torchrun on
    the wrapper's PATH fits it to the job (4 nodes, one world), and a SIGKILLed rank's
    node is drained as for a torchrun given directly."""
    wrapper = tmp_path / "run.sh"
    wrapper.write_text(
        '#!/bin/bash\nset -euo pipefail\necho "wrapper on $(hostname) for $SLURMD_NODENAME"\n'
        f'exec torchrun --standalone --nnodes=1 --nproc-per-node=1 {PLAIN} "$@"\n'
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    job_id, output = submit_job(supervisor, tmp_path, [
        "bash", str(wrapper), "--out-dir", str(out_dir), "--max-iters", str(ITERS),
        "--kill-at", "15", "--fault-rank", "2",
    ])  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    victim = victim_of(output, "killing itself")
    assert drained(supervisor, job_id) == [(victim, "rank_signal")], told
    assert "with world 4" not in text.split("resuming")[0]  # no world ever completed alone
    assert re.search(r"resuming training from \S+ckpt.pt at iter 10 ", text), told
    assert f"done at iter {ITERS} with world 3" in text, told
    assert len(attempts(supervisor, job_id)) == 2
    # Detection and recovery are timed from the bootstrap's steps, as for our trainer.
    with urllib.request.urlopen(f"{supervisor.url}/metrics", timeout=30) as answer:
        metrics = answer.read().decode()
    for name in ("detect", "recover"):
        count = re.search(
            rf'resurgo_job_time_to_{name}_seconds_count{{job_id="{job_id}"}} (\S+)', metrics
        )
        assert count is not None and float(count.group(1)) == 1.0, (name, metrics[-2000:])


def test_an_srun_style_script_runs_one_process_per_rank_and_an_exception_is_retried_once(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """`srun python train.py` with the process group from SLURM_PROCID/SLURM_NTASKS: the
    agents start the ranks themselves (a nested srun would wait for nodes its own step
    holds). Two ranks per node, so each rank's SLURM_PROCID must be its own, not its
    agent's. A Python exception is retried once, on the same nodes, with no drain."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    job_id, output = submit_job(supervisor, tmp_path, [
        "srun", "-u", "--ntasks-per-node=2", sys.executable, str(PLAIN), "--init", "slurm",
        "--out-dir", str(out_dir), "--max-iters", str(ITERS), "--raise-at", "15",
        "--fault-rank", "1",
    ], sizes=("-N", "2", "--min-nodes", "1"))  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    assert "RuntimeError: rank 1 fails in iter 15" in text, told
    assert drained(supervisor, job_id) == []
    assert re.search(r"resuming training from \S+ckpt.pt at iter 10 ", text), told
    assert f"done at iter {ITERS} with world 4" in text, told
    assert status(supervisor, job_id)["restarts"] == {"user_exception": 1}
    tries = attempts(supervisor, job_id)
    assert len(tries) == 2 and tries[0].nodes == tries[1].nodes, tries


def test_a_wrapper_whose_torchrun_keeps_its_own_world_is_stopped_at_once(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """A launcher script that runs torchrun in its own process (torch's elastic API, as
    some frameworks do) with `--standalone --nnodes=1` keeps world 1 on every node:
    four trainings writing one checkpoint. Resurgo says so at once and never calls
    the job complete."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "from torch.distributed.run import main\n"
        f"main(['--standalone', '--nnodes=1', '--nproc-per-node=1', {str(PLAIN)!r},\n"
        f"      '--out-dir', {str(out_dir)!r}, '--max-iters', '400'])\n"
    )
    wrapper = tmp_path / "run.sh"
    wrapper.write_text(f"#!/bin/bash\nexec {sys.executable} {launcher}\n")
    job_id, output = submit_job(supervisor, tmp_path, ["bash", str(wrapper)], sizes=("-N", "4"))
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] != "COMPLETED", told
    shown = status(supervisor, job_id)
    assert shown["state"] == "failed", shown
    reason = shown["final_reason"]
    assert "is in a world of 1 ranks; the job's is 4 nodes x 1 = 4" in reason, reason
    assert "done at iter 400" not in text


@pytest.mark.long  # over a minute in CI: started before the short tests
def test_a_rank_stopped_before_an_all_reduce_is_blamed_and_the_script_resumes_itself(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """SIGSTOP of one rank of the plain script while its peers wait in the loss's
    all_reduce: a hang whose culprit is the stopped rank's node."""
    job_id, output = submit_plain(
        supervisor, tmp_path, "--iter-s", "0.3", "--reduce-loss", "--stop-at", "15",
        "--fault-rank", "2",
    )  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    victim = victim_of(output, "stopping")
    assert drained(supervisor, job_id) == [(victim, "hang")], told
    assert re.search(r"resuming training from \S+ckpt.pt at iter 10 ", text), told
    assert f"done at iter {ITERS} with world 3" in text, told


FSDP2_PLAIN = PLAIN.with_name("fsdp2_plain.py")


def test_an_fsdp2_script_with_a_killed_rank_resumes_from_its_own_dcp_save_on_three_nodes(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """FSDP2 saving its own DCP ``step-N`` directories (tests/workers/fsdp2_plain.py): a
    SIGKILLed rank's node is drained, the job goes on with 3 nodes, and the script
    reshards its own step-10 save 4 -> 3 and trains to the end. The bootstrap notes
    rank 0's saves: the status's checkpoint is the script's newest DCP directory."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    job_id, output = submit_job(supervisor, tmp_path, [
        *TORCHRUN, str(FSDP2_PLAIN), "--out-dir", str(out_dir), "--steps", str(ITERS),
        "--save-every", "10", "--step-s", "0.3", "--kill-at", "15", "--fault-rank", "2",
    ])  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    victim = victim_of(output, "killing itself")
    assert drained(supervisor, job_id) == [(victim, "rank_signal")], told
    # What the relaunch loaded: its own step-10 save (the kill came at step 15).
    resumed = re.findall(r"resuming from (\S+) at step (\d+) ", text)
    assert resumed == [(str(out_dir / "step-10"), "10")], told
    assert "with world 4" not in text.split("resuming")[0]
    assert f"done at step {ITERS} with world 3" in text, told
    assert len(attempts(supervisor, job_id)) == 2
    newest = status(supervisor, job_id)["last_checkpoint"]
    assert (newest["kind"], newest["step"]) == ("dcp", ITERS), newest
    assert newest["path"] == str(out_dir / f"step-{ITERS}"), newest
    shown = supervisor.resurgo("status", str(job_id))
    assert f"step-{ITERS} (step {ITERS}," in shown.stdout, shown.stdout
    with supervisor.store() as store:
        written = store.events_for(str(job_id), kinds=["checkpoint_written"])
    saves = [(e.payload["step"], e.payload["global_rank"]) for e in written]
    assert saves == [(10, 0), (20, 0), (30, 0), (40, 0)], saves  # rank 0's notes only


@pytest.mark.parametrize("export", ["NONE", "PATH"])
def test_a_job_that_exports_nothing_or_one_variable_is_still_supervised(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path, export: str
) -> None:
    """``--export=NONE`` (a clean environment, as many sites advise) and ``--export=VAR``
    (only that variable) reach Resurgo's driver and agents with what they need: the
    job is supervised, its exception retried once and its progress seen."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    job_id, output = submit_job(supervisor, tmp_path, [
        *TORCHRUN, str(PLAIN), "--out-dir", str(out_dir), "--max-iters", str(ITERS),
        "--raise-at", "15", "--fault-rank", "1",
    ], sizes=("-N", "2", "--min-nodes", "1", f"--export={export}"))  # fmt: skip
    job, text = ended(slurm_cluster, supervisor, job_id, output)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    assert "RuntimeError: rank 1 fails in iter 15" in text, told
    assert re.search(r"resuming training from \S+ckpt.pt at iter 10 ", text), told
    assert f"done at iter {ITERS} with world 2" in text, told
    # The supervisor learns of the end from its next Slurm poll (every 2 s).
    seen = slurm_cluster.wait_for(
        "the supervisor to see the job end",
        lambda: (job := status(supervisor, job_id))["state"] != "running" and job,
        timeout_s=30,
    )
    assert seen["restarts"] == {"user_exception": 1}, seen
    assert seen["state"] == "completed", seen
