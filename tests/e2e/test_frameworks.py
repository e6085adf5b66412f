"""The frameworks users run, under ``resurgo submit`` on the live 4-node cluster.

The scripts (tests/frameworks/) import nothing of Resurgo and resume the way
their documentation shows. Each test breaks what a user's night breaks, and
checks what the script itself printed: where it resumed, and that it finished.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from pathlib import Path

import pytest

from agent.node.stacks import dump_all_placed, in_collective
from tests.conftest import LiveCluster
from tests.e2e.jobs import (
    anomaly_events,
    attempts,
    drained,
    ended,
    status,
    story_of,
    submit_job,
)
from tests.e2e.time_limits import raise_limit_after_crossings
from tests.supervisor_harness import TORCHRUN, SupervisorProcess, rank_pids

# Minutes each: started first, so that they are not the tier's tail.
pytestmark = [pytest.mark.slurm, pytest.mark.long]

FRAMEWORKS = Path(__file__).resolve().parents[1] / "frameworks"
STEPS = 80


def submit_framework(
    supervisor: SupervisorProcess,
    where: Path,
    script: str,
    *args: str,
    sizes: tuple[str, ...] = ("-N", "4", "--min-nodes", "2"),
) -> tuple[int, Path]:
    out = where / "out"
    command = [*TORCHRUN, str(FRAMEWORKS / script), "--out", str(out), "--steps", str(STEPS),
               "--save-steps", "20", *args]  # fmt: skip
    return submit_job(supervisor, where, command, sizes)


def kill_node3_rank_and_finish(
    cluster: LiveCluster, supervisor: SupervisorProcess, job_id: int, output: Path, script: str
) -> tuple[str, str]:
    """SIGKILL the script's rank on node3, wait for the job to end COMPLETED; (its output,
    the story told on failure)."""
    pids = rank_pids("node3", marker=script)
    assert pids, output.read_text(errors="replace")[-3000:]
    os.kill(pids[0], 9)
    job, text = ended(cluster, supervisor, job_id, output, timeout_s=420)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    return text, told


def steps_of(text: str) -> list[int]:
    """The steps rank 0 printed, in order (both attempts)."""
    # Not anchored at a line's start: other ranks' and launchers' output shares the file.
    return [int(n) for n in re.findall(r"step (\d+) loss \S+ t \d", text)]


def launches_of(steps: list[int]) -> list[list[int]]:
    """The printed steps split where the count went back (a relaunch)."""
    runs: list[list[int]] = []
    for step in steps:
        if not runs or step <= runs[-1][-1]:
            runs.append([])
        runs[-1].append(step)
    return runs


def resumed_at(text: str) -> int | None:
    """The first step printed after the count went back (a relaunch); None: it never did."""
    steps = steps_of(text)
    return next((after for before, after in itertools.pairwise(steps) if after <= before), None)


def goodput_from_log(text: str, started_s: float, ended_s: float) -> float:
    """The run's goodput as its own log tells it: the time of every step that survives
    into the final run (each the last time its number was printed, less the print of
    the step before it in the same launch), over the job's wall time in Slurm
    (``started_s`` to ``ended_s``). A launch's first step has no print before it: its
    time is the run's median step time."""
    printed = [(int(n), float(t)) for n, t in re.findall(r"step (\d+) loss \S+ t ([\d.]+)", text)]
    durations: dict[int, float] = {}
    spans: list[float] = []
    for index, (step, at) in enumerate(printed):
        before = printed[index - 1] if index else None
        if before is not None and before[0] == step - 1:
            durations[step] = at - before[1]
            spans.append(at - before[1])
        else:
            durations.pop(step, None)
    typical = sorted(spans)[len(spans) // 2]
    productive = sum(durations.get(step, typical) for step in {s for s, _ in printed})
    return productive / (ended_s - started_s)


def assert_goodput_is_the_logs(
    cluster: LiveCluster,
    job_id: int,
    text: str,
    shown: dict,
    told: str,  # type: ignore[type-arg]
) -> None:
    """``resurgo status``'s goodput is within 5 points of the script's own log's, from
    Slurm's submission of the job to its end."""
    job = cluster.job(job_id)
    assert job is not None
    truth = goodput_from_log(text, job["submit_time"], job["end_time"])
    print(f"goodput of job {job_id}: resurgo {shown['goodput']:.3f}, the log {truth:.3f}")
    told += f"\n--- goodput ---\nthe log's {truth:.3f}; {shown}"
    assert abs(shown["goodput"] - truth) <= 0.05, told


def test_a_trainer_with_its_newest_checkpoint_cut_short_and_a_rank_killed_completes(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """Every rank would load checkpoint-40 (get_last_checkpoint takes the highest N) and
    fail on its truncated weights; Resurgo rejects it, moves it into quarantine before
    the relaunch, and the unchanged script resumes from checkpoint-20."""
    job_id, output = submit_framework(supervisor, tmp_path, "hf_trainer.py", "--step-s", "0.5")
    out = tmp_path / "out"
    newest = out / "checkpoint-40"
    slurm_cluster.wait_for(
        "checkpoint-40 saved", lambda: (newest / "trainer_state.json").is_file(), timeout_s=300
    )
    weights = newest / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    text, told = kill_node3_rank_and_finish(
        slurm_cluster, supervisor, job_id, output, "hf_trainer.py"
    )
    assert f"resume from {out / 'checkpoint-20'}" in text, told
    assert resumed_at(text) == 21 and steps_of(text)[-1] == STEPS, told
    assert drained(supervisor, job_id) == [("node3", "rank_signal")], told
    assert len(attempts(supervisor, job_id)) == 2, told
    held = list((out / ".resurgo-quarantine").glob("checkpoint-40.*"))
    assert len(held) == 1 and (held[0] / "trainer_state.json").is_file(), told
    events = supervisor.resurgo("events", str(job_id))
    assert "checkpoint checkpoint-40 failed validation: moved to .resurgo-quarantine/" in (
        events.stdout
    ), events.stdout
    listed = supervisor.resurgo("ckpt", "quarantined", str(out))
    assert "model.safetensors" in listed.stdout and "truncated" in listed.stdout, listed.stdout
    shown = status(supervisor, job_id)
    newest = shown["last_checkpoint"]
    assert newest["kind"] == "huggingface" and newest["step"] == STEPS, newest
    assert newest["path"] == str(out / f"checkpoint-{STEPS}"), newest
    assert_goodput_is_the_logs(slurm_cluster, job_id, text, shown, told)


def test_lightning_with_its_last_ckpt_cut_short_and_a_rank_killed_completes(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """fit(ckpt_path="last") would load the truncated last.ckpt; Resurgo moves it into
    quarantine and leaves a copy of step=40.ckpt in its place."""
    job_id, output = submit_framework(supervisor, tmp_path, "lightning_fit.py", "--step-s", "0.5")
    out = tmp_path / "out"
    slurm_cluster.wait_for(
        "step=40.ckpt saved", lambda: (out / "step=40.ckpt").is_file(), timeout_s=300
    )
    last = out / "last.ckpt"
    slurm_cluster.wait_for("last.ckpt of step 40", lambda: _holds_step(last, 40), timeout_s=60)
    os.truncate(last, last.stat().st_size // 3)
    text, told = kill_node3_rank_and_finish(
        slurm_cluster, supervisor, job_id, output, "lightning_fit.py"
    )
    # Resumed at step 40 (the copy of step=40.ckpt), not at 0, and ran to the end.
    assert resumed_at(text) == 41 and steps_of(text)[-1] == STEPS, told
    assert drained(supervisor, job_id) == [("node3", "rank_signal")], told
    held = list((out / ".resurgo-quarantine").glob("last.ckpt.*"))
    assert len(held) == 1, told
    shown = status(supervisor, job_id)
    newest = shown["last_checkpoint"]
    assert newest["kind"] == "lightning" and newest["step"] == STEPS, newest
    assert_goodput_is_the_logs(slurm_cluster, job_id, text, shown, told)


FIRST_SAVE = {
    "hf_trainer.py": "checkpoint-20/trainer_state.json",
    "lightning_fit.py": "step=20.ckpt",
}


def stop_outside_a_collective(pid: int, tries: int = 20) -> None:
    """SIGSTOP ``pid`` at a moment its stack is outside any collective, as the agent's
    own native-aware dump places it. A rank stopped inside the all-reduce its peers
    wait in looks like them to every stack, and the supervisor then rightly blames
    no node: that is not the hang this test is about."""
    for _ in range(tries):
        os.kill(pid, signal.SIGSTOP)
        dump = dump_all_placed([pid], 30.0)[pid]
        if dump.ok and not in_collective(dump):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.13)  # off the 0.3 s step's beat
    raise AssertionError(f"rank {pid} was inside a collective at each of {tries} stops")


@pytest.mark.parametrize("script", ["hf_trainer.py", "lightning_fit.py"])
def test_a_hung_rank_of_a_framework_is_blamed_on_its_node_and_the_script_resumes_on_three(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path, script: str
) -> None:
    """SIGSTOP of the script's rank on node3 once its first checkpoint is saved: its peers
    wait in DDP's all-reduce, no rank exits, and nothing but the ranks' stacks tells the
    hang (the script imports nothing). node3 is drained; the script resumes from its
    checkpoint of step 20 on three nodes and runs to the end."""
    job_id, output = submit_framework(supervisor, tmp_path, script, "--step-s", "0.3")
    saved = tmp_path / "out" / FIRST_SAVE[script]
    slurm_cluster.wait_for(f"{saved.name} saved", saved.is_file, timeout_s=300)
    pids = rank_pids("node3", marker=script)
    assert pids, output.read_text(errors="replace")[-3000:]
    stop_outside_a_collective(pids[0])
    job, text = ended(slurm_cluster, supervisor, job_id, output, timeout_s=420)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    assert drained(supervisor, job_id) == [("node3", "hang")], told
    assert len(attempts(supervisor, job_id)) == 2, told
    if script == "hf_trainer.py":  # prints a step once it is done: step 21 never was
        assert f"resume from {tmp_path / 'out' / 'checkpoint-20'}" in text, told
    else:  # prints a step as it begins: step 21 twice
        assert resumed_at(text) == 21, told
    assert steps_of(text)[-1] == STEPS, told
    shown = status(supervisor, job_id)
    assert shown["world_size"] == 3 and "node3" not in shown["nodes"], shown


NAN_AT = 45  # the rollback point: step 45 - 1 - anomaly_margin_steps (20) = 24


def finished_after_a_rollback(
    cluster: LiveCluster, supervisor: SupervisorProcess, job_id: int, output: Path
) -> tuple[str, str]:
    """Wait for the job's end: COMPLETED after one rollback, with nothing drained, the
    anomaly found at its step; (the output, the story told on failure)."""
    job, text = ended(cluster, supervisor, job_id, output, timeout_s=420)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED", told
    seen = [(e["kind"], e["onset_step"]) for e in anomaly_events(supervisor, job_id)]
    assert seen == [("non_finite", NAN_AT)], told
    assert len(attempts(supervisor, job_id)) == 2 and drained(supervisor, job_id) == [], told
    last_loss = re.findall(rf"step {STEPS} loss (\S+) t", text)
    assert last_loss and float(last_loss[-1]) == float(last_loss[-1]), told  # not NaN
    return text, told


def test_a_nan_in_a_trainers_loss_is_rolled_back_past_its_newer_valid_checkpoints(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """The loss goes NaN at step 45 (once: the data's fault). The bootstrap reads it off
    backward(); the rollback resumes from checkpoint-20 (at or before step 24) and moves
    the valid checkpoint-40 (and any later one) aside, so that get_last_checkpoint
    does not resume past the anomaly."""
    job_id, output = submit_framework(
        supervisor, tmp_path, "hf_trainer.py", "--step-s", "0.5", "--nan-at-step", str(NAN_AT)
    )
    text, told = finished_after_a_rollback(slurm_cluster, supervisor, job_id, output)
    out = tmp_path / "out"
    assert f"resume from {out / 'checkpoint-20'}" in text, told
    assert resumed_at(text) == 21 and steps_of(text)[-1] == STEPS, told
    held = sorted(p.name.split(".")[0] for p in (out / ".resurgo-quarantine").glob("checkpoint-*"))
    assert held[0] == "checkpoint-40" and set(held) <= {"checkpoint-40", "checkpoint-60"}, told
    events = supervisor.resurgo("events", str(job_id)).stdout
    assert "checkpoint checkpoint-40 step 40 lies past the rollback to step 20" in events, events
    shown = status(supervisor, job_id)
    assert shown["last_checkpoint"]["path"] == str(out / f"checkpoint-{STEPS}"), shown


def test_a_nan_in_lightnings_loss_is_rolled_back_and_last_ckpt_points_before_it(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """The same NaN in a Lightning script: step=40.ckpt and the last.ckpt past it go
    aside, last.ckpt becomes a copy of step=20.ckpt, and fit(ckpt_path="last") resumes
    there."""
    job_id, output = submit_framework(
        supervisor, tmp_path, "lightning_fit.py", "--step-s", "0.5", "--nan-at-step", str(NAN_AT)
    )
    text, told = finished_after_a_rollback(slurm_cluster, supervisor, job_id, output)
    out = tmp_path / "out"
    assert resumed_at(text) == 21 and steps_of(text)[-1] == STEPS, told
    held = {p.name.split(".ckpt")[0] for p in (out / ".resurgo-quarantine").iterdir()}
    assert {"step=40", "last"} <= held, told


# The warning comes 15 s before the one-minute limit: however fast the ranks start,
# 80 steps must take longer than 45 s, or the run ends before the limit (an idle
# machine starts the Trainer in 18 s, Lightning in 16 s). The Trainer's rank 2 also
# aborts after its last step, as a crash in gloo's or CUDA's teardown does.
@pytest.mark.parametrize(("script", "args"), [
    ("hf_trainer.py", ("--step-s", "0.5", "--abort-at-exit-rank", "2")),
    ("lightning_fit.py", ("--step-s", "0.7")),
])  # fmt: skip
def test_a_framework_crossing_its_time_limit_is_requeued_and_resumes_from_its_own_checkpoint(
    slurm_cluster: LiveCluster,
    supervisor: SupervisorProcess,
    tmp_path: Path,
    script: str,
    args: tuple[str, ...],
) -> None:
    """A one-minute limit: the first allocation trains part of the run. The script saves
    only when it saves (no request reaches it), so at the warning its ranks are stopped
    at once and the job requeued; after the first crossing the limit is raised, as an
    operator would, and the next allocation resumes from the script's own newest
    checkpoint. Nothing drained, every restart and all its lost time ``time_limit``.
    A rank that dies in its teardown after the last step (the others exit 0) ends the
    job completed: a restart would train past the end."""
    job_id, output = submit_framework(
        supervisor, tmp_path, script, *args, sizes=("-N", "4", "--time=1")
    )
    raise_limit_after_crossings(slurm_cluster, job_id, 1)
    job, text = ended(slurm_cluster, supervisor, job_id, output, timeout_s=480)
    told = story_of(supervisor, job_id, text)
    assert job["job_state"] == "COMPLETED" and job["restart_cnt"] >= 1, told
    assert drained(supervisor, job_id) == [], told
    # The ranks were gone in time for the supervisor's own requeue: not the driver's
    # fallback 5 s before the end (Lightning catches SIGTERM and outlived a 30 s grace).
    assert "recovering->requeued [time_limit]" in told, told
    launches = launches_of(steps_of(text))
    assert launches and launches[-1][-1] == STEPS, told
    if len(launches) > 1:
        # From the newest checkpoint the first allocation saved (every 20 steps), or
        # from the start when it saved none: the steps after it are what the limit cost.
        reached, resumed = launches[0][-1], launches[1][0]
        assert (resumed - 1) % 20 == 0 and reached - 20 < resumed - 1 <= reached, told
    # else the first allocation's start-up took all its time (a loaded machine).
    shown = status(supervisor, job_id)
    assert shown["state"] == "completed" and set(shown["restarts"]) == {"time_limit"}, shown
    lost = shown["badput_by_cause_s"]
    assert set(lost) <= {"time_limit"}, shown
    if len(launches) > 1:  # steps were trained and lost, or at least waited for
        assert lost.get("time_limit", 0) > 0, shown
    if "--abort-at-exit-rank" in args:
        assert "rank 2 finished training" in text, told
        assert "died in its teardown" in shown["final_reason"], told
    print(f"{script}: launches trained {[(run[0], run[-1]) for run in launches]}; lost {lost}")


def test_deepspeed_with_its_newest_checkpoint_cut_short_and_a_rank_killed_completes(
    slurm_cluster: LiveCluster, supervisor: SupervisorProcess, tmp_path: Path
) -> None:
    """engine.load_checkpoint(out) reads ``latest``: it would load global_step40, cut
    short. Resurgo rejects it, moves it into quarantine, points ``latest`` at
    global_step20, and the unchanged script resumes there on three nodes."""
    job_id, output = submit_framework(supervisor, tmp_path, "deepspeed_train.py", "--step-s", "0.5")
    out = tmp_path / "out"
    latest = out / "latest"
    slurm_cluster.wait_for(
        "global_step40 saved",
        lambda: latest.is_file() and latest.read_text().strip() == "global_step40",
        timeout_s=300,
    )
    weights = out / "global_step40" / "mp_rank_00_model_states.pt"
    os.truncate(weights, weights.stat().st_size // 2)
    text, told = kill_node3_rank_and_finish(
        slurm_cluster, supervisor, job_id, output, "deepspeed_train.py"
    )
    assert f"resume from {out / 'global_step20'}" in text, told
    assert resumed_at(text) == 21 and steps_of(text)[-1] == STEPS, told
    assert drained(supervisor, job_id) == [("node3", "rank_signal")], told
    held = list((out / ".resurgo-quarantine").glob("global_step40.*"))
    assert len(held) == 1, told
    newest = status(supervisor, job_id)["last_checkpoint"]
    assert newest["kind"] == "deepspeed" and newest["step"] == STEPS, newest


def _holds_step(path: Path, step: int) -> bool:
    from agent.checkpoint.layouts.torchfile import peek, step_named

    return path.is_file() and step_named(peek(path)) == step
