"""A live ``resurgo-supervisor`` under attack over 127.0.0.1 (docs/security.md, 7).

Shared by the functional attacks (``tests/integration/test_adversarial_api.py``)
and by what they cost in memory and latency (``bench/api_abuse.py``): one
real daemon (fake Slurm, a job submitted and running) and the raw-socket
clients a stranger or a hostile job owner would write. The stranger knows a
job id (it is on /metrics) and nothing else; the job owner also has the
job's secret. Every loop here is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.jobs import JobSpec, read_secret, submit
from supervisor.jobs import job_dir as job_directory
from supervisor.slurm import SlurmClient
from tests.ckpt_helpers import make_committed_checkpoint
from tests.conftest import free_port
from tests.integration.crash_world import Api, Daemon, fakeslurm

NODES = ("node1", "node2")
BODY_TIMEOUT_S = 3
HEADER_TIMEOUT_S = 3
EVENTS_PER_MINUTE = 2000
MIB = 1 << 20
# CPU seconds per half second under which the daemon counts as idle (it ticks every 0.2 s).
IDLE_CPU_S = 0.05


class _Daemon(Daemon):
    def __init__(
        self, state_dir: Path, port: int, fake_dir: Path, bin_dir: Path, extra_env: dict[str, str]
    ) -> None:
        super().__init__(state_dir, port, fake_dir, bin_dir)
        self._extra_env = extra_env

    @property
    def env(self) -> dict[str, str]:
        return {
            **super().env,
            "RESURGO_SUPERVISOR_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S),
            "RESURGO_SUPERVISOR_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
            "RESURGO_SUPERVISOR_EVENTS_PER_MINUTE": str(EVENTS_PER_MINUTE),
            **self._extra_env,
        }


class World:
    """The daemon, one running job of two nodes, and its checkpoint root (plus another
    user's directory beside it). Close with :meth:`close`."""

    def __init__(self, root: Path, extra_env: dict[str, str] | None = None) -> None:
        self.root = root
        fake_dir = root / "slurm"
        fakeslurm.create(fake_dir, NODES)
        bin_dir = fakeslurm.install(root / "bin")
        self.daemon = _Daemon(
            root / "state", free_port(), fake_dir, bin_dir, extra_env=extra_env or {}
        )
        self.ckpt_root = root / "ckpt"
        self.ckpt_root.mkdir()
        self.other = root / "other-user"  # another user's private checkpoints
        self.daemon.start()
        jobs_dir = self.daemon.state_dir / "jobs"
        spec = JobSpec(
            name="target", nodes=2, command=("torchrun", "train.py"),
            ckpt_root=str(self.ckpt_root), supervisor_url=self.daemon.url,
        )  # fmt: skip
        client = SlurmClient(env={"PATH": self.daemon.env["PATH"], "FAKESLURM_DIR": str(fake_dir)})
        self.job_id = asyncio.run(submit(spec, jobs_dir, client))
        self.api = Api(
            self.daemon.url, self.job_id, read_secret(job_directory(jobs_dir, self.job_id))
        )
        self.incarnation = secrets.token_hex(8)
        self.seq = 0
        self._lock = threading.Lock()
        # The job runs on its nodes once the supervisor polled Slurm.
        deadline = time.monotonic() + 30
        while (
            self.post_events([self.event(EventKind.AGENT_STOPPED, {"reason": "probe"})])[0] != 200
        ):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job never ran:\n{self.daemon.tail()}")
            time.sleep(0.2)
        self.process = psutil.Process(self.daemon.process.pid)  # type: ignore[union-attr]

    def close(self) -> None:
        """Stop the daemon."""
        self.daemon.close()

    def event(self, kind: EventKind, payload: dict[str, object]) -> protocol.Event:
        """A new event of the job's first node, numbered after every earlier one."""
        with self._lock:
            self.seq += 1
            seq = self.seq
        return protocol.make_event(
            kind, self.job_id, NODES[0], self.incarnation, seq, time.time(), payload
        )

    def post_events(self, events: list[protocol.Event]) -> tuple[int, bytes]:
        """Sign and post ``events``: (status, body)."""
        return self.api.post(protocol.EVENTS_PATH, protocol.encode_events(events))

    def commit(self, step: int, path: Path | str) -> tuple[int, bytes]:
        """Post one ``checkpoint_committed`` event for ``path``."""
        event = self.event(EventKind.CHECKPOINT_COMMITTED, {"step": step, "path": str(path)})
        return self.post_events([event])

    def written(self, step: int, path: Path | str) -> tuple[int, bytes]:
        """Post one ``checkpoint_written`` event for ``path`` (a script's own save)."""
        payload = {"step": step, "path": str(path), "global_rank": 0, "total_bytes": None}
        return self.post_events([self.event(EventKind.CHECKPOINT_WRITTEN, payload)])

    def healthz(self) -> dict[str, object]:
        """``/healthz``'s document (the request must succeed)."""
        status, body = http_get(self.daemon.port, "/healthz")
        if status != 200:
            raise RuntimeError(f"/healthz answered {status}: {body[:200]!r}")
        return dict(json.loads(body))

    def store(self) -> sqlite3.Connection:
        """A read-only connection to the daemon's store (close it)."""
        return sqlite3.connect(f"file:{self.daemon.state_dir / 'resurgo.db'}?mode=ro", uri=True)

    def stored_events(self) -> int:
        """How many events of the job the store holds now."""
        with contextlib.closing(self.store()) as db:
            return int(
                db.execute(
                    "SELECT COUNT(*) FROM events WHERE job_id = ?", (self.job_id,)
                ).fetchone()[0]
            )

    def rss(self) -> int:
        """The daemon's resident memory now, in bytes."""
        return int(self.process.memory_info().rss)

    def signed_post(self, events: list[protocol.Event]) -> bytes:
        """A whole ``POST /v1/events`` request (signed by the job owner), closing its connection."""
        body = protocol.encode_events(events)
        headers = protocol.signed_headers(
            self.api.secret, "POST", protocol.EVENTS_PATH, self.job_id, int(time.time()), body
        )
        head = [f"POST {protocol.EVENTS_PATH} HTTP/1.1", "Host: x", f"Content-Length: {len(body)}"]
        head += [f"{name}: {value}" for name, value in headers.items()]
        return ("\r\n".join([*head, "Connection: close"]) + "\r\n\r\n").encode() + body


def http_get(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a plain GET on its own connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = read_all(sock, timeout_s)
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


def read_all(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything until the server closes; AssertionError if still open after ``timeout_s``."""
    sock.settimeout(0.2)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionError:
            break
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
    raise AssertionError(f"still open after {timeout_s} s; got {b''.join(chunks)[:200]!r}")


def stranger_head(job_id: str, length: int | None, *, timestamp: str | None = None) -> bytes:
    """Headers a stranger can write: a real job id, a fresh timestamp, a signature of the
    right shape (not the job's)."""
    lines = [
        f"POST {protocol.EVENTS_PATH} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"{protocol.HEADER_JOB}: {job_id}",
        f"{protocol.HEADER_TIMESTAMP}: {timestamp or int(time.time())}",
        f"{protocol.HEADER_SIGNATURE}: {secrets.token_hex(32)}",
        f"{protocol.HEADER_PROTOCOL}: 1",
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def aborted_upload(port: int, job_id: str, size: int) -> None:
    """Announce ``size`` bytes, send all but the last KiB, then reset the connection."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout=10)
    except (OSError, TimeoutError):
        return
    try:
        writer.write(stranger_head(job_id, size))
        piece = b"x" * MIB
        sent = 0
        while sent < size - 1024:
            count = min(MIB, size - 1024 - sent)
            writer.write(piece[:count])
            await asyncio.wait_for(writer.drain(), timeout=10)
            sent += count
    except (OSError, TimeoutError):
        pass
    finally:
        sock = writer.get_extra_info("socket")
        with contextlib.suppress(OSError):
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
        writer.transport.abort()


async def waves(port: int, job_id: str, count: int, size: int, concurrent: int) -> None:
    """``count`` aborted uploads of ``size`` bytes, ``concurrent`` at a time."""
    for _ in range(count // concurrent):
        await asyncio.gather(*(aborted_upload(port, job_id, size) for _ in range(concurrent)))


def settled_rss(world: World) -> int:
    """The daemon's RSS once it is done with every aborted upload: the worst of 2 s of samples.

    Done means its connections are closed *and* it is idle (under 10% of a core
    for half a second): on a loaded machine the server runs seconds behind the
    clients, still reading and refusing what the kernel already handed it after
    the connections were reset. Measured any earlier, RSS counts that work in
    flight, not what the uploads left behind.
    """
    deadline = time.monotonic() + 30
    while any(
        conn.status == psutil.CONN_ESTABLISHED and conn.laddr.port == world.daemon.port
        for conn in world.process.net_connections("tcp")
    ):
        if time.monotonic() > deadline:
            raise RuntimeError("the supervisor never closed the aborted uploads")
        time.sleep(0.1)
    while time.monotonic() < deadline:
        before = world.process.cpu_times()
        time.sleep(0.5)
        after = world.process.cpu_times()
        if (after.user + after.system) - (before.user + before.system) < IDLE_CPU_S:
            break
    samples = []
    for _ in range(10):
        samples.append(world.rss())
        time.sleep(0.2)
    return max(samples)


def manifest(size: int, stats: dict[str, object]) -> bytes:
    """A valid checkpoint manifest of ``size`` bytes (no files; padded)."""
    head = json.dumps(
        {"format_version": 1, "checksum_algorithm": "xxh3-128", "files": [], "stats": stats}
    ).encode()[:-1]
    padding = size - len(head) - len(b',"pad":""}')
    return head + b',"pad":"' + b"p" * padding + b'"}'


_PROBER = """
import socket, sys, time
port, until = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while time.monotonic() < until:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
        while sock.recv(65536):
            pass
    print(started, time.monotonic() - started, flush=True)
    time.sleep(0.01)
"""


async def post_all(port: int, requests: list[bytes]) -> list[bytes]:
    """Send every request at once, each on its own connection; the status lines."""

    async def one(request: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request)
            return await asyncio.wait_for(reader.readline(), timeout=30)
        finally:
            writer.close()

    return await asyncio.gather(*(one(request) for request in requests))


@contextlib.contextmanager
def a_world(extra_env: dict[str, str] | None = None) -> Iterator[World]:
    """A :class:`World` in a temporary directory (a benchmark's), closed and removed after."""
    with tempfile.TemporaryDirectory() as where:
        world = World(Path(where), extra_env=extra_env)
        try:
            yield world
        finally:
            world.close()


@dataclass(frozen=True)
class Probes:
    """``/healthz`` latencies (seconds) around one burst of requests."""

    burst: list[float]  # probes started before every request of the burst was answered
    later: list[float]  # probes started after that
    readers: int  # manifest reader processes seen meanwhile
    statuses: list[bytes]  # the burst's status lines


def healthz_under(world: World, requests: list[bytes], probe_s: float = 6.0) -> Probes:
    """``/healthz`` probed for ``probe_s`` from a process of its own (so the load generator
    here does not share its GIL) while ``requests`` are sent at once and answered."""
    prober = subprocess.Popen(
        [sys.executable, "-c", _PROBER, str(world.daemon.port), str(probe_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    readers: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                for child in world.process.children():
                    if "supervisor.manifests" in child.cmdline():
                        readers.add(child.pid)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        time.sleep(1)
        statuses = asyncio.run(post_all(world.daemon.port, requests))
        answered = time.monotonic()
        out, _ = prober.communicate(timeout=probe_s + 30)
    finally:
        done.set()
        watcher.join()
        prober.kill()
    probes = [tuple(map(float, line.split())) for line in out.splitlines()]
    return Probes(
        burst=[lag for started, lag in probes if started < answered],
        later=[lag for started, lag in probes if started >= answered],
        readers=len(readers),
        statuses=statuses,
    )


def expanding_pickle(count: int) -> bytes:
    """A protocol-4 pickle of a list of ``count`` distinct integers, written directly."""
    items = np.empty((count, 5), dtype=np.uint8)
    items[:, 0] = ord("J")  # BININT: a 4-byte signed integer
    values = np.arange(1 << 20, (1 << 20) + count, dtype="<i4")
    items[:, 1:] = values.view(np.uint8).reshape(count, 4)
    return b"\x80\x04]" + b"(" + items.tobytes() + b"e."  # PROTO 4, EMPTY_LIST, MARK, APPENDS


@dataclass
class CraftedRun:
    """What validating a crafted checkpoint cost the daemon: its settled RSS before, the
    peak during, the slowest ``/healthz`` answer, the crafted directory and the log."""

    before: int
    peak: int
    slowest_s: float
    seconds: float
    crafted: Path
    log: Path

    @property
    def grown(self) -> int:
        return self.peak - self.before


def crafted_checkpoint_run(world: World, metadata: bytes) -> CraftedRun:
    """Commit a good step-100 and a step-200 whose ``.metadata`` is ``metadata``, kill a
    rank, and watch the daemon's RSS and ``/healthz`` until the good one is chosen."""
    good = make_committed_checkpoint(world.ckpt_root, 100)
    crafted = world.ckpt_root / "step-200"
    crafted.mkdir()
    (crafted / "__0_0.distcp").write_bytes(b"")
    (crafted / ".metadata").write_bytes(metadata)
    assert world.commit(100, good)[0] == 200
    assert world.commit(200, crafted)[0] == 200
    before = settled_rss(world)
    peak = [before]
    slowest = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], world.rss())
            started = time.monotonic()
            status, _ = http_get(world.daemon.port, "/healthz", timeout_s=10)
            assert status == 200
            slowest[0] = max(slowest[0], time.monotonic() - started)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        killed = {"global_rank": 0, "local_rank": 0, "pid": 99, "exit_code": None, "signal": 9,
                  "signal_name": "SIGKILL", "last_step": 210, "phase": "train"}  # fmt: skip
        assert world.post_events([world.event(EventKind.RANK_EXITED, killed)])[0] == 200
        log = world.daemon.log_path
        deadline = time.monotonic() + 600
        # The recovery's choice (its line names the job), not the validation of the
        # good one ahead of the fault, which may come first.
        chosen = f"job {world.job_id}: checkpoint {good} valid"
        while chosen not in log.read_text(errors="replace"):
            assert time.monotonic() < deadline, world.daemon.tail()
            time.sleep(0.2)
    finally:
        done.set()
        watcher.join()
    return CraftedRun(before, peak[0], slowest[0], time.monotonic() - started, crafted, log)
