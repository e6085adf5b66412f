"""A hostile job owner's text against a live supervisor (issue 19): logs, store, CLI, Slurm.

One real ``resurgo-supervisor`` runs for the module against the fake Slurm
(``tests/fixtures/fakeslurm``), started under umask 022; one job is submitted
and driven by the test's own agents and driver (``crash_world``), which speak
the real signed protocol. The job's owner then sends what the adversarial
review found: newlines and NUL in a checkpoint path and in a culprit's
reason, lone surrogates anywhere in a request, non-finite save statistics.
The text log must stay one line per record with no forged line, the Slurm
drain reason one bounded printable line, every CLI view must print a store
that holds such text (rows from before strict decoding too), and a user who
may only read the store must get the views, and one-line refusals, never a
traceback.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint import format as fmt
from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.jobs import JobSpec, read_secret, submit
from supervisor.jobs import job_dir as job_directory
from supervisor.slurm import SlurmClient
from supervisor.slurm.parse import parse_sinfo_json
from tests.conftest import REPO, free_port
from tests.integration.crash_world import Agent, Api, Daemon, Driver, StoreView, fakeslurm
from tests.other_users import python_for, reachable_by_others

NODES = ("node1", "node2", "node3", "node4")
FORGED = "resurgo-supervisor 2026-01-01 00:00:00,000 ERROR ALERT node9 is on fire"
TIMEOUT_S = 30.0


@dataclass
class World:
    root: Path
    fake_dir: Path
    daemon: Daemon
    api: Api
    store: StoreView
    launches: Counter[str]
    driver: Driver | None = None

    @property
    def job_id(self) -> str:
        return self.api.job_id

    def pump(self) -> None:
        """One tick of the job's world: its batch script's driver and its agents."""
        job = fakeslurm.read_state(self.fake_dir)["jobs"][self.job_id]
        running = job["state_name"] == "RUNNING"
        if running and (self.driver is None or job["batch_runs"] != self.driver.batch_run):
            if self.driver is not None:
                self.driver.dead = True
            self.driver = Driver(self.api, job["batch_runs"], tuple(job["nodes"]), self.launches)
        if self.driver is None or not running:
            return
        now = time.time()
        self.driver.pump(now)
        for agent in self.driver.agents:
            if agent.node in job["nodes"]:
                agent.pump(now)

    def until(self, what: str, ready: Callable[[], bool], timeout_s: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} after {timeout_s} s:\n{self.daemon.tail()}")
            self.pump()
            time.sleep(0.05)

    def record(self) -> dict[str, Any]:
        return self.store.record(self.job_id) or {}

    def running_agents(self) -> list[Agent]:
        self.until(
            "running",
            lambda: (
                self.record().get("state") == "running"
                and self.driver is not None
                and bool(self.driver.agents)
            ),
        )
        assert self.driver is not None
        return self.driver.agents

    def deliver(self, agent: Agent, kind: EventKind, payload: dict[str, Any]) -> None:
        """Emit an event and pump until the supervisor acknowledged it."""
        agent.emit(kind, payload)
        event_id = agent.outbox[-1].event_id
        self.until(f"{kind.value} acknowledged", lambda: event_id not in _ids(agent.outbox))

    def log_lines(self) -> list[str]:
        return self.daemon.log_path.read_text(errors="backslashreplace").split("\n")

    def resurgo(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "supervisor.cli.main", *args,
             "--state-dir", str(self.daemon.state_dir)],
            env={**self.daemon.env}, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip


def _ids(events: list[protocol.Event]) -> set[str]:
    return {event.event_id for event in events}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("adversarial")
    fake_dir = root / "slurm"
    fakeslurm.create(fake_dir, NODES)
    bin_dir = fakeslurm.install(root / "bin")
    daemon = Daemon(root / "state", free_port(), fake_dir, bin_dir)
    previous = os.umask(0o022)  # the state directory and the daemon inherit it
    try:
        daemon.start()
    finally:
        os.umask(previous)
    store = StoreView(daemon.state_dir / "resurgo.db")
    try:
        spec = JobSpec(
            name="hostile", nodes=2, command=("torchrun", "train.py"),
            ckpt_root=str(root / "ckpt"), min_nodes=1, procs_per_node=2,
            supervisor_url=daemon.url,
        )  # fmt: skip
        jobs_dir = daemon.state_dir / "jobs"
        client = SlurmClient(env={"PATH": daemon.env["PATH"], "FAKESLURM_DIR": str(fake_dir)})
        job_id = asyncio.run(submit(spec, jobs_dir, client))
        api = Api(daemon.url, job_id, read_secret(job_directory(jobs_dir, job_id)))
        yield World(root, fake_dir, daemon, api, store, Counter())
    finally:
        daemon.close()
        store.close()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _forged(lines: list[str]) -> list[str]:
    """Lines that start as the owner's text does: a record the owner wrote."""
    return [line for line in lines if line.startswith(FORGED)]


