"""The world around a supervisor under crash tests: its process, a fake Slurm, agents, a driver.

:class:`Daemon` is the real ``python -m supervisor.daemon`` with short timings,
the fake Slurm CLI (``tests/fixtures/fakeslurm``) first on its PATH. The node
agents and the in-job driver are played here, in the test's process, by
:class:`Agent` and :class:`Driver`: they speak the real wire protocol (signed
HTTP requests built with ``agent.wire.protocol``), keep their events until the
supervisor acknowledges them (as the agent's spool does), and ride out a
supervisor that is down. :class:`StoreView` reads the daemon's SQLite store
through a second connection; :class:`Metrics` scrapes ``/metrics`` and keeps
every counter series it ever saw.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from agent.wire import protocol
from agent.wire.protocol import (
    CommandKind,
    DriverAction,
    DriverAnswer,
    DriverPhase,
    DriverRequest,
    EventKind,
)
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "fixtures" / "fakeslurm"))
import fakeslurm  # a fixture module beside its executables, not a package

PROCS_PER_NODE = 2
HEARTBEAT_S = 0.3
DRIVER_POLL_S = 0.4

# Short timings: a scripted run of five faults takes seconds, not minutes.
DAEMON_SETTINGS = {
    "POLL_S": "0.2",
    "TICK_S": "0.2",
    "RECONCILE_S": "1",
    "LEASE_S": "2",
    "INTERVAL_CHECK_S": "600",
    "STRAGGLER_CHECK_S": "600",
    "SLURM_TIMEOUT_S": "10",
    "LOG_JSON": "no",
    # Restarted 50 times: each start's warm validation child (importing torch) was half
    # the test's CPU. The first validation after a restart starts it instead.
    "VALIDATION_KEEP_WARM": "no",
}
POLICY = {
    "EXIT_EVIDENCE_WINDOW_S": "0",
    "HANG_EVIDENCE_WINDOW_S": "0",
    "BACKOFF_BASE_S": "0.1",
    "BACKOFF_MAX_S": "1",
    "MAX_DRAIN_SHARE_PER_HOUR": "1",
    "MAX_USER_DRAIN_SHARE": "1",  # the three drains are one user's
    "VALIDATION_LEVEL": "quick",
    "STOP_GRACE_S": "1",
    "CORROBORATE_DRAINS": "false",  # the drains on one job's word this scenario counts
}


class Unreachable(Exception):
    """The supervisor did not answer (down, or killed mid-request)."""


class Daemon:
    """``python -m supervisor.daemon`` on a fixed port; SIGKILLed and restarted at will."""

    def __init__(self, state_dir: Path, port: int, fake_dir: Path, bin_dir: Path) -> None:
        self.state_dir = state_dir
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.fake_dir = fake_dir
        self.bin_dir = bin_dir
        self.log_path = state_dir.parent / "supervisor.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._log: IO[bytes] | None = None

    @property
    def env(self) -> dict[str, str]:
        # Only this test's settings: none of the caller's RESURGO_* (a jobs dir elsewhere).
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("RESURGO_")}
        return {
            **inherited,
            "PATH": f"{self.bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "FAKESLURM_DIR": str(self.fake_dir),
            fakeslurm.CALLER_VARIABLE: "daemon",
            "PYTHONPATH": str(REPO),
            "RESURGO_SUPERVISOR_STATE_DIR": str(self.state_dir),
            "RESURGO_SUPERVISOR_LISTEN_HOST": "127.0.0.1",
            "RESURGO_SUPERVISOR_LISTEN_PORT": str(self.port),
            "RESURGO_SUPERVISOR_URL": self.url,
            **{f"RESURGO_SUPERVISOR_{key}": value for key, value in DAEMON_SETTINGS.items()},
            **{f"RESURGO_POLICY_{key}": value for key, value in POLICY.items()},
        }

    def start(self) -> bool:
        """Start it and wait for ``/healthz``; False when it was SIGKILLed while starting."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        if self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in close()
        self._log.write(f"\n===== start {self.starts + 1} =====\n".encode())
        self._log.flush()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "supervisor.daemon"],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.starts += 1
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code == -signal.SIGKILL:
                return False
            if code is not None:
                raise AssertionError(f"the supervisor exited with {code} at start:\n{self.tail()}")
            with (
                contextlib.suppress(OSError, http.client.HTTPException),
                urllib.request.urlopen(f"{self.url}/healthz", timeout=2),
            ):
                return True
            time.sleep(0.05)
        raise AssertionError(f"the supervisor did not answer /healthz in 60 s:\n{self.tail()}")

    def exit_code(self) -> int | None:
        """None while it runs."""
        return None if self.process is None else self.process.poll()

    def kill(self) -> None:
        """SIGKILL, whatever it is doing."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM (a clean shutdown), SIGKILL if it hangs."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def close(self) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()
            self._log = None

    def exceptions(self) -> list[str]:
        """Each traceback in the log, with the line that logged it."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        found = []
        for index, line in enumerate(lines):
            if line.startswith("Traceback"):
                inside = (" ", "Traceback")
                later = range(index + 1, len(lines))
                end = next((i for i in later if not lines[i].startswith(inside)), len(lines))
                found.append("\n".join(lines[max(index - 1, 0) : end + 1]))
        return found

    def tail(self, lines: int = 80) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class Api:
    """Signed requests to the supervisor, as the agents and the driver send them."""

    url: str
    job_id: str
    secret: bytes

    def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """(status, body); raises :class:`Unreachable` when nobody answered."""
        headers = protocol.signed_headers(
            self.secret, protocol.METHOD, path, self.job_id, int(time.time()), body
        )
        request = urllib.request.Request(
            self.url + path,
            data=body,
            headers={**headers, "Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as answer:
                return answer.status, answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()
        except (OSError, http.client.HTTPException) as error:
            raise Unreachable(str(error)) from error

    def driver(self, request: DriverRequest) -> DriverAnswer | None:
        """The supervisor's answer; None when it did not give one (retry later)."""
        try:
            status, data = self.post(protocol.DRIVER_PATH, protocol.encode_driver_request(request))
        except Unreachable:
            return None
        if status != 200:
            return None
        try:
            return protocol.decode_driver_answer(data)
        except protocol.ProtocolError:
            return None  # cut off by the kill: the real driver asks again too


@dataclass
class Agent:
    """One node agent of one launch: events kept until acknowledged, heartbeats, commands."""

    api: Api
    node: str
    node_rank: int
    nnodes: int
    attempt: int
    incarnation: str
    step: int
    outbox: list[protocol.Event] = field(default_factory=list)
    seq: int = 0
    silent: bool = False  # its node was lost: it says nothing more
    stopped: bool = False  # its ranks were stopped by the supervisor's command
    next_beat: float = 0.0
    stop_commands: list[str] = field(default_factory=list)

    @property
    def ranks(self) -> list[int]:
        return [self.node_rank * PROCS_PER_NODE + local for local in range(PROCS_PER_NODE)]

    def emit(self, kind: EventKind, payload: dict[str, Any]) -> None:
        """Queue an event (the agent's spool); it is sent until acknowledged."""
        self.seq += 1
        self.outbox.append(
            protocol.make_event(
                kind, self.api.job_id, self.node, self.incarnation, self.seq, time.time(), payload
            )
        )

    def started(self) -> None:
        self.emit(EventKind.AGENT_STARTED, {
            "agent_version": "crash-test", "pid": 4242, "argv": ["resurgo-agent"],
            "nnodes": self.nnodes, "node_rank": self.node_rank, "attempt": self.attempt,
        })  # fmt: skip

    def pump(self, now: float) -> None:
        """Send what is queued, and a heartbeat when one is due; take commands."""
        if self.silent:
            return
        try:
            if self.outbox:
                status, data = self.api.post(
                    protocol.EVENTS_PATH, protocol.encode_events(self.outbox)
                )
                if status == 200:
                    reply = protocol.decode_reply(data)
                    accepted = set(reply.accepted_event_ids)
                    self.outbox = [e for e in self.outbox if e.event_id not in accepted]
                    self._take(reply.commands)
            if not self.stopped and now >= self.next_beat:
                self.next_beat = now + HEARTBEAT_S
                self.step += 1
                status, data = self.api.post(protocol.HEARTBEAT_PATH, self._heartbeat(now))
                if status == 200:
                    self._take(protocol.decode_reply(data).commands)
        except (Unreachable, protocol.ProtocolError):
            return  # the supervisor is down, or its reply was cut off: try again

    def _heartbeat(self, now: float) -> bytes:
        ranks = tuple(
            protocol.RankStatus(
                global_rank=rank,
                local_rank=rank % PROCS_PER_NODE,
                pid=1000 + rank,
                step=self.step,
                phase="train",
                last_progress_unix_s=now,
                step_time_p50_s=0.3,
                step_time_p99_s=0.35,
                step_time_mean_s=0.3,
                steps_observed=10,
            )
            for rank in self.ranks
        )
        report = protocol.HeartbeatReport(
            self.api.job_id, self.node, now, ranks, self.incarnation, self.attempt
        )
        return protocol.encode_heartbeat(report)

    def _take(self, commands: tuple[protocol.Command, ...]) -> None:
        for command in commands:
            if command.kind is not CommandKind.STOP_RANKS or self.stopped:
                continue
            self.stop_commands.append(command.command_id)
            self.stopped = True
            self.emit(EventKind.RANKS_STOPPED, {
                "reason": "supervisor", "command_id": command.command_id,
                "grace_s": float(command.args["grace_s"]),
                "ranks": [{"global_rank": rank, "local_rank": rank % PROCS_PER_NODE,
                           "pid": 1000 + rank, "method": "sigterm", "exit_code": None,
                           "signal": 15} for rank in self.ranks],
            })  # fmt: skip


@dataclass
class Driver:
    """The in-job driver of one batch-script run: START, RUNNING/ENDED polls, relaunches."""

    api: Api
    batch_run: int
    nodes: tuple[str, ...]  # the allocation when the batch script started
    launch_counts: Counter[str]  # relaunch action id -> launches (shared by a job's drivers)
    attempt: int | None = None
    agents: list[Agent] = field(default_factory=list)
    retired: list[Agent] = field(default_factory=list)
    phase: DriverPhase = DriverPhase.START
    confirm: DriverRequest | None = None
    next_ask: float = 0.0
    dead: bool = False  # its batch host was lost, or Slurm ended the script
    done: bool = False  # told to stop, or its step succeeded
    incarnations: int = 0

    def pump(self, now: float) -> None:
        if self.dead or self.done:
            return
        if self.confirm is not None:
            if self.api.driver(self.confirm) is not None:
                self.confirm = None
            return
        if now < self.next_ask:
            return
        self.next_ask = now + DRIVER_POLL_S
        if (
            self.phase is DriverPhase.RUNNING
            and self.agents
            and all(a.stopped for a in self.agents)
        ):
            self.phase = DriverPhase.ENDED  # the supervisor stopped the ranks: the step ended
        # After a WAIT at start the driver asks ENDED without an exit code (it ran nothing).
        exit_code = 143 if self.phase is DriverPhase.ENDED and self.agents else None
        answer = self.api.driver(
            DriverRequest(self.api.job_id, self.phase, attempt=self.attempt, exit_code=exit_code)
        )
        if answer is None:
            return
        if answer.action is DriverAction.STOP:
            self.done = True
        elif answer.action is DriverAction.LAUNCH and self.phase is DriverPhase.START:
            self._launch(self.nodes, answer.attempt, answer.resume_from)
        elif answer.action is DriverAction.RELAUNCH and (
            self.attempt is None or answer.attempt > self.attempt
        ):
            assert answer.nodes is not None and answer.action_id is not None
            self.launch_counts[answer.action_id] += 1
            self._launch(answer.nodes, answer.attempt, answer.resume_from)
            self.confirm = DriverRequest(
                self.api.job_id, DriverPhase.RELAUNCHED, attempt=answer.attempt,
                action_id=answer.action_id, ok=True, reason="step running",
            )  # fmt: skip
            if self.api.driver(self.confirm) is not None:
                self.confirm = None
        elif answer.action is DriverAction.WAIT and self.phase is DriverPhase.START:
            self.phase = DriverPhase.ENDED
            self.attempt = answer.attempt

    def _launch(self, nodes: tuple[str, ...], attempt: int, resume_from: str | None) -> None:
        self.retired.extend(self.agents)
        step = 0
        if resume_from:
            step = int(Path(resume_from).name.split("-")[1])
        self.agents = []
        for rank, node in enumerate(nodes):
            self.incarnations += 1
            incarnation = f"{self.batch_run:04x}{attempt:04x}{self.incarnations:08x}"
            agent = Agent(self.api, node, rank, len(nodes), attempt, incarnation, step)
            agent.started()
            self.agents.append(agent)
        self.attempt = attempt
        self.phase = DriverPhase.RUNNING

    def agent_on(self, node: str) -> Agent:
        return next(agent for agent in self.agents if agent.node == node)


class StoreView:
    """The daemon's store through a second connection: reads only, while it runs or not."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: sqlite3.Connection | None = None

    def db(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
            self._db.execute("PRAGMA query_only = 1")
        return self._db

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def record(self, job_id: str) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        row = self.db().execute("SELECT record FROM jobs WHERE job_id = ?", (job_id,)).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        return list(self.db().execute(sql, params).fetchall())

    def integrity(self) -> list[str]:
        return [row[0] for row in self.db().execute("PRAGMA integrity_check")]


_SAMPLE = re.compile(r"^(resurgo_[a-z_]+_total)\{([^}]*)\} ([0-9.eE+-]+)$")
_LABEL = re.compile(r'[a-z_]+="[^"]*"')
# Counters whose every series must stay and never go down (a job's restarts, drains).
FOLLOWED = frozenset({"resurgo_job_restarts_total", "resurgo_drains_total"})


class Metrics:
    """Scrapes of ``/metrics``: every ``_total`` series seen, and any that went down
    (or, for the :data:`FOLLOWED` counters, vanished)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.highest: dict[tuple[str, str], float] = {}
        self.decreases: list[str] = []
        self.scrapes = 0

    def scrape(self, when: str) -> bool:
        """One scrape; False when the supervisor did not answer."""
        try:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as answer:
                text = answer.read().decode()
        except (OSError, http.client.HTTPException):
            return False
        self.scrapes += 1
        seen: dict[tuple[str, str], float] = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match is not None:
                labels = ",".join(sorted(_LABEL.findall(match.group(2))))
                seen[(match.group(1), labels)] = float(match.group(3))
        for key, before in self.highest.items():
            now = seen.get(key)
            # A series may end (a node left the job); those the test follows may not.
            if (now is None and key[0] in FOLLOWED) or (now is not None and now < before):
                self.decreases.append(f"{when}: {key[0]}{{{key[1]}}} {before} -> {now}")
        for key, value in seen.items():
            self.highest[key] = max(value, self.highest.get(key, value))
        return True

    def value(self, name: str, **labels: str) -> float | None:
        """The highest value seen of the series with exactly these labels."""
        wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        return self.highest.get((name, wanted))


def fake_state(fake_dir: Path) -> dict[str, Any]:
    return fakeslurm.read_state(fake_dir)


__all__ = [
    "Agent",
    "Api",
    "Daemon",
    "Driver",
    "Metrics",
    "StoreView",
    "Unreachable",
    "fake_state",
    "fakeslurm",
]
