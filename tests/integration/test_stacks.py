"""py-spy against real processes, and the collective classifier against recorded real dumps.

The recorded dumps in tests/fixtures/stacks/ come from a 2-rank torchrun gloo job
(torch 2.13, py-spy 0.4.3) where rank 1 SIGSTOPped itself and rank 0 blocked in
``dist.all_reduce(t)`` (``sync``) or ``dist.all_reduce(t, async_op=True).wait()``
(``async``); plus torchrun's own process and a sleeping Python process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.node.stacks import (
    StackDump,
    dump_all,
    dump_stacks,
    find_py_spy,
    fingerprint,
    in_collective,
    parse_json_dump,
    render,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "stacks"


@pytest.fixture
def py_spy() -> str:
    """py-spy is a dependency of the agent: its absence is a failure, never a skip."""
    exe = find_py_spy()
    assert exe is not None, "py-spy is missing: run deploy/setup (pip install py-spy)"
    return exe


# Rank 2 stops itself after three good all_reduces; rank 0 then blocks in a
# synchronous all_reduce, rank 1 in Work.wait() of an async one.
WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    import torch.distributed as dist

    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3
    )
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    print("ready", flush=True)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
    if rank == 0:
        dist.all_reduce(t)
    else:
        dist.all_reduce(t, async_op=True).wait()
    """
)


def load_fixture(name: str) -> StackDump:
    threads = parse_json_dump(json.loads((FIXTURES / name).read_text()))
    return StackDump(pid=threads[0].thread_id, ok=True, text="", threads=threads)


# --- recorded real dumps ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "collective"),
    [
        ("gloo_sync_blocked_rank.json", True),
        ("gloo_sync_blocked_rank_native.json", True),
        # work.wait() is C++: the Python-only dump shows just the caller's line.
        ("gloo_async_blocked_rank.json", False),
        ("gloo_async_blocked_rank_native.json", True),
        ("gloo_sync_sigstopped_rank_nonblocking.json", False),
        ("gloo_async_sigstopped_rank_nonblocking.json", False),
        ("torchrun_agent_sync.json", False),
        ("python_sleeping.json", False),
    ],
)
def test_recorded_dumps_are_classified(name: str, collective: bool) -> None:
    assert in_collective(load_fixture(name)) is collective


def test_native_and_python_dumps_of_one_state_share_a_fingerprint() -> None:
    for mode in ("sync", "async"):
        python_only = load_fixture(f"gloo_{mode}_blocked_rank.json")
        native = load_fixture(f"gloo_{mode}_blocked_rank_native.json")
        assert fingerprint(python_only) == fingerprint(native)
    assert fingerprint(load_fixture("gloo_sync_blocked_rank.json")) != fingerprint(
        load_fixture("gloo_sync_sigstopped_rank_nonblocking.json")
    )


def test_rendered_dump_matches_py_spys_own_text_layout() -> None:
    dump = load_fixture("gloo_sync_blocked_rank.json")
    recorded = (FIXTURES / "gloo_sync_blocked_rank.txt").read_text().splitlines()
    # py-spy's header names the interpreter; from the thread line on they agree.
    start = next(i for i, line in enumerate(recorded) if line.startswith("Thread "))
    assert render(dump.pid, dump.threads).splitlines()[1:] == recorded[start:]


# --- real processes ---------------------------------------------------------------------


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.5)"])
    time.sleep(0.5)
    yield proc
    proc.kill()
    proc.wait()


@pytest.mark.usefixtures("py_spy")
def test_a_sleeping_process_dumps_with_a_stable_fingerprint(
    sleeper: subprocess.Popen[bytes],
) -> None:
    first, second = dump_stacks(sleeper.pid), dump_stacks(sleeper.pid)
    assert first.ok, first.error
    assert first.threads[0].frames[0].function == "<module>"
    assert f"Process {sleeper.pid}" in first.text
    assert fingerprint(first) == fingerprint(second) != ""
    assert not in_collective(first)


@pytest.mark.usefixtures("py_spy")
def test_a_dead_pid_is_an_error_value_that_says_the_process_is_gone() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    dump = dump_stacks(proc.pid)
    assert not dump.ok and dump.threads == ()
    assert dump.error is not None and "is gone" in dump.error
    assert fingerprint(dump) == ""


def test_missing_py_spy_is_an_error_value_that_says_how_to_install_it() -> None:
    dump = dump_stacks(os.getpid(), py_spy="/nonexistent/py-spy")
    assert not dump.ok
    assert dump.error is not None and "could not run py-spy" in dump.error


def test_no_py_spy_anywhere_says_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("agent.node.stacks.find_py_spy", lambda: None)
    dump = dump_stacks(os.getpid())
    assert dump.error is not None and "pip install py-spy" in dump.error


@pytest.mark.usefixtures("py_spy")
def test_dump_all_returns_one_result_per_pid_within_the_deadline(
    sleeper: subprocess.Popen[bytes],
) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    started = time.monotonic()
    dumps = dump_all([sleeper.pid, gone.pid, sleeper.pid], timeout_s=10.0)
    assert time.monotonic() - started < 10.0
    assert list(dumps) == [sleeper.pid, gone.pid]
    assert dumps[sleeper.pid].ok and not dumps[gone.pid].ok


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def gloo_job(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), port],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for rank in range(3)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        yield procs
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()


def wait_until_collective(pid: int, native: bool = False, timeout_s: float = 20.0) -> StackDump:
    deadline = time.monotonic() + timeout_s
    while True:
        dump = dump_stacks(pid, native=native)
        if (dump.ok and in_collective(dump)) or time.monotonic() > deadline:
            return dump
        time.sleep(0.2)


@pytest.mark.usefixtures("py_spy")
def test_real_gloo_hang_blocked_ranks_are_in_a_collective_and_the_stopped_one_is_not(
    gloo_job: list[subprocess.Popen[str]],
) -> None:
    sync_rank, async_rank, stopped = gloo_job
    blocked = wait_until_collective(sync_rank.pid)
    assert blocked.ok, blocked.error
    assert in_collective(blocked), blocked.text
    assert blocked.threads[0].frames[0].function == "all_reduce"
    assert fingerprint(dump_stacks(sync_rank.pid)) == fingerprint(blocked)

    waiting = wait_until_collective(async_rank.pid, native=True)
    assert in_collective(waiting), waiting.text
    assert any(f.function == "c10d::Work::wait" for f in waiting.threads[0].frames)
    assert not in_collective(dump_stacks(async_rank.pid)), "a Python-only dump cannot see it"

    # A SIGSTOPped process cannot be suspended by py-spy; the non-blocking retry reads it.
    deadline = time.monotonic() + 10
    while not Path(f"/proc/{stopped.pid}/stat").read_text().split(") ")[1].startswith("T"):
        assert time.monotonic() < deadline, "rank 2 never stopped"
        time.sleep(0.1)
    frozen = dump_stacks(stopped.pid)
    assert frozen.ok, frozen.error
    assert not in_collective(frozen)