def test_under_umask_022_the_state_directory_and_store_are_private(world: World) -> None:
    state = world.daemon.state_dir
    # The jobs directory lies inside: others may pass through to it, not list.
    assert _mode(state) == 0o701
    for name in ("resurgo.db", "resurgo.db-wal", "resurgo.db-shm"):
        assert _mode(state / name) == 0o600, name


def test_a_newline_and_nul_in_a_checkpoint_path_never_forge_a_log_line(world: World) -> None:
    leader = world.running_agents()[0]
    path = f"{world.root}/ckpt/step-7\n{FORGED}\x00"
    leader.emit(EventKind.CHECKPOINT_COMMITTED, {"step": 7, "path": path, "global_rank": 0})
    # No such directory can lie inside the root: refused (403), and the refusal,
    # which quotes the path, is logged on one line.
    world.until(
        "the refusal logged",
        lambda: any("outside_root" in line and "ERROR ALERT node9" in line
                    for line in world.log_lines()),
    )  # fmt: skip
    leader.outbox.pop()  # refused for good: no later test waits behind it
    assert b"\x00" not in world.daemon.log_path.read_bytes()
    assert _forged(world.log_lines()) == []


def _checkpoint(world: World, step: int, stall: str) -> str:
    manifest = fmt.Manifest(
        step=step, world_size=4, contents=(), files=(), created_unix_s=time.time(),
        stats=fmt.SaveStats(stall_s=1.5, write_s=3.0, total_bytes=10, filesystem="ext4",
                            mode="async"),
    )  # fmt: skip
    text = fmt.manifest_to_bytes(manifest).decode().replace('"stall_s": 1.5', f'"stall_s": {stall}')
    directory = world.root / "ckpt" / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / fmt.MANIFEST_NAME).write_text(text)
    return str(directory)


def _stats_steps(world: World) -> list[int]:
    rows = world.store.rows(
        "SELECT payload FROM events WHERE job_id = ? AND kind = 'checkpoint_stats'", world.job_id
    )
    return [json.loads(payload)["step"] for (payload,) in rows]


@pytest.mark.parametrize(
    ("step", "stall"), [(30, '"nan"'), (40, "NaN"), (50, '"inf"'), (60, "Infinity")]
)
def test_non_finite_save_statistics_are_refused_and_never_stored(
    world: World, step: int, stall: str
) -> None:
    leader = world.running_agents()[0]
    if not _stats_steps(world):
        # Finite statistics are stored: shown once per module, since the supervisor
        # reads at most 6 manifests per job a minute (supervisor/manifests.py).
        good = step - 5
        path = _checkpoint(world, good, "2.5")
        world.deliver(leader, EventKind.CHECKPOINT_COMMITTED,
                      {"step": good, "path": path, "global_rank": 0})  # fmt: skip
        world.until("finite statistics stored", lambda: good in _stats_steps(world))
    path = _checkpoint(world, step, stall)
    world.deliver(leader, EventKind.CHECKPOINT_COMMITTED,
                  {"step": step, "path": path, "global_rank": 0})  # fmt: skip
    world.until(
        "the refusal logged",
        lambda: any(f"step-{step}" in line and "no save statistics" in line
                    for line in world.log_lines()),
    )  # fmt: skip
    assert step not in _stats_steps(world)
    assert not any("Traceback" in line for line in world.log_lines())


def _signed_post(world: World, path: str, body: bytes) -> tuple[int, dict[str, Any]]:
    status, data = world.api.post(path, body)
    return status, json.loads(data)


