"""Supervisor load benchmark: thousands of simulated node agents against a real supervisor.

A real ``resurgo-supervisor`` (``python -m supervisor.daemon``) runs as its own
process on a loopback port with a fresh state directory. A tiny fake Slurm CLI
on its ``PATH`` (``squeue``/``sinfo`` print Slurm 22.05 JSON built from the
records in ``tests/fixtures/slurm/``, one node record per agent;
``scontrol``/``sbatch``/``scancel`` do nothing) lists the benchmark's jobs as
RUNNING, and each job has a directory written by
:func:`supervisor.jobs.write_job_dir` (spec and 0600 secret), so the daemon
registers the jobs exactly as it registers submitted ones.

``--agents N`` simulated agents are spread over jobs of 8 to 64 nodes, one
agent per node, each with its own node name and incarnation. Load-generator
processes (one per ``--agents-per-worker`` agents, 1,024 by default: at 4,096
agents, 8 processes sharing one core cost it 10-15% more CPU than 4 and
saturated it) each run one asyncio loop;
every agent keeps its own keep-alive connections (one for heartbeats, one
for events, as the two concurrent requests of the real agent's aiohttp
session) and signs every request with the protocol's
:func:`~agent.wire.protocol.signed_headers` (``--client aiohttp`` sends through
:func:`agent.wire.auth.signed_post` instead, at several times the generator's
CPU). Each agent:

- sends ``agent_started`` (attempt 1) when it starts (start times jittered
  over the first second);
- sends a heartbeat every second: ``--ranks-per-node`` ranks, all at the
  job's current step (synchronous training), with step and compute times.
  ``--heartbeats stream`` (the default, what the real agent does) sends them
  over one WebSocket per agent to the heartbeat stream, opened with a signed
  upgrade; ``--heartbeats post`` POSTs each, as agents did before the stream;
- emits benign events at random (``--events-per-agent-min`` a minute on
  average): ``step_losses``, ``checkpoint_committed`` (after writing the
  checkpoint's manifest, which the supervisor reads) and ``straggler``, with
  per-incarnation ``seq`` numbers and ids, batched and resent until
  acknowledged (never ``rank_exited`` or ``hang``, which start recoveries).

Every request's latency is measured by the sender, from the request to the
parsed reply, during a steady-state window (``--warmup-s`` after the start,
``--measure-s`` long). A request that failed or timed out counts in the
percentiles as its timeout (or longer, if it took longer): they are over
every request sent, not only the answered ones. Over the same window: the supervisor's CPU time
(``cpu_times`` of its process; its Slurm children are excluded) divided by
the wall time, i.e. the cores it used, and per request; the generators' CPU
the same way; the machine's busy cores (what neither used is other work);
and the share of the window the supervisor was runnable but waited for a
CPU (``/proc/<pid>/task/*/schedstat``): above a few percent it was starved.
RSS is read at the end of the window. The supervisor's own
``resurgo_supervisor_loop_lag_seconds`` histogram, scraped at both ends of
the window, bounds how late its event loop ran (``supervisor_loop_lag_*``,
bucket upper bounds): the supervisor's share of the latencies, which on a
small machine also hold the generators' waits for their CPU. After the window, agents stop emitting
and resend what is unacknowledged for up to ``--drain-s``; the supervisor is
stopped (SIGTERM) and its store is read: ``lost_events`` is events
acknowledged but not stored (``acknowledged_not_stored``: a broken promise)
plus events still unacknowledged when the drain ended
(``never_acknowledged``: a real agent keeps those spooled and resends them).

``--floor`` runs the same heartbeats against a bare aiohttp server that
answers every request (or every frame on a stream) with an empty reply: what
HTTP or a WebSocket alone costs here.
``--pin`` keeps the supervisor on the first CPU and the generators on the
others. ``--profile PREFIX`` records the supervisor with py-spy.

    python -m bench.supervisor_load --agents 4096
    python -m bench.supervisor_load --all        # 256, 1024 and 4096
    python -m bench.supervisor_load --agents 1024 --heartbeats post

One JSON line per run; the last line printed is one JSON object (the run
itself, or the largest run's figures with ``"runs": [...]``, every run).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import contextlib
import copy
import getpass
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if not __package__:
    sys.exit(
        "run the benchmarks from the repository root as modules: python -m bench.supervisor_load"
    )

import aiohttp
import psutil
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from agent.checkpoint import format as fmt
from agent.wire import protocol
from agent.wire.auth import Rejected, load_secret, signed_post
from agent.wire.protocol import EventKind, HeartbeatReport, RankStatus, Refusal
from supervisor.jobs import SECRET_NAME, JobSpec, write_job_dir
from supervisor.slurm.parse import compress_hostlist
from supervisor.store import EventSource, Store

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures" / "slurm"
SIZES = (256, 1024, 4096)
JOB_SIZES = (8, 16, 32, 64)
FIRST_JOB_ID = 10001
HEARTBEAT_PERIOD_S = 1.0
HEARTBEAT_TIMEOUT_S = 2.0  # agent.node.client.DEFAULT_HEARTBEAT_TIMEOUT_S
EVENT_TIMEOUT_S = 5.0
MAX_BATCH = 100
# The kinds an agent emits at random, and how often each (weights).
EVENT_MIX = ((EventKind.STEP_LOSSES, 6), (EventKind.CHECKPOINT_COMMITTED, 3),
             (EventKind.STRAGGLER, 1))  # fmt: skip


@dataclass(frozen=True)
class AgentPlan:
    """One simulated node agent: its job, node and ranks, and its job's training pace."""

    job_id: str
    node: str
    node_rank: int
    nnodes: int
    ranks_per_node: int
    secret_hex: str
    job_start_s: float
    step_time_s: float
    ckpt_root: str


# ---------------------------------------------------------------------------
# The fake cluster: jobs, Slurm's JSON, job directories.


def plan_jobs(agents: int, rng: random.Random) -> list[list[str]]:
    """Node names of each job: sizes drawn from :data:`JOB_SIZES`, ``agents`` nodes in all."""
    jobs: list[list[str]] = []
    index = 0
    while index < agents:
        size = min(rng.choice(JOB_SIZES), agents - index)
        jobs.append([f"n{number:05d}" for number in range(index, index + size)])
        index += size
    return jobs


