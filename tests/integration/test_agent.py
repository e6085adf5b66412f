"""Acceptance for resurgo-agent: real torchrun ranks (gloo, CPU) under a real agent process.

Faults are injected into tests/workers/agent_worker.py; the agent's events are
read from its local events log (and, where the HTTP path is the point, from
tests/recording_server.py acting as the supervisor).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.wire import protocol
from agent.wire.auth import write_secret
from agent.wire.protocol import Command, CommandKind, EventKind
from tests.conftest import REPO, LiveCluster, free_port
from tests.integration.agent_harness import WORKER, RunningAgent
from tests.recording_server import RecordingServer

LOSS_WORKER = REPO / "tests" / "workers" / "loss_worker.py"


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    started: list[RunningAgent] = []

    def start(
        agent_args: list[str],
        worker_args: list[str],
        worker: Path = WORKER,
        command: list[str] | None = None,
        run_dir: bool = True,
    ) -> RunningAgent:
        running = RunningAgent(tmp_path, agent_args, worker_args, worker, command, run_dir)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


def test_sigkilled_rank_is_reported_with_signal_9_within_2_s(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory([], ["--instrumented"])
    pid = int(agent.wait_file("pid.1"))
    agent.wait_file("step.1")
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    event = agent.wait_event(EventKind.RANK_EXITED, 10)
    assert event.payload["global_rank"] == 1 and event.payload["local_rank"] == 1
    assert event.payload["pid"] == pid
    assert event.payload["signal"] == 9 and event.payload["signal_name"] == "SIGKILL"
    assert event.payload["last_step"] >= 1
    assert event.time_unix_s - killed_at < 2.0
    assert event.payload["ranks_left"] == 1  # rank 0 still runs: the node's exits are not in
    assert agent.wait_event(EventKind.LAUNCHER_EXITED, 30).payload["exit_code"] != 0
    # torchrun stopped rank 0: the node's last exit says so, before the launcher's.
    exits = [e.payload for e in agent.events() if e.kind is EventKind.RANK_EXITED]
    assert [(e["global_rank"], e["ranks_left"]) for e in exits] == [(1, 1), (0, 0)]


def test_sigstopped_instrumented_rank_is_reported_hung_with_every_stack(agent_factory) -> None:  # type: ignore[no-untyped-def]
    timeout_s = 5.0
    agent = agent_factory(
        # A SIGSTOPped rank cannot end on SIGTERM: a short grace ends the test sooner.
        ["--hang-floor-s", str(timeout_s), "--hang-check-s", "0.5", "--stop-grace-s", "2"],
        ["--instrumented", "--stop-rank", "1", "--stop-step", "30"],
    )
    agent.wait_file("stopped.1")
    stopped_at = time.time()
    event = agent.wait_event(EventKind.HANG, timeout_s + 5 + 10)
    assert event.time_unix_s - stopped_at <= timeout_s + 5
    hung = {entry["global_rank"]: entry for entry in event.payload["hung"]}
    assert 1 in hung and hung[1]["last_step"] == 29 and hung[1]["detector"] == "heartbeat"
    assert set(event.payload["stacks"]) == {"0", "1"}
    assert "all_reduce" in event.payload["stacks"]["0"]
    assert "agent_worker.py" in event.payload["stacks"]["1"]
    # Rank 0 waits inside all_reduce; rank 1 is stopped outside it: rank 1 is the suspect.
    assert event.payload["culprits"][0]["global_rank"] == 1
    assert event.payload["culprits"][0]["in_collective"] is False


def test_hang_in_an_uninstrumented_script_is_found_from_stacks(agent_factory) -> None:  # type: ignore[no-untyped-def]
    timeout_s = 5.0
    stacks = ["--stack-timeout-s", str(timeout_s), "--stack-sample-s", "1"]
    agent = agent_factory(
        [*stacks, "--hang-check-s", "0.5", "--stop-grace-s", "2"],
        ["--stop-rank", "1", "--stop-step", "30"],
    )
    agent.wait_file("stopped.1")
    stopped_at = time.time()
    event = agent.wait_event(EventKind.HANG, timeout_s + 15 + 10)
    assert event.time_unix_s - stopped_at <= timeout_s + 15
    hung = {entry["global_rank"]: entry for entry in event.payload["hung"]}
    assert hung[0]["detector"] == "stack"  # rank 0 frozen inside all_reduce
    assert set(event.payload["stacks"]) == {"0", "1"}
    assert "all_reduce" in event.payload["stacks"]["0"]
    assert event.payload["culprits"][0]["global_rank"] == 1, event.payload


@pytest.mark.slow
def test_no_false_hang_during_a_slow_start_or_a_checkpoint_within_its_grace(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory(
        ["--hang-floor-s", "3", "--hang-check-s", "0.5", "--init-grace-s", "60",
         "--checkpoint-grace-s", "60"],
        ["--instrumented", "--init-sleep-s", "30", "--steps", "40", "--checkpoint-at", "20",
         "--checkpoint-s", "10"],
    )  # fmt: skip
    assert agent.process.wait(timeout=120) == 0, agent.tail()
    kinds = [event.kind for event in agent.events()]
    assert EventKind.HANG not in kinds
    assert kinds[-2:] == [EventKind.LAUNCHER_EXITED, EventKind.AGENT_STOPPED]


def test_a_rank_stepping_slower_than_its_peers_is_reported_as_a_straggler(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory(
        ["--heartbeat-report-s", "1"],
        ["--instrumented", "--no-sync", "--step-s", "0.05", "--slow-rank", "1",
         "--slow-step-s", "0.2"],
    )  # fmt: skip
    event = agent.wait_event(EventKind.STRAGGLER, 30)
    assert event.payload["global_rank"] == 1
    assert event.payload["steps_observed"] >= 10
    assert event.payload["step_time_p50_s"] > 1.5 * event.payload["node_median_step_time_s"]
    time.sleep(3)  # three more reports while it is still slow
    stragglers = [e for e in agent.events() if e.kind is EventKind.STRAGGLER]
    assert len(stragglers) == 1  # reported once per episode, not in every report


def test_sigterm_stops_the_ranks_and_says_how(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory(["--stop-grace-s", "5"], ["--instrumented"])
    agent.wait_file("step.1")
    agent.process.send_signal(signal.SIGTERM)
    stopped = agent.wait_event(EventKind.RANKS_STOPPED, 30)
    assert sorted(rank["global_rank"] for rank in stopped.payload["ranks"]) == [0, 1]
    assert stopped.payload["reason"] == "agent received SIGTERM"
    assert agent.process.wait(timeout=30) != 0
    assert agent.events()[-1].kind is EventKind.AGENT_STOPPED


def test_reported_losses_reach_the_events_log_as_step_losses_while_running_and_at_exit(
    agent_factory: Callable[..., RunningAgent], tmp_path: Path
) -> None:
    agent = agent_factory(
        # Reports 2 s apart: the steps after the release, done in well under
        # that, can only reach the log through the flush before launcher_exited.
        ["--heartbeat-report-s", "2"],
        ["--ckpt", str(tmp_path / "ckpt"), "--steps", "20", "--hold-at", "8"],
        LOSS_WORKER,
    )
    # The ranks hold after step 8: what arrives now came from a periodic report.
    early = agent.wait_event(EventKind.STEP_LOSSES, 60)
    assert early.payload["global_rank"] == 0
    assert early.payload["steps"][0]["step"] == 1
    (agent.out / "release").write_text("")
    assert agent.process.wait(timeout=60) == 0, agent.tail()
    events = agent.events()
    kinds = [event.kind for event in events]
    step_events = [event for event in events if event.kind is EventKind.STEP_LOSSES]
    # Only rank 0 reports by default, and nothing buffered is lost at exit.
    assert {event.payload["global_rank"] for event in step_events} == {0}
    assert kinds.index(EventKind.LAUNCHER_EXITED) > max(
        index for index, kind in enumerate(kinds) if kind is EventKind.STEP_LOSSES
    )
    steps = [entry for event in step_events for entry in event.payload["steps"]]
    expected = json.loads((agent.out / "losses.json").read_text())
    assert [entry["step"] for entry in steps] == list(range(1, 21))
    assert {str(entry["step"]): entry["loss"] for entry in steps} == expected
    # The cursor is the global samples consumed before the step: 8 per step.
    assert [entry["cursor"] for entry in steps] == [8 * (step - 1) for step in range(1, 21)]


def test_failed_health_check_refuses_to_launch(agent_factory) -> None:  # type: ignore[no-untyped-def]
    agent = agent_factory(["--health-check", "sh -c 'echo gpu 3 is missing; exit 7'"], [])
    assert agent.process.wait(timeout=60) == 3
    failed = agent.wait_event(EventKind.HEALTH_CHECK_FAILED, 1)
    assert failed.payload["exit_code"] == 7
    assert "gpu 3 is missing" in failed.payload["output_tail"]
    assert not list(agent.out.glob("pid.*"))


def test_a_failing_builtin_check_refuses_to_launch_with_no_command_configured(
    agent_factory: Callable[..., RunningAgent],
) -> None:
    agent = agent_factory(["--ckpt-root", "/dev/null/ckpt"], [])
    assert agent.process.wait(timeout=60) == 3, agent.tail()
    failed = agent.wait_event(EventKind.HEALTH_CHECK_FAILED, 1)
    assert failed.payload["command"] == ["builtin:ckpt_root"]
    assert failed.payload["exit_code"] is None
    last = failed.payload["output_tail"].splitlines()[-1]
    assert last.startswith("FAIL builtin:ckpt_root (") and "/dev/null/ckpt" in last
    assert "ok builtin:rdzv_addr (" in failed.payload["output_tail"]
    kinds = [event.kind for event in agent.events()]
    assert kinds == [EventKind.HEALTH_CHECK_FAILED, EventKind.AGENT_STOPPED]
    assert not list(agent.out.glob("pid.*"))


def test_a_passing_gate_runs_every_builtin_check_and_reports_them_at_launch(
    agent_factory: Callable[..., RunningAgent], tmp_path: Path
) -> None:
    agent = agent_factory(["--ckpt-root", str(tmp_path / "ckpt")], ["--steps", "2"])
    assert agent.process.wait(timeout=120) == 0, agent.tail()
    started = agent.wait_event(EventKind.AGENT_STARTED, 1)
    checks = started.payload["health_checks"]
    assert [line.split(" (")[0] for line in checks] == [
        "ok builtin:ckpt_root", "ok builtin:rdzv_addr", "ok builtin:gpus",
    ]  # fmt: skip
    assert f"{tmp_path / 'ckpt'} is writable" in checks[0]
    assert "127.0.0.1 resolves to 127.0.0.1" in checks[1]
    assert not [e for e in agent.events() if e.kind is EventKind.HEALTH_CHECK_FAILED]


def test_signed_reports_and_commands_round_trip_through_the_supervisor_api(
    agent_factory: Callable[..., RunningAgent], tmp_path: Path
) -> None:
    secret_file = tmp_path / "secret"
    secret = bytes(range(32))
    write_secret(secret_file, secret)
    with RecordingServer({"77": secret}) as server:
        agent = agent_factory(
            ["--supervisor-url", server.url, "--secret-file", str(secret_file),
             "--heartbeat-report-s", "0.5"],
            ["--instrumented"],
        )  # fmt: skip
        agent.wait_file("step.1")
        server.wait_for("a heartbeat with both ranks", lambda: any(
            len(report.ranks) == 2 for report in server.heartbeats), 20)  # fmt: skip
        server.queue_command(
            Command(CommandKind.SET_CHECKPOINT_INTERVAL, "c1", {"interval_s": 900.0,
                                                               "every_steps": None})
        )  # fmt: skip
        interval_file = tmp_path / "run" / "checkpoint-interval.json"
        server.wait_for("the interval file", interval_file.exists, 20)
        assert '"interval_s": 900.0' in interval_file.read_text()
        server.queue_command(Command(CommandKind.STOP_RANKS, "c2", {"grace_s": 5.0}))
        assert agent.process.wait(timeout=60) != 0
        server.wait_for("agent_stopped", lambda: server.events[-1].kind is EventKind.AGENT_STOPPED,
                        20)  # fmt: skip
        kinds = [event.kind for event in server.events]
        assert kinds[0] is EventKind.AGENT_STARTED
        assert EventKind.RANKS_STOPPED in kinds
        stopped = next(e for e in server.events if e.kind is EventKind.RANKS_STOPPED)
        assert stopped.payload["command_id"] == "c2"
        assert [event.seq for event in server.events] == list(range(1, len(kinds) + 1))
        assert server.rejections == []


@pytest.mark.parametrize("delivered", [True, False], ids=["delivered", "undelivered"])
def test_the_default_run_directory_goes_with_its_launch_unless_events_wait_in_it(
    agent_factory: Callable[..., RunningAgent], tmp_path: Path, delivered: bool
) -> None:
    """One run directory a job, node and launch under /tmp: removed at the agent's end
    once every event was delivered, kept while its spool holds any."""
    secret_file = tmp_path / "secret"
    secret = secrets.token_bytes(32)  # a fresh tag: this test's directory alone
    write_secret(secret_file, secret)
    with RecordingServer({"77": secret}) as server:
        url = server.url if delivered else f"http://127.0.0.1:{free_port()}"
        # Undelivered: a second of trying at the end, not the clean end's ten.
        drain = [] if delivered else ["--drain-timeout-s", "1"]
        agent = agent_factory(
            ["--supervisor-url", url, "--secret-file", str(secret_file), *drain],
            ["--steps", "3"], run_dir=False,
        )  # fmt: skip
        tag = hashlib.sha256(secret_file.read_bytes()).hexdigest()[:12]
        run_dir = Path(f"/tmp/resurgo-agent-77-node1-0-{tag}")
        try:
            agent.wait_file("step.1")
            assert run_dir.is_dir(), agent.tail()
            # torchrun's own log directory is in it, not a /tmp/torchelastic_* of its own.
            assert [p.name for p in (run_dir / "torchrun").iterdir()], agent.tail()
            assert agent.process.wait(timeout=60) == 0, agent.tail()
            if delivered:
                assert server.events[-1].kind is EventKind.AGENT_STOPPED
                assert not run_dir.exists(), agent.tail()
            else:
                assert [p.name for p in (run_dir / "spool").glob("events-*")], agent.tail()
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)


def _two_node_agents(
    cluster: LiveCluster,
    tmp_path: Path,
    worker_flags: str,
    *,
    prelude: str = "",
    agent_flags: str = "",
) -> int:
    """A 2-node job whose step runs an agent per node, each logging its events to
    ``events-NODE.jsonl`` and running torchrun with 2 workers (``--out`` made)."""
    (tmp_path / "out").mkdir()
    script = tmp_path / "job.sh"
    script.write_text(
        f"#!/bin/bash\n{prelude}"
        f"srun --nodes=2 --ntasks=2 --ntasks-per-node=1 bash -c '"
        f"exec {sys.executable} -m agent.node.agent --master-addr 127.0.0.1 "
        f"--master-port {free_port()} {agent_flags} "
        f"--events-log {tmp_path}/events-$SLURMD_NODENAME.jsonl "
        f"-- torchrun --nproc-per-node=2 {WORKER} {worker_flags}'\n"
    )
    return cluster.sbatch(
        "--nodes=2", f"--output={tmp_path}/job.out", f"--chdir={REPO}", str(script)
    )


@pytest.mark.slurm
def test_agents_under_srun_report_a_killed_rank_on_the_right_node(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    job_id = _two_node_agents(slurm_cluster, tmp_path, f"--out {out} --instrumented")
    try:
        deadline = time.monotonic() + 90
        while not all((out / f"step.{rank}").exists() for rank in range(4)):
            assert time.monotonic() < deadline, (tmp_path / "job.out").read_text()
            time.sleep(0.2)
        victim = int((out / "pid.3").read_text())
        os.kill(victim, signal.SIGKILL)
        slurm_cluster.wait_job_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 90)
    finally:
        slurm_cluster.run(["scancel", str(job_id)])
    events = {
        path.stem.split("-", 1)[1]: [
            protocol.decode_event(line) for line in path.read_bytes().splitlines()
        ]
        for path in tmp_path.glob("events-*.jsonl")
    }
    assert len(events) == 2, (tmp_path / "job.out").read_text()
    killed = [
        (node, event)
        for node, node_events in events.items()
        for event in node_events
        if event.kind is EventKind.RANK_EXITED and event.payload["signal"] == 9
    ]
    assert len(killed) == 1
    node, event = killed[0]
    assert event.payload["global_rank"] == 3 and event.payload["pid"] == victim
    assert event.node == node and event.job_id == str(job_id)
    started = next(e for e in events[node] if e.kind is EventKind.AGENT_STARTED)
    assert started.payload["nnodes"] == 2


@pytest.mark.slurm
def test_agents_given_the_node_order_rank_the_nodes_by_it_in_a_static_rendezvous(
    slurm_cluster: LiveCluster, tmp_path: Path
) -> None:
    """The allocation's nodes in reverse: its last node hosts the store and holds ranks 0
    and 1, whatever order the nodes reach the rendezvous in (c10d would rank them as
    they arrive)."""
    job_id = _two_node_agents(
        slurm_cluster, tmp_path, f"--out {tmp_path / 'out'} --steps 3",
        prelude='export ORDER=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | tac | paste -sd,)\n'
        f'echo "$ORDER" > {tmp_path / "order"}\n',
        agent_flags="--master-node ${ORDER%%,*} --node-order $ORDER",
    )  # fmt: skip
    try:
        slurm_cluster.wait_job_state(job_id, {"COMPLETED", "FAILED", "CANCELLED"}, 120)
    finally:
        slurm_cluster.run(["scancel", str(job_id)])
    first, last = (tmp_path / "order").read_text().split()[0].split(",")
    starts, ranks = {}, {}
    for path in tmp_path.glob("events-*.jsonl"):
        for line in path.read_bytes().splitlines():
            event = protocol.decode_event(line)
            if event.kind is EventKind.AGENT_STARTED:
                starts[event.node] = event.payload["node_rank"]
            elif event.kind is EventKind.RANK_EXITED:
                assert event.payload["exit_code"] == 0, event.payload
                ranks[event.payload["global_rank"]] = event.node
    assert starts == {first: 0, last: 1}, (tmp_path / "job.out").read_text()
    assert ranks == {0: first, 1: first, 2: last, 3: last}, (tmp_path / "job.out").read_text()


def _notice(tmp_path: Path, save_in_s: float, end_in_s: float) -> Path:
    from agent.stopfiles import write_notice
    from agent.timelimit import Notice

    job_dir = tmp_path / "job"
    job_dir.mkdir(exist_ok=True)
    now = time.time()
    write_notice(job_dir, Notice(1, now, now + save_in_s, now + end_in_s))
    return job_dir


def _time_limit_agent(
    agent_factory: Callable[..., RunningAgent], tmp_path: Path, worker_args: list[str]
) -> RunningAgent:
    """An agent of attempt 1 following the notice file ``_notice`` writes."""
    return agent_factory(
        ["--stop-grace-s", "5", "--attempt", "1", "--ckpt-root", str(tmp_path / "ckpt"),
         "--time-limit-file", str(tmp_path / "job" / "time-limit.json"),
         "--time-limit-poll-s", "0.2"],
        worker_args,
    )  # fmt: skip


def test_a_time_limit_notice_stops_an_uninstrumented_script_at_once(
    agent_factory, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    agent = _time_limit_agent(agent_factory, tmp_path, [])
    agent.wait_file("step.1")
    _notice(tmp_path, save_in_s=60.0, end_in_s=90.0)
    near = agent.wait_event(EventKind.TIME_LIMIT_NEAR, 10)
    assert near.payload["attempt"] == 1
    stopped = agent.wait_event(EventKind.RANKS_STOPPED, 10)
    # No heartbeats: no final checkpoint to wait for, the ranks get SIGTERM now.
    assert "Resurgo's library" in stopped.payload["reason"]
    assert near.payload["final_checkpoint_requested"] is False
    assert stopped.time_unix_s - near.time_unix_s < 5.0
    assert not (tmp_path / "run" / "save-request.json").exists()


def test_a_time_limit_notice_stops_a_script_seen_only_through_the_bootstrap_at_once(
    agent_factory, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """Its optimizer steps beat, but no save request reaches a script that imports nothing:
    waiting for its final checkpoint would only eat the time a short limit leaves."""
    agent = _time_limit_agent(agent_factory, tmp_path, ["--optimizer"])
    agent.wait_file("step.1")
    time.sleep(2.0)  # the bootstrap's first beats reached the agent
    _notice(tmp_path, save_in_s=60.0, end_in_s=90.0)
    near = agent.wait_event(EventKind.TIME_LIMIT_NEAR, 10)
    stopped = agent.wait_event(EventKind.RANKS_STOPPED, 10)
    assert near.payload["final_checkpoint_requested"] is False
    assert "Resurgo's library" in stopped.payload["reason"]
    assert stopped.time_unix_s - near.time_unix_s < 5.0


def test_a_time_limit_notice_lets_an_uninstrumented_scripts_save_under_way_end_first(
    agent_factory, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    """A Trainer writing its checkpoint-20 when the notice comes: SIGTERM then would cut
    the save short, and a run's first checkpoint cut short leaves nothing to resume from.
    The agent stops the ranks once the checkpoint has stayed unmodified for a while."""
    agent = _time_limit_agent(agent_factory, tmp_path, [])
    agent.wait_file("step.1")
    saving = tmp_path / "ckpt" / "checkpoint-20"
    saving.mkdir(parents=True)
    writes_until = time.time() + 4.0

    def write() -> None:  # a slow save: a file more every 0.3 s
        shard = 0
        while time.time() < writes_until:
            (saving / f"rng_state_{shard}.pth").write_bytes(b"x" * 64)
            shard += 1
            time.sleep(0.3)

    writer = threading.Thread(target=write)
    writer.start()
    _notice(tmp_path, save_in_s=30.0, end_in_s=60.0)
    near = agent.wait_event(EventKind.TIME_LIMIT_NEAR, 10)
    stopped = agent.wait_event(EventKind.RANKS_STOPPED, 20)
    writer.join()
    assert near.payload["final_checkpoint_requested"] is False
    assert "save under way has ended" in stopped.payload["reason"], stopped.payload
    # Not before the last write and the quiet after it, and not at the deadline either.
    assert stopped.time_unix_s >= writes_until + 1.5, stopped.time_unix_s - writes_until
    assert stopped.time_unix_s - near.time_unix_s < 15.0


def test_a_time_limit_notice_asks_instrumented_ranks_for_a_checkpoint_until_its_deadline(
    agent_factory, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    # The worker saves nothing on request: the agent waits until the notice's
    # deadline, then stops the ranks anyway (a save cut short keeps the last one).
    agent = _time_limit_agent(agent_factory, tmp_path, ["--instrumented"])
    agent.wait_file("step.1")
    time.sleep(2.0)  # the ranks' first heartbeats reached the agent
    _notice(tmp_path, save_in_s=3.0, end_in_s=20.0)
    near = agent.wait_event(EventKind.TIME_LIMIT_NEAR, 10)
    assert near.payload["final_checkpoint_requested"] is True
    request = json.loads((tmp_path / "run" / "save-request.json").read_text())
    assert isinstance(request["id"], int)
    stopped = agent.wait_event(EventKind.RANKS_STOPPED, 20)
    assert "committed by the deadline" in stopped.payload["reason"]
    assert 2.5 <= stopped.time_unix_s - near.time_unix_s < 10.0


def test_a_notice_older_than_the_agent_is_not_its_own(agent_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    job_dir = _notice(tmp_path, save_in_s=60.0, end_in_s=90.0)  # left by an earlier run
    time.sleep(1.5)
    agent = agent_factory(
        ["--attempt", "1", "--time-limit-file", str(job_dir / "time-limit.json"),
         "--time-limit-poll-s", "0.2"],
        [],
    )  # fmt: skip
    agent.wait_file("step.1")
    time.sleep(1.5)
    assert not [e for e in agent.events() if e.kind is EventKind.TIME_LIMIT_NEAR]


# Rank 1 raises and then unwinds slowly (an atexit handler, as a framework's may
# be); rank 0 aborts 1 s later without a Python exception; torchrun then stops
# rank 1 with SIGTERM while it still unwinds. No torch needed to show it.
UNWINDING = """
import atexit, os, sys, time
rank = int(os.environ["RANK"])
if rank == 1:
    atexit.register(time.sleep, 60)
    raise RuntimeError("rank 1 fails in iter 15")
time.sleep(1.0)
os.abort()
"""


def test_a_rank_stopped_while_it_unwinds_its_exception_reports_that_it_raised_first(  # type: ignore[no-untyped-def]
    agent_factory, tmp_path: Path
) -> None:
    script = tmp_path / "unwinding.py"
    script.write_text(UNWINDING)
    agent = agent_factory([], [], command=["torchrun", "--nproc-per-node=2", str(script)])
    agent.wait_event(EventKind.LAUNCHER_EXITED, 60)
    exits = {e.payload["global_rank"]: e.payload for e in agent.events()
             if e.kind is EventKind.RANK_EXITED}  # fmt: skip
    raiser, aborted = exits[1], exits[0]
    assert aborted["signal_name"] == "SIGABRT" and "raised" not in aborted, aborted
    assert raiser["signal_name"] == "SIGTERM", raiser  # stopped while it unwound
    assert raiser["raised"] == "RuntimeError"
    # It raised a second before its peer died, though its exit came after.
    assert raiser["raised_time_unix_s"] < aborted["exit_time_unix_s"] - 0.5
    assert raiser["exit_time_unix_s"] > aborted["exit_time_unix_s"]
