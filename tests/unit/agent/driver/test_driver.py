"""The in-job driver against a real API server, with srun and scontrol replaced by scripts.

The fake ``srun`` records its argv and exits with the next code from a list;
``scontrol`` expands node lists. The supervisor side is the real aiohttp app
over a :class:`MemoryDirectory` that answers as told.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.driver import warm
from agent.driver.argv import agent_argv
from agent.driver.loop import Driver
from agent.driver.settings import DriverSettings, settings_from
from agent.wire import protocol
from agent.wire.auth import new_secret, write_secret
from agent.wire.errors import ConfigError
from agent.wire.protocol import DriverAction, DriverAnswer, DriverPhase
from supervisor.api import MemoryDirectory, bound_port, build_app, serve, shutdown

JOB = "4711"
SECRET = new_secret()

FAKE_SRUN = """#!/usr/bin/env python3
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
log = os.environ["FAKE_LOG"]
if "agent.node.warmpool" in sys.argv:  # the warm pools: logged apart, run until ended
    with open(log + ".warm", "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    signal.signal(signal.SIGTERM, lambda *_: (open(log + ".warm", "a").write("ended\\n"),
                                              sys.exit(143)))
    time.sleep(float(os.environ.get("FAKE_WARM_LISTEN_S", "0")))
    nodes = int(next(a for a in sys.argv if a.startswith("--nodes=")).split("=")[1])
    if not os.environ.get("FAKE_WARM_SILENT"):  # each node's pool says it listens
        with open(log + ".order", "a") as f:
            f.write("pools listen\\n")
        print("\\n".join(f"resurgo-warmpool: listening on node{n + 1}" for n in range(nodes)))
    print("a pool's own output", flush=True)
    time.sleep(float(os.environ.get("FAKE_WARM_S", "300")))
    sys.exit(1)
if "agent.node.sparecheck" in sys.argv:  # the idle spares' health check: its own log
    with open(log + ".checks", "a") as f:
        f.write(json.dumps(sys.argv[1:]) + "\\n")
    print(os.environ.get("FAKE_SPARE_OUTPUT", ""), flush=True)
    sys.exit(int(os.environ.get("FAKE_SPARE_EXIT", "0")))
with open(log, "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
with open(log + ".skips", "a") as f:
    f.write(json.dumps(os.environ.get("RESURGO_SKIP_SAMPLES")) + "\\n")
with open(log + ".order", "a") as f:
    f.write("launch\\n")
codes = json.loads(open(os.environ["FAKE_CODES"]).read())
calls = sum(1 for _ in open(log))
runs = os.environ.get("FAKE_RUN_S", "0").split(",")  # seconds, per call
time.sleep(float(runs[min(calls, len(runs)) - 1]))
sys.exit(codes[min(calls, len(codes)) - 1])
"""
FAKE_SCONTROL = """#!/bin/sh
if [ "$1" = requeue ]; then echo "$@" >> "$FAKE_REQUEUES"; exit 0; fi
case "$2" in
  hostnames) echo node1; echo node2; echo node3 ;;
  node) echo "NodeName=$3 Arch=x86_64 NodeAddr=10.0.0.${3#node} NodeHostName=$3" ;;
esac
"""
# squeue -o "%L %l": the time left and the limit, from a file the test writes.
FAKE_SQUEUE = """#!/bin/sh
cat "$FAKE_TIME_LEFT" 2>/dev/null || echo "UNLIMITED UNLIMITED"
"""
# A step whose agents stop their ranks when the driver's time-limit notice appears.
FAKE_SRUN_STOPPING = """#!/usr/bin/env python3
import os, sys, time
notice = sys.argv[sys.argv.index("--time-limit-file") + 1]
for _ in range(300):
    if os.path.exists(notice):
        sys.exit(1)
    time.sleep(0.1)