def test_a_lone_surrogate_anywhere_in_a_request_is_a_400_saying_so(world: World) -> None:
    agent = world.running_agents()[-1]
    hang = protocol.make_event(
        EventKind.HANG, world.job_id, agent.node, agent.incarnation, 9_000, time.time(),
        {"hung": [], "stacks": {"0": "PLACEHOLDER"},
         "culprits": [{"global_rank": 0, "last_step": 1, "in_collective": False,
                       "reason": "PLACEHOLDER"}]},
    )  # fmt: skip
    events = protocol.encode_events([hang])
    beat = protocol.encode_heartbeat(protocol.HeartbeatReport(
        world.job_id, agent.node, time.time(),
        (protocol.RankStatus(agent.ranks[0], 0, 1000, 1, "PLACEHOLDER", time.time(),
                             0.3, 0.3, 0.3, 10),),
        agent.incarnation, agent.attempt,
    ))  # fmt: skip
    for path, body in ((protocol.EVENTS_PATH, events), (protocol.HEARTBEAT_PATH, beat)):
        for escape in (b"\\ud800", b"\\udfff", b"ok\\udc80"):
            status, answer = _signed_post(world, path, body.replace(b"PLACEHOLDER", escape, 1))
            assert status == 400, (path, escape, answer)
            assert "lone surrogate" in answer["reason"], answer
    assert not world.store.rows("SELECT 1 FROM events WHERE agent_seq = 9000")
    assert not any("Traceback" in line for line in world.log_lines())


def test_a_culprit_reason_never_forges_a_log_line_nor_becomes_the_drain_reason_verbatim(
    world: World,
) -> None:
    agents = world.running_agents()
    agent = agents[-1]
    agent.step += 10  # run alone, the job may be at step 1: a rank 3 steps behind needs more
    behind, waiting = agent.ranks
    world.deliver(agent, EventKind.HANG, {
        "hung": [{"global_rank": rank, "local_rank": rank % 2, "pid": 1000 + rank,
                  "last_step": agent.step - lag, "phase": "train",
                  "seconds_since_progress": 30.0 + lag, "timeout_s": 30.0,
                  "detector": "heartbeat"} for rank, lag in ((behind, 3), (waiting, 0))],
        "stacks": {str(behind): f"Thread 1: train_step\n{FORGED}\x1b[2J",
                   str(waiting): "Thread 1: allreduce (distributed_c10d.py:2050)"},
        "culprits": [
            {"global_rank": behind, "last_step": agent.step - 3, "in_collective": False,
             "reason": f"3 steps behind\n{FORGED}\x00" + "x" * 400},
            {"global_rank": waiting, "last_step": agent.step, "in_collective": True,
             "reason": "waits in allreduce"},
        ],
    })  # fmt: skip
    node = agent.node
    world.until("drained", lambda: fakeslurm.read_state(world.fake_dir)["nodes"][node]["drain"])
    reason = fakeslurm.read_state(world.fake_dir)["nodes"][node]["reason"]
    assert reason.startswith(f"resurgo: hang job={world.job_id} "), reason
    assert reason.isascii() and reason.isprintable(), reason
    assert len(reason) <= 200, reason
    assert "3 steps behind\\n" in reason  # the owner's words are there, escaped
    drains = "SELECT reason FROM drains WHERE node = ?"
    world.until("the drain recorded", lambda: bool(world.store.rows(drains, node)))  # after Slurm's
    assert world.store.rows(drains, node) == [(reason,)]
    world.until(
        "the reason logged", lambda: any("3 steps behind\\n" in line for line in world.log_lines())
    )
    assert _forged(world.log_lines()) == []
    assert b"\x00" not in world.daemon.log_path.read_bytes()


def test_every_cli_view_prints_a_store_holding_bad_text_from_before_strict_decoding(
    world: World,
) -> None:
    # What a supervisor without strict decoding stored: JSON escapes of a lone
    # surrogate, control characters and a terminal escape, in an agent event.
    payload = {"step": 99, "global_rank": 0,
               "path": f"/ckpt/step-99\n{FORGED}\ud800\x1b[2J\x00"}  # fmt: skip
    stacks = {"hung": [], "culprits": [],
              "stacks": {"0": f"Thread 1\n{FORGED}\ud800\x1b]0;owned\x07"}}  # fmt: skip
    writer = sqlite3.connect(world.daemon.state_dir / "resurgo.db", timeout=10)
    with writer:
        for seq, (kind, body) in enumerate(
            ((EventKind.CHECKPOINT_COMMITTED, payload), (EventKind.HANG, stacks)), start=1
        ):
            writer.execute(
                "INSERT INTO events (event_id, job_id, node, kind, source, agent_seq, time_s,"
                " received_s, payload) VALUES (?, ?, 'node1', ?, 'agent', ?, ?, ?, ?)",
                (f"{world.job_id}-old-{seq}", world.job_id, kind.value, 90_000 + seq,
                 time.time(), time.time(), json.dumps(body)),
            )  # fmt: skip
    writer.close()
    report = world.root / "report.html"
    views = {
        "events": world.resurgo("events", world.job_id),
        "events --stacks": world.resurgo("events", world.job_id, "--stacks"),
        "events --json": world.resurgo("events", world.job_id, "--json"),
        "status": world.resurgo("status"),
        "status --json": world.resurgo("status", "--json"),
        "nodes": world.resurgo("nodes"),
        "report": world.resurgo("report", world.job_id, "-o", str(report)),
    }
    for name, done in views.items():
        assert done.returncode == 0, (name, done.stderr[-3000:])
        assert "Traceback" not in done.stderr, (name, done.stderr[-3000:])
        assert "\x1b" not in done.stdout and "\x00" not in done.stdout, name
        assert not any(line.startswith(FORGED) for line in done.stdout.split("\n")), name
    assert "step-99\\n" + FORGED in views["events"].stdout
    json.loads(views["events --json"].stdout)
    json.loads(views["status --json"].stdout)
    assert "\\ud800" in report.read_text()


