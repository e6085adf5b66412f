"""One real resurgo-agent process on this machine over real torchrun ranks, and its events.

Shared by ``test_agent.py`` and ``test_launch_shapes.py``: the agent runs
``tests/workers/agent_worker.py`` (or a given command) and writes its events
to a local log the tests read.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from agent.wire import protocol
from agent.wire.protocol import Event, EventKind
from tests.conftest import REPO, free_port

WORKER = REPO / "tests" / "workers" / "agent_worker.py"
AGENT = [sys.executable, "-m", "agent.node.agent"]


class RunningAgent:
    """One resurgo-agent process on this machine, its output folder and its events log."""

    def __init__(
        self,
        tmp_path: Path,
        agent_args: list[str],
        worker_args: list[str],
        worker: Path = WORKER,
        command: list[str] | None = None,
        run_dir: bool = True,
    ):
        """``run_dir`` False: the agent makes its default one under /tmp."""
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.log = tmp_path / "events.jsonl"
        self.stderr = open(tmp_path / "agent.log", "wb")  # noqa: SIM115
        if command is None:
            command = ["torchrun", "--nproc-per-node=2", str(worker), "--out", str(self.out),
                       *worker_args]  # fmt: skip
        argv = [
            *AGENT, "--job-id", "77", "--node", "node1", "--master-port", str(free_port()),
            *(["--run-dir", str(tmp_path / "run")] if run_dir else []),
            "--events-log", str(self.log),
            "--watch-interval-s", "0.2", *agent_args, "--", *command,
        ]  # fmt: skip
        self.process = subprocess.Popen(
            argv, stdout=self.stderr, stderr=subprocess.STDOUT, cwd=REPO
        )

    def events(self) -> list[Event]:
        if not self.log.exists():
            return []
        return [protocol.decode_event(line) for line in self.log.read_bytes().splitlines()]

    def wait_event(self, kind: EventKind, timeout_s: float) -> Event:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for event in self.events():
                if event.kind is kind:
                    return event
            assert self.process.poll() is None or kind in (
                EventKind.LAUNCHER_EXITED, EventKind.AGENT_STOPPED, EventKind.RANK_EXITED,
            ), self.tail()  # fmt: skip
            time.sleep(0.05)
        raise AssertionError(f"no {kind.value} event within {timeout_s} s\n{self.tail()}")

    def wait_file(self, name: str, timeout_s: float = 60.0) -> str:
        path = self.out / name
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if path.exists() and path.read_text():
                return path.read_text()
            assert self.process.poll() is None, self.tail()
            time.sleep(0.05)
        raise AssertionError(f"{path} never appeared\n{self.tail()}")

    def tail(self) -> str:
        self.stderr.flush()
        return (self.stderr.name and Path(self.stderr.name).read_text(errors="replace"))[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pid_file in self.out.glob("pid.*"):
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        self.stderr.close()