"""


def fake_bin(tmp_path: Path, codes: list[int]) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    (tmp_path / "codes.json").write_text(json.dumps(codes))
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_LOG": str(tmp_path / "srun.log"),
        "FAKE_CODES": str(tmp_path / "codes.json"),
        "FAKE_REQUEUES": str(tmp_path / "requeues.log"),
        "FAKE_TIME_LEFT": str(tmp_path / "time-left"),
        "SLURM_JOB_ID": JOB,
        "SLURM_JOB_NODELIST": "node[1-3]",
        # The batch host: the rendezvous port is probed in the driver's process.
        "SLURMD_NODENAME": "node1",
    }


def srun_calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "srun.log"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def drive(
    tmp_path: Path,
    codes: list[int],
    answers: list[DriverAnswer],
    *,
    serve_api: bool = True,
    **settings: Any,
) -> tuple[int, MemoryDirectory]:
    environ = {**os.environ, **fake_bin(tmp_path, codes), **settings.pop("environ", {})}
    signals = settings.pop("signals", [])
    before = settings.pop("before", None)
    # Answers given only once the first step runs (its srun wrote its log line): an
    # answer queued before would reach the driver before the step's process started.
    once_running: list[DriverAnswer] = settings.pop("once_running", [])
    # Answers given once a condition holds, after those above (``(condition, answers)``).
    later: tuple[Any, list[DriverAnswer]] | None = settings.pop("later", None)
    ckpt_root = settings.pop("ckpt_root", "/ckpt")
    # The driver answers (counted from 0) that arrive cut off (a supervisor killed mid-reply).
    cut_answers: tuple[int, ...] = settings.pop("cut_answers", ())
    job_dir = tmp_path / "state" / "jobs" / JOB
    job_dir.mkdir(parents=True)
    write_secret(job_dir / "secret", SECRET)
    directory = MemoryDirectory()
    directory.add_job(JOB, SECRET, ("node1", "node2", "node3"))
    for answer in answers:
        directory.answer_driver(JOB, answer)
    if before is not None:
        before()

    async def scenario() -> int:
        app = build_app(directory)
        if cut_answers:
            app.middlewares.append(_cut_off(cut_answers))
        runner = await serve(app, "127.0.0.1", 0)
        port = bound_port(runner)
        if not serve_api:
            await shutdown(runner)
        try:
            config = DriverSettings(
                job_id=JOB,
                job_dir=job_dir,
                supervisor_url=f"http://127.0.0.1:{port}",
                ckpt_root=ckpt_root,
                command=("torchrun", "train.py"),
                **settings,
            )
            running = asyncio.create_task(Driver(config, environ).run())
            if once_running:
                while not srun_calls(tmp_path) and not running.done():
                    await asyncio.sleep(0.05)
                for answer in once_running:
                    directory.answer_driver(JOB, answer)
            if later is not None:
                condition, answers = later
                while not condition() and not running.done():
                    await asyncio.sleep(0.05)
                for answer in answers:
                    directory.answer_driver(JOB, answer)
            for delay_s, signum in signals:
                await asyncio.sleep(delay_s)
                os.kill(os.getpid(), signum)
            return await asyncio.wait_for(running, 60)
        finally:
            if serve_api:
                await shutdown(runner)

    return asyncio.run(scenario()), directory


def _cut_off(which: tuple[int, ...]) -> Any:
    """A middleware that sends half the body of the driver answers numbered ``which``."""
    answered = [0]

    @web.middleware
    async def cut(request: web.Request, handler: Any) -> web.StreamResponse:
        response = await handler(request)
        if request.path != protocol.DRIVER_PATH:
            return response
        answered[0] += 1
        if answered[0] - 1 not in which:
            return response
        assert isinstance(response, web.Response) and response.body is not None
        whole = bytes(response.body)  # type: ignore[arg-type]
        return web.Response(body=whole[: len(whole) // 2], content_type="application/json")

    return cut


def test_a_step_that_succeeds_ends_the_job_successfully(tmp_path: Path) -> None:
    status, directory = drive(tmp_path, [0], [])
    assert status == 0
    (argv,) = srun_calls(tmp_path)
    assert argv[:6] == ["--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                        "--nodelist=node1,node2,node3", "--overlap",
                        "--kill-on-bad-exit=0"]  # fmt: skip
    assert argv[argv.index("--master-addr") + 1] == "10.0.0.1"
    assert argv[argv.index("--master-node") + 1] == "node1"  # hosts the rendezvous store
    # Each node's rank is its place in the order: torchrun's static rendezvous.
    assert argv[argv.index("--node-order") + 1] == "node1,node2,node3"
    assert argv[argv.index("--attempt") + 1] == "1"
    assert argv[-3:] == ["--", "torchrun", "train.py"]
    assert [r.phase for r in directory.driver_requests(JOB)] == [DriverPhase.START]


def test_after_a_failure_the_driver_relaunches_where_told_and_confirms(tmp_path: Path) -> None:
    relaunch = DriverAnswer(
        DriverAction.RELAUNCH, 2, ("node1", "node3"), "/ckpt/step-8", "4711/2/relaunch/2"
    )
    launch = DriverAnswer(DriverAction.LAUNCH, 1)
    wait = DriverAnswer(DriverAction.WAIT, 2, reason="validating", retry_after_s=0.05)
    status, directory = drive(tmp_path, [1, 0], [launch, wait, relaunch], start_check_s=0.0)
    assert status == 0
    first, second = srun_calls(tmp_path)
    assert "--nodelist=node1,node3" in second and "--nodes=2" in second
    assert second[second.index("--resume-from") + 1] == "/ckpt/step-8"
    assert second[second.index("--attempt") + 1] == "2"
    assert "--resume-from" not in first
    assert "--skip-samples" not in first + second
    phases = [(r.phase, r.exit_code, r.action_id, r.ok) for r in directory.driver_requests(JOB)]
    assert phases == [
        (DriverPhase.START, None, None, None),
        (DriverPhase.ENDED, 1, None, None),  # the step failed: what now?
        # asked again after the wait, saying again how the step ended (the
        # supervisor may have restarted in between)
        (DriverPhase.ENDED, 1, None, None),
        (DriverPhase.RELAUNCHED, None, "4711/2/relaunch/2", True),
    ]


def test_before_a_relaunch_the_rejected_checkpoints_are_quarantined_and_reported(
    tmp_path: Path,
) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    from tests.fakes.checkpoints import hf_checkpoint

    root = tmp_path / "out"
    chosen, broken = hf_checkpoint(root, 20), hf_checkpoint(root, 40)
    relaunch = DriverAnswer(
        DriverAction.RELAUNCH, 2, ("node1", "node3"), str(chosen), "4711/2/relaunch/2",
        quarantine=((str(broken), "model.safetensors: truncated"),),
    )  # fmt: skip
    launch = DriverAnswer(DriverAction.LAUNCH, 1)
    status, directory = drive(
        tmp_path, [1, 0], [launch, relaunch], start_check_s=0.0, ckpt_root=str(root)
    )
    assert status == 0
    # What the script's own resume line reads now is the checkpoint the supervisor chose.
    assert get_last_checkpoint(str(root)) == str(chosen)
    [confirmed] = [r for r in directory.driver_requests(JOB) if r.phase is DriverPhase.RELAUNCHED]
    [(source, target)] = confirmed.quarantined
    assert source == "checkpoint-40" and target.startswith(".resurgo-quarantine/checkpoint-40.")
    assert (root / target / "trainer_state.json").is_file()
    # Reported once: later questions do not carry it again.
    later = [r for r in directory.driver_requests(JOB) if r.phase is not DriverPhase.RELAUNCHED]
    assert all(not r.quarantined for r in later)


def test_after_a_rollback_every_checkpoint_newer_than_the_chosen_one_is_moved_aside(
    tmp_path: Path,
) -> None:
    """The supervisor named checkpoint-40 (past the rollback's point when it validated);
    the stopped run saved checkpoint-60 after that. Both go aside at the relaunch, so
    get_last_checkpoint resumes from checkpoint-20, before the anomaly."""
    from transformers.trainer_utils import get_last_checkpoint

    from tests.fakes.checkpoints import hf_checkpoint

    root = tmp_path / "out"
    chosen, named, later = (hf_checkpoint(root, step) for step in (20, 40, 60))
    relaunch = DriverAnswer(
        DriverAction.RELAUNCH, 2, ("node1", "node3"), str(chosen), "4711/2/relaunch/2",
        quarantine=((str(named), "step 40 lies past the rollback to step 20"),),
        aside_after_step=20,
    )  # fmt: skip
    launch = DriverAnswer(DriverAction.LAUNCH, 1)
    status, directory = drive(
        tmp_path, [1, 0], [launch, relaunch], start_check_s=0.0, ckpt_root=str(root)
    )
    assert status == 0
    assert get_last_checkpoint(str(root)) == str(chosen)
    [confirmed] = [r for r in directory.driver_requests(JOB) if r.phase is DriverPhase.RELAUNCHED]
    assert sorted(source for source, _ in confirmed.quarantined) == [
        "checkpoint-40", "checkpoint-60",
    ]  # fmt: skip
    assert not named.exists() and not later.exists()


def test_the_samples_to_skip_reach_the_agents_flags_and_no_stale_value_their_environment(
    tmp_path: Path,
) -> None:
    launch = DriverAnswer(DriverAction.LAUNCH, 1, skip_samples=((0, 64), (1024, 2048)))
    relaunch = DriverAnswer(
        DriverAction.RELAUNCH, 2, ("node1",), "/ckpt/step-8", "4711/2/relaunch/2",
        skip_samples=((4096, 4160),),
    )  # fmt: skip
    stale = {"RESURGO_SKIP_SAMPLES": "0:8"}
    status, _ = drive(tmp_path, [1, 0], [launch, relaunch], start_check_s=0.0, environ=stale)
    assert status == 0
    first, second = srun_calls(tmp_path)
    assert first[first.index("--skip-samples") + 1] == "0:64,1024:2048"
    assert second[second.index("--skip-samples") + 1] == "4096:4160"
    assert second.index("--skip-samples") < second.index("--")
    # The agents learn the windows from their flags alone, never from the batch's env.
    assert (tmp_path / "srun.log.skips").read_text().splitlines() == ["null", "null"]


def test_told_to_wait_before_its_first_launch_the_driver_asks_to_start_again(
    tmp_path: Path,
) -> None:
    # Slurm started a requeued job while the supervisor still chooses the checkpoint.
    wait = DriverAnswer(DriverAction.WAIT, 3, reason="choosing a checkpoint", retry_after_s=0.05)
    launch = DriverAnswer(DriverAction.LAUNCH, 3, resume_from="/ckpt/step-8")
    status, directory = drive(tmp_path, [0], [wait, launch], start_check_s=0.0)
    assert status == 0
    (call,) = srun_calls(tmp_path)
    assert call[call.index("--resume-from") + 1] == "/ckpt/step-8"
    phases = [(r.phase, r.attempt) for r in directory.driver_requests(JOB)]
    assert phases == [(DriverPhase.START, None), (DriverPhase.START, None)]


def test_told_to_stop_the_driver_exits_93_do_not_requeue_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stop = DriverAnswer(DriverAction.STOP, 2, reason="crash loop: exit:1 at step 6 again")
    status, _ = drive(tmp_path, [1], [DriverAnswer(DriverAction.LAUNCH, 1), stop])
    assert status == 93
    assert "crash loop: exit:1 at step 6 again" in capsys.readouterr().out


def test_told_the_run_completed_after_a_failed_step_the_driver_exits_0(tmp_path: Path) -> None:
    """A rank died in its teardown after the last step: the supervisor says the run
    completed, and Slurm must record the job COMPLETED, not FAILED with 93."""
    launch = DriverAnswer(DriverAction.LAUNCH, 1)
    done = DriverAnswer(DriverAction.DONE, 1, reason="completed: every rank reached step 80")
    status, directory = drive(tmp_path, [134], [launch, done])
    assert status == 0
    assert len(srun_calls(tmp_path)) == 1
    assert [r.phase for r in directory.driver_requests(JOB)] == [
        DriverPhase.START, DriverPhase.ENDED,
    ]  # fmt: skip


def test_told_the_run_completed_while_its_launchers_wait_the_driver_ends_the_step(
    tmp_path: Path,
) -> None:
    """Torchrun on the nodes whose ranks exited 0 waits in its exit barrier (300 s) for the
    node whose rank died in its teardown; once told the run completed, the step ends."""
    launch = DriverAnswer(DriverAction.LAUNCH, 1)
    done = DriverAnswer(DriverAction.DONE, 1, reason="completed: every rank reached step 80")
    began = time.monotonic()
    status, _ = drive(  # the step would run 60 s unless ended
        tmp_path, [0], [launch], once_running=[done], environ={"FAKE_RUN_S": "60"}, watch_s=0.1
    )
    assert status == 0 and time.monotonic() - began < 30
    assert len(srun_calls(tmp_path)) == 1


def test_an_unreachable_supervisor_at_start_does_not_keep_the_job_from_running(
    tmp_path: Path,
) -> None:
    status, _ = drive(tmp_path, [0], [], serve_api=False, supervisor_wait_s=0.5, start_wait_s=0.5)
    assert status == 0
    assert len(srun_calls(tmp_path)) == 1


def test_without_a_supervisor_a_job_with_spares_runs_its_world_on_the_first_nodes(
    tmp_path: Path,
) -> None:
    status, _ = drive(
        tmp_path, [0], [], serve_api=False, supervisor_wait_s=0.5, start_wait_s=0.5,
        world_nodes=2,
    )  # fmt: skip
    assert status == 0
    (call,) = srun_calls(tmp_path)
    assert "--nodelist=node1,node2" in call and "--nodes=2" in call  # node3 is the spare


def test_told_where_to_launch_the_driver_leaves_the_spares_idle(tmp_path: Path) -> None:
    launch = DriverAnswer(DriverAction.LAUNCH, 1, nodes=("node1", "node3"))
    status, _ = drive(tmp_path, [0], [launch])
    assert status == 0
    (call,) = srun_calls(tmp_path)
    assert "--nodelist=node1,node3" in call and "--nodes=2" in call


def test_an_unreachable_supervisor_after_a_failure_ends_the_job_with_the_steps_status(
    tmp_path: Path,
) -> None:
    status, _ = drive(tmp_path, [3], [], serve_api=False, supervisor_wait_s=0.5, start_wait_s=0.5)
    assert status == 3
    assert len(srun_calls(tmp_path)) == 1  # no guess at where to relaunch


def test_an_answer_cut_off_on_the_way_is_asked_for_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    relaunch = DriverAnswer(
        DriverAction.RELAUNCH, 2, ("node1", "node3"), "/ckpt/step-8", "4711/2/relaunch/2"
    )
    launch = DriverAnswer(DriverAction.LAUNCH, 1)
    # The supervisor answers a question asked again as before; this directory hands
    # each queued answer out once, so each cut answer is queued twice.
    answers = [launch, launch, relaunch, relaunch]
    status, _ = drive(tmp_path, [1, 0], answers, start_check_s=0.0, cut_answers=(0, 2))
    assert status == 0
    _, second = srun_calls(tmp_path)
    assert second[second.index("--resume-from") + 1] == "/ckpt/step-8"
    warnings = [r.getMessage() for r in caplog.records if "not understood" in r.getMessage()]
    assert len(warnings) == 2 and "driver_answer" in warnings[0]


def test_an_unanswered_question_logs_the_time_spent_apart_from_the_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    drive(tmp_path, [0], [], serve_api=False, supervisor_wait_s=600, start_wait_s=2)
    messages = [record.getMessage() for record in caplog.records]
    assert any(re.search(r"no answer for [0-9] s \(gives up after 2 s\)", m) for m in messages)
    # The time spent depends on the jittered backoff: any, but said apart from the limit.
    assert any(re.search(r"no answer for \d+ s \(gave up after 2 s\)", m) for m in messages)
    assert not any("600 s" in r.getMessage() for r in caplog.records)


def test_the_driver_needs_slurm_and_a_command() -> None:
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        settings_from(["--jobs-dir", "/s", "--supervisor-url", "u", "--ckpt-root", "/c"], {})
    with pytest.raises(ConfigError, match="no command"):
        settings_from(
            ["--jobs-dir", "/s", "--supervisor-url", "u", "--ckpt-root", "/c"],
            {"SLURM_JOB_ID": "1"},
        )
    settings = settings_from(
        ["--jobs-dir", "/s", "--supervisor-url", "http://h:1/", "--ckpt-root", "/c", "--", "x"],
        {"SLURM_JOB_ID": "12"},
    )
    argv = agent_argv(settings, ("a", "b"), "10.0.0.1", 3, None, 40001)
    assert "--skip-samples" not in argv
    skipping = agent_argv(settings, ("a",), "10.0.0.1", 3, None, 40001, ((8, 16), (32, 40)))
    assert skipping[skipping.index("--skip-samples") + 1] == "8:16,32:40"
    assert settings.job_dir == Path("/s/12")
    assert argv[argv.index("--secret-file") + 1] == "/s/12/secret"
    assert argv[argv.index("--supervisor-url") + 1] == "http://h:1"
    assert argv[argv.index("--master-port") + 1] == "40001"
    assert protocol.DRIVER_PATH == "/v1/driver"


def test_a_slurm_warning_long_before_the_lead_does_not_stop_the_ranks(tmp_path: Path) -> None:
    # Slurm sends USR1 up to a minute early: with 10 minutes left of 30 (lead 180 s)
    # the ranks train on; the driver's timer stops them at the right moment.
    (tmp_path / "time-left").write_text("10:00 30:00\n")
    status, directory = drive(
        tmp_path,
        [0],
        [],
        environ={"FAKE_RUN_S": "30"},
        signals=[(1.5, signal.SIGUSR1), (1.5, signal.SIGTERM)],
    )
    assert status == 143  # ended by the test's SIGTERM, not by a planned stop
    assert not (tmp_path / "state" / "jobs" / JOB / "time-limit.json").exists()
    phases = [r.phase for r in directory.driver_requests(JOB)]
    assert DriverPhase.TIME_LIMIT not in phases and DriverPhase.ENDED not in phases


def test_near_the_time_limit_the_agents_get_a_notice_and_the_driver_requeues_itself(
    tmp_path: Path,
) -> None:
    # 12 s left of a 1-minute limit (lead 15 s): the planned stop starts at once; the
    # memory directory never requeues, so the driver does it itself near the end.
    (tmp_path / "time-left").write_text("0:12 1:00\n")
    bin_dir = tmp_path / "bin"
    environ = {"FAKE_RUN_S": "30"}

    def stopping_srun() -> None:
        (bin_dir / "srun").write_text(FAKE_SRUN_STOPPING)

    status, directory = drive(
        tmp_path,
        [0],
        [DriverAnswer(DriverAction.LAUNCH, 3)],
        environ=environ,
        signals=[(9.0, signal.SIGTERM)],  # Slurm ends the requeued job's script
        before=stopping_srun,
    )
    assert status == 143
    notice = json.loads((tmp_path / "state" / "jobs" / JOB / "time-limit.json").read_text())
    assert notice["attempt"] == 3
    assert notice["warned_unix_s"] < notice["save_by_unix_s"] < notice["end_unix_s"]
    assert 11.0 <= notice["end_unix_s"] - notice["warned_unix_s"] <= 12.5
    requests = directory.driver_requests(JOB)
    limits = [r for r in requests if r.phase is DriverPhase.TIME_LIMIT]
    assert [r.exit_code for r in limits] == [None, 1]  # the notice, then the ranks stopped
    assert all(r.attempt == 3 and r.time_left_s is not None for r in limits)
    assert DriverPhase.ENDED not in [r.phase for r in requests]  # no fault reported
    assert (tmp_path / "requeues.log").read_text().split() == ["requeue", JOB]


def test_a_step_the_supervisor_gave_up_on_is_ended_and_relaunched(tmp_path: Path) -> None:
    # A task on a dead node never ends: the step runs on until the driver ends it.
    relaunch = DriverAnswer(
        DriverAction.RELAUNCH, 2, ("node1", "node2"), "/ckpt/step-4", "4711/2/relaunch/2"
    )
    status, directory = drive(
        tmp_path,
        [0, 0],
        [DriverAnswer(DriverAction.LAUNCH, 1)],
        once_running=[relaunch],
        environ={"FAKE_RUN_S": "60,0"},  # the first step only ends when the driver ends it
        watch_s=0.2,
        start_check_s=0.0,
        kill_grace_s=2.0,
    )
    assert status == 0  # the relaunched step succeeded
    calls = srun_calls(tmp_path)
    assert len(calls) == 2 and "--nodelist=node1,node2" in calls[1]
    phases = [r.phase for r in directory.driver_requests(JOB)]
    assert phases[:2] == [DriverPhase.START, DriverPhase.RUNNING]
    assert DriverPhase.RELAUNCHED in phases
    assert DriverPhase.ENDED not in phases  # it was told, it did not have to ask


def spare_check_calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "srun.log.checks"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.mark.parametrize("exit_code", [0, 1])
def test_told_to_check_the_idle_spares_the_driver_runs_the_gate_there_and_reports_failures(
    tmp_path: Path, exit_code: int
) -> None:
    """The check runs beside the step (srun --overlap on the spares only); the verdicts
    reach the supervisor whatever srun's exit status (a node that failed its check
    makes srun fail): the unhealthy spare with its failing lines, the silent one not
    at all, another job's node or a stray line ignored."""
    verdicts = "\n".join([
        'resurgo-spare-check {"node":"node3","healthy":false,"lines":["ok builtin:gpus (0.00 s): '
        'skipped","FAIL builtin:ckpt_root (0.01 s): /ckpt is not writable"]}',
        'resurgo-spare-check {"node":"node4","healthy":true,"lines":["ok builtin:gpus"]}',
        'resurgo-spare-check {"node":"node9","healthy":false,"lines":["FAIL x"]}',
        "srun: error: node5: task 2: Exited with exit code 1",
        "resurgo-spare-check {not json",
    ])  # fmt: skip
    check = DriverAnswer(DriverAction.WAIT, 1, check_spares=("node3", "node4", "node5"))
    status, directory = drive(
        tmp_path, [0], [DriverAnswer(DriverAction.LAUNCH, 1, nodes=("node1", "node2"))],
        once_running=[check],
        environ={"FAKE_RUN_S": "3", "FAKE_SPARE_OUTPUT": verdicts,
                 "FAKE_SPARE_EXIT": str(exit_code)},
        watch_s=0.2,
    )  # fmt: skip
    assert status == 0
    (call,) = spare_check_calls(tmp_path)
    assert call[:6] == [
        "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--nodelist=node3,node4,node5",
        "--overlap", "--kill-on-bad-exit=0",
    ]  # fmt: skip
    assert call[call.index("--master-addr") + 1] == "10.0.0.1"  # the world's rendezvous
    assert call[call.index("--ckpt-root") + 1] == "/ckpt"
    assert call[-3:] == ["--", "torchrun", "train.py"]
    (report,) = [r for r in directory.driver_requests(JOB) if r.phase is DriverPhase.SPARE_CHECK]
    assert report.attempt == 1
    assert report.checked == ("node3", "node4")
    assert report.unhealthy == (
        ("node3", "FAIL builtin:ckpt_root (0.01 s): /ckpt is not writable"),
    )
    assert len(srun_calls(tmp_path)) == 1  # the training step alone