# --- a user who may only read the store --------------------------------------------------


class _OperatorsDaemon(Daemon):
    """The supervisor with ``state_group = "nogroup"``: its members may read the store."""

    @property
    def env(self) -> dict[str, str]:
        return {**super().env, "RESURGO_SUPERVISOR_STATE_GROUP": "nogroup"}


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user can reach (pytest's own tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="resurgo-readonly-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def test_a_user_who_may_only_read_the_store_gets_the_views_and_one_line_refusals(
    shared_dir: Path,
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the test runs the CLI as user nobody of group nogroup")
    with reachable_by_others():
        _as_a_reader_of_the_store(shared_dir, *python_for("nobody", "nogroup"))


def _as_a_reader_of_the_store(shared_dir: Path, python: str, pythonpath: str) -> None:
    fake_dir = shared_dir / "slurm"
    fakeslurm.create(fake_dir, NODES)
    daemon = _OperatorsDaemon(shared_dir / "state", free_port(), fake_dir,
                              fakeslurm.install(shared_dir / "bin"))  # fmt: skip
    # The reader's Slurm: sinfo shows a drained node; scontrol refuses as slurmctld
    # does a user without operator rights.
    reader_bin = shared_dir / "reader-bin"
    reader_bin.mkdir()
    recorded = REPO / "tests" / "fixtures" / "slurm" / "sinfo_drained.json"
    drained = next(
        name for name, node in parse_sinfo_json(recorded.read_text()).items() if node.drained
    )
    shutil.copy(recorded, reader_bin / "sinfo.json")
    (reader_bin / "sinfo").write_text(f"#!/bin/sh\ncat {reader_bin / 'sinfo.json'}\n")
    (reader_bin / "scontrol").write_text(
        "#!/bin/sh\necho 'slurm_update error: Access/permission denied' >&2\nexit 1\n"
    )
    for script in ("sinfo", "scontrol"):
        (reader_bin / script).chmod(0o755)

    def as_reader(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [python, "-m", "supervisor.cli.main", *args, "--state-dir", str(daemon.state_dir)],
            user="nobody", group="nogroup", extra_groups=[], cwd="/",
            env={"PATH": f"{reader_bin}:/usr/bin:/bin", "PYTHONPATH": pythonpath,
                 "HOME": "/nonexistent"},
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    try:
        daemon.start()
        state = daemon.state_dir
        assert _mode(state) == 0o2751  # group operators read; others pass to the jobs dir
        for name in ("resurgo.db", "resurgo.db-wal", "resurgo.db-shm"):
            assert _mode(state / name) == 0o640, name
            assert grp.getgrgid((state / name).stat().st_gid).gr_name == "nogroup", name
        results = {
            "status while it runs": as_reader("status"),
            "nodes": as_reader("nodes"),
            "undrain": as_reader("nodes", "undrain", drained),
            "forgive": as_reader("nodes", "forgive", drained),
        }
        daemon.stop()
        results["status while it is down"] = as_reader("status")
    finally:
        daemon.close()
    for name, done in results.items():
        assert "Traceback" not in done.stderr, (name, done.stderr[-3000:])
        assert len(done.stderr.strip().split("\n")) <= 1, (name, done.stderr)
    for name in ("status while it runs", "status while it is down", "nodes"):
        assert results[name].returncode == 0, (name, results[name].stderr)
    assert "no supervised jobs" in results["status while it is down"].stdout
    assert drained in results["nodes"].stdout
    undrain, forgive = results["undrain"], results["forgive"]
    assert undrain.returncode == 1 and "needs Slurm operator rights" in undrain.stderr
    assert forgive.returncode == 1 and "may not write the store" in forgive.stderr