def squeue_json(jobs: dict[str, list[str]], user: str, now: int) -> str:
    """``squeue --json`` listing every job RUNNING, each record shaped like Slurm 22.05's."""
    fixture = json.loads((FIXTURES / "squeue_mixed.json").read_text())
    template = next(job for job in fixture["jobs"] if job["job_state"] == "RUNNING")
    records = []
    for job_id, nodes in jobs.items():
        record = copy.deepcopy(template)
        node_list = compress_hostlist(nodes)
        record.update(
            job_id=int(job_id), name=f"load-{job_id}", job_state="RUNNING", state_reason="None",
            nodes=node_list, node_count=len(nodes), batch_host=nodes[0], user_name=user,
            restart_cnt=0, start_time=now, submit_time=now, end_time=0,
            job_resources={"nodes": node_list, "allocated_hosts": len(nodes)},
        )  # fmt: skip
        records.append(record)
    return json.dumps({"meta": fixture["meta"], "errors": [], "jobs": records})


def sinfo_json(jobs: dict[str, list[str]]) -> str:
    """``sinfo --json`` with every node allocated and healthy (Slurm 22.05's records)."""
    fixture = json.loads((FIXTURES / "sinfo_drained.json").read_text())
    template = fixture["nodes"][0]
    records = []
    for nodes in jobs.values():
        for node in nodes:
            record = copy.deepcopy(template)
            record.update(name=node, hostname=node, state="allocated", state_flags=[], reason="",
                          reason_set_by_user=None, reason_changed_at=0)  # fmt: skip
            records.append(record)
    return json.dumps({"meta": fixture["meta"], "errors": [], "nodes": records})


def install_fake_slurm(where: Path, jobs: dict[str, list[str]], user: str) -> Path:
    """Executables ``squeue``/``sinfo`` (print the JSON) and no-op admin commands; the bin dir."""
    bin_dir = where / "bin"
    bin_dir.mkdir()
    now = int(time.time())
    for name, text in (("squeue", squeue_json(jobs, user, now)), ("sinfo", sinfo_json(jobs))):
        data = where / f"{name}.json"
        data.write_text(text)
        _executable(bin_dir / name, f"#!/bin/sh\nexec cat {data}\n")
    for name in ("scontrol", "sbatch", "scancel"):
        _executable(bin_dir / name, "#!/bin/sh\nexit 0\n")
    return bin_dir


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def write_jobs(
    jobs_dir: Path, jobs: dict[str, list[str]], ranks_per_node: int, url: str, where: Path,
    rng: random.Random,
) -> list[AgentPlan]:  # fmt: skip
    """Each job's directory as ``resurgo submit`` writes it; one :class:`AgentPlan` per node."""
    user = getpass.getuser()
    now = time.time()
    plans = []
    for job_id, nodes in jobs.items():
        ckpt_root = where / "ckpt" / job_id
        spec = JobSpec(
            name=f"load-{job_id}", nodes=len(nodes), command=("python", "train.py"),
            ckpt_root=str(ckpt_root), procs_per_node=ranks_per_node, supervisor_url=url,
            user=user, submitted_s=now,
        )  # fmt: skip
        directory = write_job_dir(jobs_dir, job_id, spec)
        secret = load_secret(directory / SECRET_NAME).hex()
        step_time_s = rng.uniform(0.5, 2.0)
        start = now - rng.uniform(0, 600)  # jobs have been training for a while
        for node_rank, node in enumerate(nodes):
            plans.append(AgentPlan(job_id, node, node_rank, len(nodes), ranks_per_node, secret,
                                   start, step_time_s, str(ckpt_root)))  # fmt: skip
    return plans


def write_manifest(root: Path, step: int, world_size: int) -> Path:
    """A checkpoint directory holding only its manifest (the supervisor reads its save stats).

    The bytes are :func:`~agent.checkpoint.format.manifest_to_bytes`'s, from a
    template encoded once per world size (512 file entries took the generator
    6 ms to encode, each checkpoint event: 0.5 ms now, with the write); the
    first of each size is compared with the encoder's output, byte for byte.
    """
    directory = root / fmt.step_dir_name(step)
    directory.mkdir(parents=True, exist_ok=True)
    created = time.time()
    template = _MANIFEST_TEMPLATES.get(world_size)
    if template is None:
        template = _MANIFEST_TEMPLATES[world_size] = fmt.manifest_to_bytes(
            _manifest(_STEP_MARK, world_size, _TIME_MARK)
        )
    data = template.replace(b"%d" % _STEP_MARK, b"%d" % step, 1).replace(
        repr(_TIME_MARK).encode(), repr(created).encode(), 1
    )
    if world_size not in _MANIFEST_CHECKED:
        assert data == fmt.manifest_to_bytes(_manifest(step, world_size, created))
        _MANIFEST_CHECKED.add(world_size)
    (directory / fmt.MANIFEST_NAME).write_bytes(data)
    return directory


def _manifest(step: int, world_size: int, created_unix_s: float) -> fmt.Manifest:
    files = tuple(
        fmt.FileEntry(f"__{rank}_0.distcp", 1 << 30, "0" * 32) for rank in range(world_size)
    )
    return fmt.Manifest(
        step=step, world_size=world_size, contents=(fmt.StateKind.MODEL, fmt.StateKind.OPTIMIZER),
        files=files, created_unix_s=created_unix_s,
        stats=fmt.SaveStats(stall_s=2.5, write_s=40.0, total_bytes=world_size << 30,
                            filesystem="lustre", mode="async"),
    )  # fmt: skip


# Marks no real step or time equals, replaced in a manifest template's bytes.
_STEP_MARK = 987_654_321_987
_TIME_MARK = 1234567.890625
_MANIFEST_TEMPLATES: dict[int, bytes] = {}
_MANIFEST_CHECKED: set[int] = set()


# ---------------------------------------------------------------------------
# One load-generator process: many agents on one asyncio loop.


