"""The three launch shapes under a real resurgo-agent process (real torchrun ranks, gloo,
CPU; no Slurm): a torchrun below a wrapper script is fitted to the job, a per-rank
command gets each rank's Slurm task variables, and a launcher that keeps its own world
is reported at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.wire.protocol import EventKind
from tests.integration.agent_harness import WORKER, RunningAgent

PY = sys.executable


@pytest.fixture
def run_agent(tmp_path: Path) -> Iterator:  # type: ignore[type-arg]
    started: list[RunningAgent] = []

    def start(command: list[str], *agent_args: str) -> RunningAgent:
        running = RunningAgent(tmp_path, list(agent_args), [], command=command)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


def test_torchrun_inside_a_wrapper_script_runs_its_ranks_under_the_shim(
    run_agent,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """`bash run.sh` whose torchrun says --standalone: Resurgo's torchrun on PATH fits it,
    so each rank's exit is known exactly (the shim records it), as for a direct torchrun."""
    out = tmp_path / "out"
    wrapper = tmp_path / "run.sh"
    wrapper.write_text(
        f'#!/bin/bash\nexec torchrun --standalone --nproc-per-node=2 {WORKER} --out "$1"\n'
    )
    agent = run_agent(["bash", str(wrapper), str(out)])
    pid = int(agent.wait_file("pid.1"))
    agent.wait_file("step.1")
    assert json.loads(agent.wait_file("env.1"))["WORLD_SIZE"] == "2"
    os.kill(pid, signal.SIGKILL)
    event = agent.wait_event(EventKind.RANK_EXITED, 10)
    assert event.payload["global_rank"] == 1 and event.payload["pid"] == pid
    assert event.payload["signal_name"] == "SIGKILL"
    assert not [e for e in agent.events() if e.kind is EventKind.WORLD_MISMATCH]


def test_python_m_torch_distributed_run_in_bash_c_is_fitted_by_the_bootstrap(
    run_agent,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    out = tmp_path / "out"
    inner = f"exec {PY} -m torch.distributed.run --standalone --nproc-per-node=2 {WORKER}"
    inner += f" --out {out}"
    agent = run_agent(["bash", "-c", inner])
    agent.wait_file("step.0")
    argv = agent.wait_event(EventKind.AGENT_STARTED, 10).payload["argv"]
    assert argv[:2] == ["bash", "-c"]
    # Fitted: the ranks run under the shim, so a rank's exit code is its own.
    pid = int(agent.wait_file("pid.0"))
    os.kill(pid, signal.SIGTERM)
    event = agent.wait_event(EventKind.RANK_EXITED, 10)
    assert event.payload["global_rank"] == 0 and event.payload["signal_name"] == "SIGTERM"


def test_each_rank_of_an_srun_style_command_gets_its_own_slurm_task_variables(
    run_agent,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    out = tmp_path / "out"
    agent = run_agent(["srun", "--ntasks-per-node=2", PY, str(WORKER), "--out", str(out)])
    seen = [json.loads(agent.wait_file(f"env.{rank}")) for rank in (0, 1)]
    assert [(s["SLURM_PROCID"], s["SLURM_LOCALID"], s["SLURM_NTASKS"]) for s in seen] == [
        ("0", "0", "2"),
        ("1", "1", "2"),
    ]
    assert all(s["RANK"] == s["SLURM_PROCID"] and s["SLURM_NODEID"] == "0" for s in seen)


def test_a_launcher_that_keeps_its_own_world_is_reported_once_at_once(
    run_agent,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """The agent's job has 2 nodes; the launcher (torch's elastic API in its own process)
    says --standalone --nnodes=1: a world of 2 ranks where the job's is 2 x 2 = 4."""
    out = tmp_path / "out"
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        "from torch.distributed.run import main\n"
        f"main(['--standalone', '--nnodes=1', '--nproc-per-node=2', {str(WORKER)!r},"
        f" '--out', {str(out)!r}])\n"
    )
    started = time.monotonic()
    agent = run_agent(["bash", "-c", f"exec {PY} {launcher}"], "--nnodes", "2")
    event = agent.wait_event(EventKind.WORLD_MISMATCH, 60)
    assert time.monotonic() - started < 60
    assert {k: event.payload[k] for k in ("world_size", "local_world_size", "nnodes")} == {
        "world_size": 2,
        "local_world_size": 2,
        "nnodes": 2,
    }
    agent.wait_file("step.1")
    time.sleep(1.0)
    assert len([e for e in agent.events() if e.kind is EventKind.WORLD_MISMATCH]) == 1


def test_a_wrapped_torchrun_that_cannot_be_fitted_ends_with_one_line_saying_why(
    tmp_path: Path,
) -> None:
    import subprocess

    from agent.node.launch import BOOTSTRAP_DIR, ENV_ALLOCATION

    allocation = '{"job_id": "7", "node": "node1", "nnodes": 2, "node_rank": 0, ' \
        '"master_addr": "127.0.0.1", "master_port": 29999}'  # fmt: skip
    done = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--nproc-per-node=gpu", str(WORKER)],
        env={**os.environ, "PYTHONPATH": BOOTSTRAP_DIR, ENV_ALLOCATION: allocation},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "resurgo: torchrun: --nproc-per-node='gpu': Resurgo needs an explicit number of ranks "
        "per node (e.g. --nproc-per-node=8) to know when every rank has started"
    ]