def test_a_spare_check_still_running_when_its_step_ends_is_ended_before_the_next_step(
    tmp_path: Path,
) -> None:
    """The supervisor moves on (a relaunch) while a check hangs on a spare: the check's
    srun is killed with its process group before the relaunched step starts, and
    reports nothing."""
    sleeper, seen = tmp_path / "sleeper", tmp_path / "check-alive-at-steps"
    script = FAKE_SRUN.replace(
        'print(os.environ.get("FAKE_SPARE_OUTPUT", ""), flush=True)',
        f'open({str(sleeper)!r}, "w").write(str(os.getpid())); time.sleep(120)',
    ).replace(
        "codes = json.loads(",
        f"""alive = False
if os.path.exists({str(sleeper)!r}):
    try:
        os.kill(int(open({str(sleeper)!r}).read()), 0)
        alive = True
    except ProcessLookupError:
        pass
open({str(seen)!r}, "a").write(str(alive) + " ")
codes = json.loads(""",
    )

    def hang_the_check() -> None:
        (tmp_path / "bin" / "srun").write_text(script)

    check = DriverAnswer(DriverAction.WAIT, 1, check_spares=("node3",))
    relaunch = DriverAnswer(
        DriverAction.RELAUNCH, 2, ("node1", "node3"), "/ckpt/step-4", "4711/2/relaunch/2"
    )
    status, directory = drive(
        tmp_path, [0, 0], [DriverAnswer(DriverAction.LAUNCH, 1, nodes=("node1", "node2"))],
        once_running=[check], later=(sleeper.exists, [relaunch]), environ={"FAKE_RUN_S": "60,0"},
        watch_s=0.2, start_check_s=0.0, kill_grace_s=2.0, before=hang_the_check,
    )  # fmt: skip
    assert status == 0
    assert seen.read_text().split() == ["False", "False"]  # gone before the relaunch
    assert all(r.phase is not DriverPhase.SPARE_CHECK for r in directory.driver_requests(JOB))