class _Socket:
    """A TCP connection to the supervisor, opened by its user and closed on any failure."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


class Connection(_Socket):
    """One keep-alive HTTP/1.1 connection to the supervisor, as an agent's session keeps.

    The generators' own client: it sends what aiohttp's client sends (request
    line, Host, Content-Type, Content-Length, the signing headers, the body)
    and reads the answer by its Content-Length, for a fraction of aiohttp's CPU
    per request, so that on a small machine the generators leave the CPUs to
    the supervisor they measure (``--client aiohttp`` uses aiohttp instead).
    A request on a reused connection that the server closed meanwhile (idle
    keep-alive timeout) is sent again once on a new one, as aiohttp does.
    """

    async def post(self, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
        """Status and body of the answer to ``POST path``."""
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Content-Type: application/json", f"Content-Length: {len(body)}",
                 *(f"{name}: {value}" for name, value in headers.items())]  # fmt: skip
        request = ("\r\n".join(lines) + "\r\n\r\n").encode() + body
        reused = self.writer is not None
        try:
            return await self._exchange(request)
        except (asyncio.IncompleteReadError, ConnectionError) as error:
            stale = isinstance(error, ConnectionError) or not error.partial
            if not (reused and stale):
                raise
        return await self._exchange(request)

    async def _exchange(self, request: bytes) -> tuple[int, bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        try:
            self.writer.write(request)
            head = await self.reader.readuntil(b"\r\n\r\n")
            status_line, *header_lines = head.decode("latin-1").split("\r\n")
            fields = dict(line.split(":", 1) for line in header_lines if ":" in line)
            fields = {name.strip().lower(): value.strip() for name, value in fields.items()}
            body = await self.reader.readexactly(int(fields.get("content-length", "0")))
            if fields.get("connection", "").lower() == "close":
                self.close()
            return int(status_line.split()[1]), body
        except BaseException:
            self.close()
            raise


class StreamConnection(_Socket):
    """One agent's heartbeat stream: a WebSocket, as the agent's aiohttp session keeps one.

    The generators' own client, for the reason :class:`Connection` gives: it
    sends the signed upgrade request aiohttp sends, then masked binary frames
    (RFC 6455: a fresh random key per frame, as every client must), and reads
    the supervisor's unmasked answers by their length. ``--client aiohttp``
    uses aiohttp's WebSocket client instead.
    """

    def __init__(self, host: str, port: int) -> None:
        super().__init__(host, port)
        self.opened = 0

    async def exchange(self, job_id: str, secret: bytes, frame: bytes) -> bytes:
        """Send one frame (opening the stream first if need be); the answer frame's payload."""
        if self.writer is None:
            await self._open(job_id, secret)
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(_masked_frame(frame))
            head = await self.reader.readexactly(2)
            if head[0] & 0x0F != 0x2:  # anything but a binary frame: a close, most likely
                raise ConnectionError(f"stream answered with opcode {head[0] & 0x0F}")
            length = head[1] & 0x7F
            if length == 126:
                length = int.from_bytes(await self.reader.readexactly(2))
            elif length == 127:
                length = int.from_bytes(await self.reader.readexactly(8))
            return await self.reader.readexactly(length)
        except BaseException:
            self.close()
            raise

    async def _open(self, job_id: str, secret: bytes) -> None:
        path = protocol.HEARTBEAT_STREAM_PATH
        headers = protocol.signed_headers(secret, "GET", path, job_id, int(time.time()), b"")
        key = base64.b64encode(secrets.token_bytes(16)).decode()
        lines = [f"GET {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 "Upgrade: websocket", "Connection: Upgrade", f"Sec-WebSocket-Key: {key}",
                 "Sec-WebSocket-Version: 13",
                 *(f"{name}: {value}" for name, value in headers.items())]  # fmt: skip
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        try:
            self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
            status = int(head.split(" ", 2)[1])
            if status != 101:
                raise Rejected(status, head.split("\r\n", 1)[0])
            self.opened += 1
        except BaseException:
            self.close()
            raise