def warm_log(tmp_path: Path) -> list[str]:
    log = tmp_path / "srun.log.warm"
    return log.read_text().splitlines() if log.exists() else []


def launch_order(tmp_path: Path) -> list[str]:
    return (tmp_path / "srun.log.order").read_text().splitlines()


def test_the_warm_pools_start_on_every_node_before_the_first_launch_and_end_with_the_driver(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # The pools take a second to say they listen: the launch's step waits for them.
    status, _ = drive(
        tmp_path, [0], [], warm_pool=True,
        environ={"FAKE_WARM_LISTEN_S": "1", "FAKE_RUN_S": "0.5"},
    )  # fmt: skip
    assert status == 0
    assert launch_order(tmp_path) == ["pools listen", "launch"]
    out = capfd.readouterr().out
    assert "a pool's own output" in out  # what the pools print reaches the job's output
    assert "listening on" not in out  # but not the lines the driver waits for
    started, ended = warm_log(tmp_path)  # one pool step, ended with the driver
    argv = json.loads(started)
    assert argv[:5] == ["--nodes=3", "--ntasks=3", "--ntasks-per-node=1",
                        "--nodelist=node1,node2,node3", "--overlap"]  # fmt: skip
    assert "--no-kill" in argv and argv[argv.index("--job-id") + 1] == JOB
    assert ended == "ended"
    (launch,) = srun_calls(tmp_path)
    assert launch[launch.index("--warm-pool") + 1] == "true"  # the agents ask the pools


def test_pools_that_end_soon_after_their_start_are_not_started_again_nor_asked(
    tmp_path: Path,
) -> None:
    relaunch = DriverAnswer(DriverAction.RELAUNCH, 2, ("node1", "node3"), None, "4711/2/r/2")
    answers = [DriverAnswer(DriverAction.LAUNCH, 1), relaunch]
    # The first step runs 3 s after the pool step started: it has ended by the relaunch.
    status, _ = drive(
        tmp_path, [1, 0], answers, start_check_s=0.0, warm_pool=True,
        environ={"FAKE_WARM_S": "0", "FAKE_RUN_S": "3,0"},
    )  # fmt: skip
    assert status == 0
    assert len(warm_log(tmp_path)) == 1  # started once, ended at once, not again
    _, relaunch = srun_calls(tmp_path)
    assert "--warm-pool" not in relaunch  # the relaunch's agents wait for no pool


@pytest.mark.parametrize(
    ("listening_s", "step_s"),
    [(1.0, "300"), (60.0, "0")],
    ids=["silent pools: the wait's end", "a pool step that ended: the step's end"],
)
def test_pools_that_never_say_they_listen_hold_the_launch_back_only_so_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listening_s: float, step_s: str
) -> None:
    monkeypatch.setattr(warm, "LISTENING_S", listening_s)
    began = time.monotonic()
    status, _ = drive(
        tmp_path, [0], [], warm_pool=True,
        environ={"FAKE_WARM_SILENT": "1", "FAKE_WARM_S": step_s, "FAKE_RUN_S": "0"},
    )  # fmt: skip
    assert status == 0
    assert launch_order(tmp_path) == ["launch"]
    assert time.monotonic() - began < 30  # neither the step's 300 s nor the wait's 60 s


def test_turned_off_in_the_jobs_environment_no_pool_starts_and_the_agents_ask_none(
    tmp_path: Path,
) -> None:
    argv = ["--jobs-dir", str(tmp_path), "--supervisor-url", "http://x", "--ckpt-root", "/c",
            "--", "torchrun", "t.py"]  # fmt: skip
    environ = {**os.environ, "SLURM_JOB_ID": JOB}
    environ.pop("RESURGO_WARM_POOL", None)
    assert settings_from(argv, environ).warm_pool is True  # on unless turned off
    assert settings_from(argv, {**environ, "RESURGO_WARM_POOL": "0"}).warm_pool is False
    assert settings_from(["--no-warm-pool", *argv], environ).warm_pool is False
    status, _ = drive(tmp_path, [0], [], warm_pool=False)
    assert status == 0
    assert warm_log(tmp_path) == []
    (launch,) = srun_calls(tmp_path)
    assert "--warm-pool" not in launch