def _masked_frame(payload: bytes) -> bytes:
    """A final binary client frame holding ``payload``, masked with a fresh random key."""
    size = len(payload)
    if size < 126:
        head = bytes((0x82, 0x80 | size))
    elif size < 1 << 16:
        head = bytes((0x82, 0x80 | 126)) + size.to_bytes(2)
    else:
        head = bytes((0x82, 0x80 | 127)) + size.to_bytes(8)
    key = secrets.token_bytes(4)
    keystream = (key * (size // 4 + 1))[:size]
    masked = (int.from_bytes(payload) ^ int.from_bytes(keystream)).to_bytes(size)
    return head + key + masked


@dataclass
class WorkerStats:
    """What one load generator measured."""

    heartbeat_ms: list[float]
    event_ms: list[float]
    heartbeats_sent: int = 0
    heartbeat_failures: int = 0
    window_heartbeat_failures: int = 0
    streams_opened: int = 0
    event_posts: int = 0
    event_failures: int = 0
    first_failure: str = ""


class SimulatedAgent:
    """A node agent's traffic: heartbeats every second, events resent until acknowledged.

    Heartbeats and events go over separate connections, as they do in the real
    agent (two concurrent requests of one aiohttp session).
    """

    def __init__(
        self,
        plan: AgentPlan,
        url: str,
        client: str,
        rng: random.Random,
        stats: WorkerStats,
        window: tuple[float, float],
        events: bool,
        streaming: bool,
        streams: aiohttp.ClientSession | None,
    ) -> None:
        self.plan = plan
        self.streaming = streaming
        self.url = url
        self.client = client
        self.rng = rng
        self.stats = stats
        self.window = window
        self.secret = bytes.fromhex(plan.secret_hex)
        self.incarnation = secrets.token_hex(8)
        self.seq = 0
        self.pending: collections.deque[protocol.Event] = collections.deque()
        self.sent: list[str] = []
        self.acked: set[str] = set()
        self.wake = asyncio.Event()
        self.emitting = events
        self.session: aiohttp.ClientSession | None = None
        address = urlsplit(url)
        assert address.hostname is not None and address.port is not None
        self.connections = {
            path: Connection(address.hostname, address.port)
            for path in (protocol.HEARTBEAT_PATH, protocol.EVENTS_PATH)
        }
        self.checked_encoding = False
        # With --client aiohttp: the session the streams are opened in.
        self.streams = streams
        self.stream: aiohttp.ClientWebSocketResponse | None = None
        self.lean_stream = StreamConnection(address.hostname, address.port)
        self.ranks_cache: tuple[int, bytes] | None = None  # (step, the ranks' JSON)

    def step(self, now: float) -> int:
        """The job's current step: every rank of a synchronous job is at the same one."""
        return int((now - self.plan.job_start_s) / self.plan.step_time_s)

    def emit(self, kind: EventKind, payload: dict[str, Any]) -> None:
        """Queue an event with the next seq of this incarnation."""
        self.seq += 1
        event = protocol.make_event(kind, self.plan.job_id, self.plan.node, self.incarnation,
                                    self.seq, time.time(), payload)  # fmt: skip
        self.pending.append(event)
        self.sent.append(event.event_id)
        self.wake.set()

    def random_event(self, now: float) -> None:
        """One benign event of a kind drawn from :data:`EVENT_MIX`."""
        kinds, weights = zip(*EVENT_MIX, strict=True)
        kind = self.rng.choices(kinds, weights)[0]
        plan = self.plan
        rank = plan.node_rank * plan.ranks_per_node
        step = self.step(now)
        pace = plan.step_time_s
        if kind is EventKind.STEP_LOSSES:
            count = self.rng.randint(5, 60)
            steps = [{"step": s, "loss": round(2.0 / (1 + s / 1000), 6), "cursor": s * 256}
                     for s in range(max(0, step - count), step)]  # fmt: skip
            payload: dict[str, Any] = {"global_rank": rank, "steps": steps}
        elif kind is EventKind.CHECKPOINT_COMMITTED:
            path = write_manifest(Path(plan.ckpt_root), step, plan.nnodes * plan.ranks_per_node)
            payload = {"step": step, "path": str(path), "global_rank": rank}
        else:
            payload = {
                "global_rank": rank + self.rng.randrange(plan.ranks_per_node), "local_rank": 0,
                "step_time_p50_s": pace * 1.3, "step_time_p99_s": pace * 1.6,
                "step_time_mean_s": pace * 1.35, "steps_observed": 100,
                "node_median_step_time_s": pace,
            }  # fmt: skip
        self.emit(kind, payload)

    def heartbeat_ranks(self, now: float) -> list[dict[str, Any]]:
        """Every local rank's status (RankStatus fields, in wire order), at the job's step."""
        plan = self.plan
        step = self.step(now)
        pace = plan.step_time_s
        return [
            {
                "global_rank": plan.node_rank * plan.ranks_per_node + local,
                "local_rank": local,
                "pid": 10_000 + local,
                "step": step,
                "phase": "train",
                "last_progress_unix_s": plan.job_start_s + step * pace,
                "step_time_p50_s": pace,
                "step_time_p99_s": pace * 1.2,
                "step_time_mean_s": pace * 1.02,
                "steps_observed": 100,
                "compute_p50_s": pace * (0.8 + 0.01 * local),
                "compute_observed": 50,
            }
            for local in range(plan.ranks_per_node)
        ]

    def heartbeat_body(self, now: float) -> bytes:
        """The bytes :func:`agent.wire.protocol.encode_heartbeat` makes of this agent's report.

        Built directly (the protocol's encoder also decodes its output to check
        it, a cost of the agent, not of the supervisor), from the ranks' JSON of
        the current step, made once per step; the first body of each agent is
        compared with the encoder's, byte for byte.
        """
        plan = self.plan
        step = self.step(now)
        if self.ranks_cache is None or self.ranks_cache[0] != step:
            ranks = json.dumps(self.heartbeat_ranks(now), separators=(",", ":"), allow_nan=False)
            self.ranks_cache = (step, ranks.encode())
        body = b"".join((
            b'{"protocol":%d,"type":"heartbeat","job_id":"%s","node":"%s","time_unix_s":%s,'
            % (protocol.PROTOCOL_VERSION, plan.job_id.encode(), plan.node.encode(),
               repr(now).encode()),
            b'"agent_incarnation":"%s","attempt":1,"ranks":%s}'
            % (self.incarnation.encode(), self.ranks_cache[1]),
        ))  # fmt: skip
        if not self.checked_encoding:
            statuses = tuple(RankStatus(**rank) for rank in self.heartbeat_ranks(now))
            report = HeartbeatReport(plan.job_id, plan.node, now, statuses, self.incarnation, 1)
            assert body == protocol.encode_heartbeat(report), "heartbeat encoding differs"
            self.checked_encoding = True
        return body

    async def post(self, path: str, body: bytes, timeout_s: float) -> protocol.Reply:
        """Send a signed request; the decoded reply, or Rejected (not 200) and I/O errors."""
        if self.client == "aiohttp":
            assert self.session is not None
            data = await signed_post(self.session, self.url + path, self.plan.job_id,
                                     self.secret, body, timeout_s=timeout_s)  # fmt: skip
        else:
            headers = protocol.signed_headers(self.secret, protocol.METHOD, path,
                                              self.plan.job_id, int(time.time()), body)  # fmt: skip
            async with asyncio.timeout(timeout_s):
                status, data = await self.connections[path].post(path, headers, body)
            if status != 200:
                raise Rejected(status, data.decode("utf-8", "replace")[:2000])
        return protocol.decode_reply(data)

    def in_window(self, started: float) -> bool:
        return self.window[0] <= started < self.window[1]

    async def run(self, start_at: float, stop_at: float, events_per_s: float) -> None:
        """Heartbeat every second from ``start_at`` (jittered) until ``stop_at``."""
        if self.client == "aiohttp":
            self.session = aiohttp.ClientSession()
        sender = asyncio.create_task(self.send_events())
        try:
            first = start_at + self.rng.random() * HEARTBEAT_PERIOD_S
            await asyncio.sleep(max(0.0, first - time.time()))
            plan = self.plan
            if self.emitting:
                self.emit(EventKind.AGENT_STARTED, {
                    "agent_version": "0.1.0", "pid": 10_000 + plan.node_rank,
                    "argv": ["python", "train.py"], "nnodes": plan.nnodes,
                    "node_rank": plan.node_rank, "attempt": 1,
                })  # fmt: skip
            beat = 0
            while True:
                due = first + beat * HEARTBEAT_PERIOD_S
                if due >= stop_at:
                    break
                await asyncio.sleep(max(0.0, due - time.time()))
                now = time.time()
                if self.emitting and self.rng.random() < events_per_s * HEARTBEAT_PERIOD_S:
                    self.random_event(now)
                await self.heartbeat(now)
                # A heartbeat that took longer than a period skips the missed beats.
                beat = max(beat + 1, math.ceil((time.time() - first) / HEARTBEAT_PERIOD_S))
        finally:
            # The worker lets the sender drain before it ends this task.
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            for connection in self.connections.values():
                connection.close()
            if self.stream is not None:
                await self.stream.close()
            if self.session is not None:
                await self.session.close()

    async def exchange(self, body: bytes) -> protocol.Reply:
        """One heartbeat over this agent's stream (opened first if need be), as the agent does."""
        if self.client == "lean":
            frame = protocol.sign_frame(self.secret, self.plan.job_id, int(time.time()), body)
            data = await self.lean_stream.exchange(self.plan.job_id, self.secret, frame)
            answer = protocol.decode_stream_answer(data)
            if isinstance(answer, Refusal):
                raise Rejected(answer.status, f"{answer.cause}: {answer.reason}")
            return answer
        assert self.streams is not None
        stream = self.stream
        if stream is None or stream.closed:
            path = protocol.HEARTBEAT_STREAM_PATH
            headers = protocol.signed_headers(self.secret, "GET", path, self.plan.job_id,
                                              int(time.time()), b"")  # fmt: skip
            stream = self.stream = await self.streams.ws_connect(
                self.url + path, headers=headers, max_msg_size=protocol.MAX_BODY_BYTES,
                timeout=aiohttp.ClientWSTimeout(ws_close=1.0),
            )  # fmt: skip
            self.stats.streams_opened += 1
        await stream.send_bytes(
            protocol.sign_frame(self.secret, self.plan.job_id, int(time.time()), body)
        )
        message = await stream.receive()
        if message.type is not aiohttp.WSMsgType.BINARY:
            raise ConnectionError(f"stream closed: {message.type.name} {message.extra!r}")
        answer = protocol.decode_stream_answer(message.data)
        if isinstance(answer, Refusal):
            raise Rejected(answer.status, f"{answer.cause}: {answer.reason}")
        return answer

    async def heartbeat(self, now: float) -> None:
        body = self.heartbeat_body(now)
        started = time.time()
        clock = time.perf_counter()
        try:
            if not self.streaming:
                await self.post(protocol.HEARTBEAT_PATH, body, HEARTBEAT_TIMEOUT_S)
            else:
                async with asyncio.timeout(HEARTBEAT_TIMEOUT_S):
                    await self.exchange(body)
        except (aiohttp.ClientError, OSError, TimeoutError, Rejected, ValueError,
                asyncio.IncompleteReadError, protocol.ProtocolError) as error:  # fmt: skip
            if self.stream is not None:
                stream, self.stream = self.stream, None
                await stream.close()
            self.stats.heartbeat_failures += 1
            self.stats.window_heartbeat_failures += self.in_window(started)
            self.stats.first_failure = self.stats.first_failure or f"heartbeat: {error!r}"[:300]
            if self.in_window(started):
                # A request sent and not answered counts in the percentiles, as its timeout.
                self.stats.heartbeat_ms.append(failed_ms(clock, HEARTBEAT_TIMEOUT_S))
            return
        self.stats.heartbeats_sent += 1
        if self.in_window(started):
            self.stats.heartbeat_ms.append((time.perf_counter() - clock) * 1000)

    async def send_events(self) -> None:
        """Deliver pending events in order, in batches; resend after any failure."""
        backoff = 0.5
        while True:
            if not self.pending:
                if not self.emitting:
                    return
                self.wake.clear()
                await self.wake.wait()
                continue
            batch = list(self.pending)[:MAX_BATCH]
            body = protocol.encode_events(batch)
            started = time.time()
            clock = time.perf_counter()
            try:
                reply = await self.post(protocol.EVENTS_PATH, body, EVENT_TIMEOUT_S)
            except (aiohttp.ClientError, OSError, TimeoutError, Rejected, ValueError,
                    asyncio.IncompleteReadError, protocol.ProtocolError) as error:  # fmt: skip
                self.stats.event_failures += 1
                self.stats.first_failure = self.stats.first_failure or f"events: {error!r}"[:300]
                if self.in_window(started):
                    self.stats.event_ms.append(failed_ms(clock, EVENT_TIMEOUT_S))
                await asyncio.sleep(self.rng.uniform(0, backoff))
                backoff = min(backoff * 2, 10.0)
                continue
            backoff = 0.5
            self.stats.event_posts += 1
            if self.in_window(started):
                self.stats.event_ms.append((time.perf_counter() - clock) * 1000)
            accepted = set(reply.accepted_event_ids)
            self.acked.update(accepted & {event.event_id for event in batch})
            while self.pending and self.pending[0].event_id in accepted:
                self.pending.popleft()

    def stop_emitting(self) -> None:
        self.emitting = False
        self.wake.set()


def failed_ms(clock: float, timeout_s: float) -> float:
    """A failed request's latency for the percentiles: its timeout, or longer if it took so."""
    return max((time.perf_counter() - clock) * 1000, timeout_s * 1000)


async def run_worker(config: dict[str, Any], go: dict[str, float]) -> dict[str, Any]:
    """Drive this worker's agents through the start, the window and the drain."""
    stats = WorkerStats(heartbeat_ms=[], event_ms=[])
    rng = random.Random(config["seed"])
    window = (go["measure_from"], go["measure_until"])
    # One session holds every agent's stream (each its own connection).
    streams = None
    if config["heartbeats"] == "stream" and config["client"] == "aiohttp":
        streams = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    agents = [
        SimulatedAgent(AgentPlan(**plan), config["url"], config["client"],
                       random.Random(rng.random()), stats, window, config["events"],
                       config["heartbeats"] == "stream", streams)
        for plan in config["agents"]
    ]  # fmt: skip
    events_per_s = config["events_per_agent_min"] / 60.0
    tasks = [
        asyncio.create_task(agent.run(go["start_at"], go["drain_until"], events_per_s))
        for agent in agents
    ]
    await asyncio.sleep(max(0.0, go["measure_until"] - time.time()))
    # Agents emit until the window ends, then only resend what is unacknowledged;
    # heartbeats go on meanwhile (a real agent keeps beating).
    for agent in agents:
        agent.stop_emitting()
    while time.time() < go["drain_until"] and any(agent.pending for agent in agents):
        await asyncio.sleep(0.2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if streams is not None:
        await streams.close()
    stats.streams_opened += sum(agent.lean_stream.opened for agent in agents)
    return {
        **asdict(stats),
        "heartbeat_ms": [round(value, 3) for value in stats.heartbeat_ms],
        "event_ms": [round(value, 3) for value in stats.event_ms],
        "sent": [event_id for agent in agents for event_id in agent.sent],
        "acked": [event_id for agent in agents for event_id in agent.acked],
    }


def worker_main() -> int:
    """``--worker``: the config on stdin's first line; "ready"; the times; results to a file."""
    config = json.loads(sys.stdin.readline())
    print("ready", flush=True)
    go = json.loads(sys.stdin.readline())
    # uvloop, as the supervisor runs: on a small machine the generators must
    # leave it the CPUs (asyncio costs about twice as much per message).
    result = uvloop.run(run_worker(config, go))
    # A file, not stdout: hundreds of kilobytes through the pipe arrived cut
    # short once uvloop had run in this process.
    Path(config["results"]).write_text(json.dumps(result))
    return 0


# ---------------------------------------------------------------------------
# One run: supervisor, generators, measurements, the store.


def floor_main(port: int) -> int:
    """``--floor-server``: aiohttp answering every POST or frame with an empty Reply, nothing else.

    What serving HTTP or a WebSocket alone costs (aiohttp, the kernel's
    loopback TCP): the floor under the supervisor's own cost per heartbeat.
    """
    from aiohttp import web

    reply = protocol.encode_reply(protocol.Reply())

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    async def stream(request: web.Request) -> web.WebSocketResponse:
        socket = web.WebSocketResponse(compress=False)
        await socket.prepare(request)
        async for _ in socket:
            await socket.send_bytes(reply)
        return socket

    app = web.Application()
    app.router.add_post(protocol.HEARTBEAT_PATH, answer)
    app.router.add_post(protocol.EVENTS_PATH, answer)
    app.router.add_get(protocol.HEARTBEAT_STREAM_PATH, stream)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    return 0


class Supervisor:
    """``python -m supervisor.daemon`` in a temporary state directory, with the fake Slurm.

    With ``floor``, :func:`floor_main` instead: no supervisor, only HTTP.
    """

    def __init__(self, where: Path, bin_dir: Path, port: int, floor: bool = False) -> None:
        self.where = where
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = where / "supervisor.log"
        env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
            "RESURGO_SUPERVISOR_STATE_DIR": str(where / "state"),
            "RESURGO_SUPERVISOR_LISTEN_HOST": "127.0.0.1",
            "RESURGO_SUPERVISOR_LISTEN_PORT": str(port),
            "RESURGO_SUPERVISOR_URL": self.url,
            "RESURGO_SUPERVISOR_LOG_JSON": "no",
        }
        argv = [sys.executable, "-m", "supervisor.daemon"]
        if floor:
            argv = [sys.executable, "-m", "bench.supervisor_load", "--floor-server", str(port)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.ps = psutil.Process(self.process.pid)

    @property
    def store_path(self) -> Path:
        return self.where / "state" / "resurgo.db"

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def log_counts(self) -> dict[str, int]:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return {level: text.count(f" {level} ") for level in ("WARNING", "ERROR")}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


async def wait_registered(url: str, secrets_by_job: dict[str, bytes], timeout_s: float) -> None:
    """Until every job answers ``GET /v1/jobs/<id>`` as started by Slurm (or raise)."""
    deadline = time.monotonic() + timeout_s
    waiting = dict(secrets_by_job)
    async with aiohttp.ClientSession() as session:
        while waiting:
            for job_id, secret in list(waiting.items()):
                path = f"/v1/jobs/{job_id}"
                headers = protocol.signed_headers(secret, "GET", path, job_id, int(time.time()),
                                                  b"")  # fmt: skip
                with contextlib.suppress(aiohttp.ClientError):
                    async with session.get(url + path, headers=headers) as response:
                        if response.status == 200:
                            state = (await response.json())["status"]["state"]
                            if state != "submitted":
                                del waiting[job_id]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(waiting)} jobs not registered after {timeout_s} s")
            await asyncio.sleep(0.25)


async def wait_listening(url: str, timeout_s: float) -> None:
    """Until something answers HTTP at ``url`` (or raise)."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/"):
                    return
            await asyncio.sleep(0.25)
    raise RuntimeError(f"nothing listens at {url} after {timeout_s} s")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def runqueue_wait_s(pid: int) -> float:
    """Seconds the process's threads were runnable but waiting for a CPU (schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[1])
    return total / 1e9


def percentile(values: list[float], share: float) -> float | None:
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_one(agents: int, args: argparse.Namespace) -> dict[str, Any]:
    """One supervisor, ``agents`` simulated agents: the figures of one run."""
    rng = random.Random(args.seed + agents)
    with tempfile.TemporaryDirectory(prefix="resurgo-load-") as tmp:
        where = Path(tmp)
        jobs = {str(FIRST_JOB_ID + i): nodes for i, nodes in enumerate(plan_jobs(agents, rng))}
        bin_dir = install_fake_slurm(where, jobs, getpass.getuser())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        plans = write_jobs(where / "state" / "jobs", jobs, args.ranks_per_node, url, where, rng)
        secrets_by_job = {plan.job_id: bytes.fromhex(plan.secret_hex) for plan in plans}
        supervisor = Supervisor(where, bin_dir, port, floor=args.floor)
        workers: list[subprocess.Popen[str]] = []
        try:
            if args.floor:
                asyncio.run(wait_listening(url, timeout_s=60))
            else:
                asyncio.run(wait_registered(url, secrets_by_job, timeout_s=120))
            per = args.agents_per_worker
            for index in range(0, len(plans), per):
                worker = subprocess.Popen(
                    [sys.executable, "-m", "bench.supervisor_load", "--worker"], cwd=REPO,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                assert worker.stdin is not None and worker.stdout is not None
                config = {
                    "url": url, "seed": rng.random(), "client": args.client,
                    "heartbeats": args.heartbeats,
                    "results": str(where / f"worker-{len(workers)}.json"),
                    "events": not args.floor,
                    "events_per_agent_min": args.events_per_agent_min,
                    "agents": [asdict(plan) for plan in plans[index : index + per]],
                }  # fmt: skip
                worker.stdin.write(json.dumps(config) + "\n")
                worker.stdin.flush()
                workers.append(worker)
            for worker in workers:
                assert worker.stdout is not None
                if worker.stdout.readline().strip() != "ready":
                    raise RuntimeError("a load generator failed to start")
            start_at = time.time() + 0.5
            go = {"start_at": start_at, "measure_from": start_at + args.warmup_s,
                  "measure_until": start_at + args.warmup_s + args.measure_s}  # fmt: skip
            go["drain_until"] = go["measure_until"] + args.drain_s
            for worker in workers:
                assert worker.stdin is not None
                worker.stdin.write(json.dumps(go) + "\n")
                worker.stdin.flush()
            generators = [psutil.Process(worker.pid) for worker in workers]
            cpus = sorted(os.sched_getaffinity(0))
            if args.pin and len(cpus) >= 2:
                # The supervisor alone on one core (its threads too); generators elsewhere.
                for thread in supervisor.ps.threads():
                    os.sched_setaffinity(thread.id, cpus[:1])
                for process in generators:
                    process.cpu_affinity(cpus[1:])
            time.sleep(max(0.0, go["measure_from"] - time.time()))
            profiler = _start_profiler(args.profile, agents, supervisor.process.pid, args)
            before = _sample(supervisor, generators)
            lag_before = {} if args.floor else loop_lag_buckets(url)
            time.sleep(max(0.0, go["measure_until"] - time.time()))
            after = _sample(supervisor, generators)
            lag_after = {} if args.floor else loop_lag_buckets(url)
            rss_mib = supervisor.ps.memory_info().rss / (1 << 20)
            if profiler is not None:
                profiler.wait(timeout=60)
            results = []
            for number, worker in enumerate(workers):
                worker.communicate(timeout=args.drain_s + 120)
                if worker.returncode != 0:
                    raise RuntimeError(f"a load generator failed (exit {worker.returncode})")
                results.append(json.loads((where / f"worker-{number}.json").read_text()))
        except BaseException:
            print(f"bench: supervisor log tail:\n{supervisor.log_tail()}", file=sys.stderr)
            raise
        finally:
            for worker in workers:
                if worker.poll() is None:
                    worker.kill()
                    worker.wait()
            supervisor.stop()
        stored, job_states = (set(), {}) if args.floor else _read_store(supervisor.store_path)
        if args.keep_logs:
            Path(args.keep_logs).mkdir(parents=True, exist_ok=True)
            shutil.copy(supervisor.log_path, Path(args.keep_logs) / f"supervisor-{agents}.log")
            shutil.copy(supervisor.store_path, Path(args.keep_logs) / f"store-{agents}.db")
        logs = supervisor.log_counts()
    figures = _figures(agents, len(jobs), args, before, after, rss_mib, results, stored,
                       job_states, logs)  # fmt: skip
    if lag_after:
        # The supervisor's own delay (its loop held), apart from the generators'
        # scheduling, which the latencies above include on a machine they share.
        figures["supervisor_loop_lag_p50_ms_at_most"] = lag_quantile_ms(lag_before, lag_after, 0.5)
        figures["supervisor_loop_lag_p99_ms_at_most"] = lag_quantile_ms(lag_before, lag_after, 0.99)
        figures["supervisor_loop_lag_max_ms_at_most"] = lag_quantile_ms(lag_before, lag_after, 1.0)
    return figures


def _start_profiler(
    prefix: str | None, agents: int, pid: int, args: argparse.Namespace
) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of the supervisor over the window, as collapsed stacks."""
    if prefix is None:
        return None
    output = f"{prefix}-{agents}.txt"
    beside = Path(sys.executable).parent / "py-spy"
    return subprocess.Popen(
        [str(beside) if beside.exists() else "py-spy", "record", "--pid", str(pid),
         "--duration", str(int(args.measure_s)), "--rate", "100", "--format", "raw",
         "--output", output, "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def loop_lag_buckets(url: str) -> dict[float, float]:
    """The supervisor's loop lag histogram from its /metrics: upper bound -> cumulative count."""
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {
        float(sample.labels["le"]): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "resurgo_supervisor_loop_lag_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }


def lag_quantile_ms(before: dict[float, float], after: dict[float, float], share: float) -> float:
    """The upper bound (ms) of the bucket holding the ``share`` quantile of the window's lags."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts[math.inf] if counts else 0.0
    for bound, count in counts.items():
        if total and count >= share * total:
            return bound * 1000
    return math.nan


def _sample(supervisor: Supervisor, generators: list[psutil.Process]) -> dict[str, float]:
    busy = psutil.cpu_times()
    return {
        "wall": time.monotonic(),
        "supervisor_cpu": cpu_seconds(supervisor.ps),
        "supervisor_system": supervisor.ps.cpu_times().system,
        "supervisor_wait": runqueue_wait_s(supervisor.process.pid),
        "generator_cpu": sum(cpu_seconds(process) for process in generators),
        "machine_busy": busy.user
        + busy.system
        + busy.nice
        + busy.irq
        + busy.softirq
        + getattr(busy, "steal", 0.0),
    }


def _read_store(path: Path) -> tuple[set[str], dict[str, str]]:
    """Agents' event ids in the store, and each job's state."""
    with Store.open(path, create=False) as store:
        stored = {
            row.event_id
            for job in store.list_jobs()
            for row in store.events_for(job.job_id)
            if row.source is EventSource.AGENT
        }
        states = {job.job_id: job.state for job in store.list_jobs()}
    return stored, states


def _figures(
    agents: int, jobs: int, args: argparse.Namespace, before: dict[str, float],
    after: dict[str, float], rss_mib: float, results: list[dict[str, Any]], stored: set[str],
    job_states: dict[str, str], logs: dict[str, int],
) -> dict[str, Any]:  # fmt: skip
    wall = after["wall"] - before["wall"]
    heartbeat_ms = [value for result in results for value in result["heartbeat_ms"]]
    event_ms = [value for result in results for value in result["event_ms"]]
    every_ms = heartbeat_ms + event_ms
    sent = {event_id for result in results for event_id in result["sent"]}
    acked = {event_id for result in results for event_id in result["acked"]}
    supervisor_cores = (after["supervisor_cpu"] - before["supervisor_cpu"]) / wall
    generator_cores = (after["generator_cpu"] - before["generator_cpu"]) / wall
    machine_cores = (after["machine_busy"] - before["machine_busy"]) / wall

    def rounded(value: float | None, digits: int = 2) -> float | None:
        return None if value is None else round(value, digits)

    return {
        "agents": agents,
        "heartbeats": args.heartbeats,
        "jobs": jobs,
        "ranks_per_node": args.ranks_per_node,
        "window_s": round(wall, 1),
        "requests_per_s": round(len(every_ms) / wall, 1),
        "p50_ms": rounded(percentile(every_ms, 0.50)),
        "p99_ms": rounded(percentile(every_ms, 0.99)),
        "max_ms": rounded(max(every_ms, default=None)),
        "heartbeat_p50_ms": rounded(percentile(heartbeat_ms, 0.50)),
        "heartbeat_p99_ms": rounded(percentile(heartbeat_ms, 0.99)),
        "event_p50_ms": rounded(percentile(event_ms, 0.50)),
        "event_p99_ms": rounded(percentile(event_ms, 0.99)),
        "supervisor_cpu_cores": round(supervisor_cores, 3),
        "supervisor_system_cores": round(
            (after["supervisor_system"] - before["supervisor_system"]) / wall, 3
        ),
        "supervisor_cpu_us_per_request": round(
            supervisor_cores / max(len(every_ms), 1) * wall * 1e6
        ),
        "supervisor_rss_mib": round(rss_mib, 1),
        "supervisor_runqueue_wait_share": round(
            (after["supervisor_wait"] - before["supervisor_wait"]) / wall, 3
        ),
        "generator_cpu_cores": round(generator_cores, 3),
        "machine_busy_cores": round(machine_cores, 3),
        "other_cpu_cores": round(max(0.0, machine_cores - supervisor_cores - generator_cores), 3),
        "cpu_count": os.cpu_count(),
        "supervisor_pinned": bool(args.pin and len(os.sched_getaffinity(0)) >= 2),
        "events_sent": len(sent),
        "events_acknowledged": len(acked),
        "lost_events": None if args.floor else len(acked - stored) + len(sent - acked),
        # Acknowledged, yet not in the store: a broken promise of the supervisor.
        "acknowledged_not_stored": None if args.floor else len(acked - stored),
        # Still unacknowledged when the drain ended (a real agent keeps them spooled).
        "never_acknowledged": len(sent - acked),
        "heartbeats_sent": sum(result["heartbeats_sent"] for result in results),
        "heartbeat_failures": sum(result["heartbeat_failures"] for result in results),
        # Of those, in the measured window (the rest: the start, when every
        # agent connects within a second).
        "window_heartbeat_failures": sum(r["window_heartbeat_failures"] for r in results),
        "streams_opened": sum(result["streams_opened"] for result in results),
        "event_post_failures": sum(result["event_failures"] for result in results),
        "first_failure": next((r["first_failure"] for r in results if r["first_failure"]), ""),
        "jobs_not_running": sum(1 for state in job_states.values() if state != "running"),
        "supervisor_log_warnings": logs["WARNING"],
        "supervisor_log_errors": logs["ERROR"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[SIZES[-1]],
                        help="simulated agents (several: one run each)")  # fmt: skip
    parser.add_argument("--all", action="store_true", help=f"one run each for {SIZES}")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--events-per-agent-min", type=float, default=1.0)
    parser.add_argument("--agents-per-worker", type=int, default=1024)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--measure-s", type=float, default=30.0)
    parser.add_argument("--drain-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--client", choices=("lean", "aiohttp"), default="lean",
                        help="the generators' client (Connection, StreamConnection)")  # fmt: skip
    parser.add_argument("--heartbeats", choices=("stream", "post"), default="stream",
                        help="heartbeats on one WebSocket per agent, or a POST each")  # fmt: skip
    parser.add_argument(
        "--profile",
        metavar="PREFIX",
        help="py-spy record the supervisor over the window into PREFIX-<N>.txt",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="run the supervisor on the first CPU only and the generators on the others",
    )
    parser.add_argument(
        "--keep-logs", metavar="DIR", help="copy the supervisor's log and store into DIR"
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="heartbeats only, to a bare aiohttp server instead of the supervisor",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--floor-server", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker_main()
    if args.floor_server is not None:
        return floor_main(args.floor_server)
    sizes = list(SIZES) if args.all else args.agents
    runs = []
    for agents in sizes:
        run = run_one(agents, args)
        print(json.dumps(run), flush=True)
        runs.append(run)
    if len(runs) == 1:
        print(json.dumps(runs[0]))
    else:
        largest = max(runs, key=lambda run: run["agents"])
        print(json.dumps({**largest, "runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
