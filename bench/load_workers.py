"""One supervisor load-generator process: many simulated node agents on one asyncio loop.

Started by ``python -m bench.supervisor_load --worker`` (:func:`worker_main`): the
config on stdin's first line, then the times; the measurements go to a file.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import random
import secrets
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import uvloop

from agent.wire import protocol
from agent.wire.auth import Rejected, signed_post
from agent.wire.protocol import EventKind, HeartbeatReport, RankStatus, Refusal
from bench.load_clients import Connection, StreamConnection
from bench.load_cluster import AgentPlan, write_manifest

HEARTBEAT_PERIOD_S = 1.0
HEARTBEAT_TIMEOUT_S = 2.0  # agent.node.client.DEFAULT_HEARTBEAT_TIMEOUT_S
FORWARD_TIMEOUT_S = 5.0  # agent.driver.aggregator.FORWARD_TIMEOUT_S
# A node's whole heartbeat goes again every this many periods (agent.driver.aggregator.REFRESH_S).
REFRESH_PERIODS = 30
EVENT_TIMEOUT_S = 5.0
MAX_BATCH = 100
# The kinds an agent emits at random, and how often each (weights).
EVENT_MIX = ((EventKind.STEP_LOSSES, 6), (EventKind.CHECKPOINT_COMMITTED, 3),
             (EventKind.STRAGGLER, 1))  # fmt: skip


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
        # Only the first node's agent reports its job's checkpoints (as global rank 0's
        # does): set for aggregated runs, whose jobs reach 2,048 nodes.
        self.commits_on_rank_0_only = False
        # In an aggregated run: the job's aggregator relays this agent's batches.
        self.relay: SimulatedAggregator | None = None

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
        mix = EVENT_MIX
        if self.commits_on_rank_0_only and self.plan.node_rank != 0:
            mix = tuple(item for item in EVENT_MIX if item[0] is not EventKind.CHECKPOINT_COMMITTED)
        kinds, weights = zip(*mix, strict=True)
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

    def started(self) -> None:
        """The agent's first event, ``agent_started`` (attempt 1)."""
        plan = self.plan
        if self.emitting:
            self.emit(EventKind.AGENT_STARTED, {
                "agent_version": "0.1.0", "pid": 10_000 + plan.node_rank,
                "argv": ["python", "train.py"], "nnodes": plan.nnodes,
                "node_rank": plan.node_rank, "attempt": 1,
            })  # fmt: skip

    def maybe_event(self, now: float, events_per_s: float) -> None:
        """One random event with the chance of ``events_per_s`` in a period, while emitting."""
        if self.emitting and self.rng.random() < events_per_s * HEARTBEAT_PERIOD_S:
            self.random_event(now)

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
            self.started()
            async for now, _ in every_period(first, stop_at):
                self.maybe_event(now, events_per_s)
                await self.heartbeat(now)
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
                if self.relay is not None:
                    reply = await self.relay.relay(batch)
                else:
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


class SimulatedAggregator:
    """A job's aggregator (``agent/driver/aggregator.py``), as the supervisor sees it: one
    frame a second for the whole job on its stream (``/v1/job/heartbeats/stream``).

    Each request holds a beat for every node (all at the job's step) and the whole
    heartbeats the real aggregator would send: every node's at its first forward
    and then each node's every :data:`REFRESH_PERIODS` periods (its compute times
    move), at most :data:`~agent.wire.protocol.MAX_JOB_REPORTS` a request. The
    job's agents' event batches (all of kinds the real relay takes) go through it
    as through :class:`agent.driver.eventrelay.EventRelay`: the batches that came
    while its previous request was answered go in one signed ``POST /v1/events``,
    and each agent gets its own acknowledgements; an agent's batch timed is from
    its handing to the relay to its answer. Only the first node's agent reports
    the job's checkpoints.
    """

    def __init__(
        self,
        agents: list[SimulatedAgent],
        url: str,
        rng: random.Random,
        stats: WorkerStats,
        window: tuple[float, float],
        start_spread_s: float,
    ) -> None:
        self.agents = agents
        self.start_spread_s = max(start_spread_s, HEARTBEAT_PERIOD_S)
        for agent in agents:
            agent.commits_on_rank_0_only = True
        self.plan = agents[0].plan
        self.secret = bytes.fromhex(self.plan.secret_hex)
        self.rng = rng
        self.stats = stats
        self.window = window
        address = urlsplit(url)
        assert address.hostname is not None and address.port is not None
        self.stream = StreamConnection(
            address.hostname, address.port, protocol.JOB_HEARTBEATS_STREAM_PATH
        )
        self.checked_encoding = False
        self.beats_sent = 0
        self.relay_connection = Connection(address.hostname, address.port)
        self.relay_waiting: list[tuple[list[protocol.Event], asyncio.Future[protocol.Reply]]] = []
        self.relay_wake = asyncio.Event()
        for agent in agents:
            agent.relay = self

    async def relay(self, batch: list[protocol.Event]) -> protocol.Reply:
        """An agent's batch, answered once the supervisor answered the request it went in."""
        assert all(event.kind in protocol.RELAYED_KINDS for event in batch)
        answer: asyncio.Future[protocol.Reply] = asyncio.get_running_loop().create_future()
        self.relay_waiting.append((batch, answer))
        self.relay_wake.set()
        return await answer

    async def relay_forever(self) -> None:
        while True:
            await self.relay_wake.wait()
            self.relay_wake.clear()
            while self.relay_waiting:
                group, count = [], 0
                for batch, answer in self.relay_waiting:
                    if group and count + len(batch) > protocol.MAX_EVENTS_PER_BATCH:
                        break
                    group.append((batch, answer))
                    count += len(batch)
                del self.relay_waiting[: len(group)]
                await self.relay_group(group)

    async def relay_group(
        self, group: list[tuple[list[protocol.Event], asyncio.Future[protocol.Reply]]]
    ) -> None:
        body = protocol.encode_events([event for batch, _ in group for event in batch])
        path = protocol.EVENTS_PATH
        headers = protocol.signed_headers(self.secret, protocol.METHOD, path,
                                          self.plan.job_id, int(time.time()), body)  # fmt: skip
        try:
            async with asyncio.timeout(EVENT_TIMEOUT_S):
                status, data = await self.relay_connection.post(path, headers, body)
            if status != 200:
                raise Rejected(status, data.decode("utf-8", "replace")[:2000])
            reply = protocol.decode_reply(data)
        except (aiohttp.ClientError, OSError, TimeoutError, Rejected, ValueError,
                asyncio.IncompleteReadError, protocol.ProtocolError) as error:  # fmt: skip
            # The real relay answers 503 and the agent sends straight to the supervisor;
            # here the agent sends its batch to the relay again after its backoff.
            for _, answer in group:
                if not answer.done():
                    answer.set_exception(error)
            return
        accepted = set(reply.accepted_event_ids)
        for batch, answer in group:
            own = tuple(event.event_id for event in batch if event.event_id in accepted)
            if not answer.done():
                answer.set_result(protocol.Reply(accepted_event_ids=own))

    def body(self, now: float, period: int) -> bytes:
        """The request's body, as :func:`agent.wire.protocol.encode_job_heartbeats` makes it."""
        step = self.agents[0].step(now)
        when = repr(now).encode()
        beats = b",".join(
            b'["%s","%s",1,%s,%d]' % (agent.plan.node.encode(), agent.incarnation.encode(), when,
                                      step)
            for agent in self.agents
        )  # fmt: skip
        due = [
            agent.heartbeat_body(now)
            for index, agent in enumerate(self.agents)
            if period == 0 or (index + period) % REFRESH_PERIODS == 0
        ][: protocol.MAX_JOB_REPORTS]
        body = b'{"protocol":%d,"type":"job_heartbeats","job_id":"%s","time_unix_s":%s,' % (
            protocol.PROTOCOL_VERSION,
            self.plan.job_id.encode(),
            when,
        ) + b'"beats":[%s],"reports":[%s]}' % (beats, b",".join(due))
        if not self.checked_encoding:
            batch = protocol.decode_job_heartbeats(body)
            assert protocol.decode_job_heartbeats(protocol.encode_job_heartbeats(batch)) == batch
            self.checked_encoding = True
        self.beats_sent += len(self.agents)
        return body

    async def run(self, start_at: float, stop_at: float, events_per_s: float) -> None:
        """Forward every second from ``start_at`` (jittered) until ``stop_at``; each agent
        draws its events in the same ticks."""
        senders = [asyncio.create_task(agent.send_events()) for agent in self.agents]
        senders.append(asyncio.create_task(self.relay_forever()))
        try:
            # Jobs start one after another, not all in one second: each job's agents
            # announce themselves at its start (agent_started), then it forwards.
            first = start_at + self.rng.random() * self.start_spread_s
            await asyncio.sleep(max(0.0, first - time.time()))
            for agent in self.agents:
                agent.started()
            async for now, period in every_period(first, stop_at):
                for agent in self.agents:
                    agent.maybe_event(now, events_per_s)
                await self.forward(now, period)
        finally:
            for sender in senders:
                sender.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
            self.stream.close()
            self.relay_connection.close()
            for agent in self.agents:
                for connection in agent.connections.values():
                    connection.close()

    async def forward(self, now: float, period: int) -> None:
        body = self.body(now, period)
        path = protocol.JOB_HEARTBEATS_STREAM_PATH
        started = time.time()
        clock = time.perf_counter()
        in_window = self.window[0] <= started < self.window[1]
        try:
            frame = protocol.sign_frame(self.secret, self.plan.job_id, int(started), body, path)
            async with asyncio.timeout(FORWARD_TIMEOUT_S):
                data = await self.stream.exchange(self.plan.job_id, self.secret, frame)
            answer = protocol.decode_job_stream_answer(data)
            if isinstance(answer, Refusal):
                raise Rejected(answer.status, f"{answer.cause}: {answer.reason}")
        except (aiohttp.ClientError, OSError, TimeoutError, Rejected, ValueError,
                asyncio.IncompleteReadError, protocol.ProtocolError) as error:  # fmt: skip
            self.stats.heartbeat_failures += 1
            self.stats.window_heartbeat_failures += in_window
            self.stats.first_failure = self.stats.first_failure or f"job beats: {error!r}"[:300]
            if in_window:
                self.stats.heartbeat_ms.append(failed_ms(clock, FORWARD_TIMEOUT_S))
            return
        self.stats.heartbeats_sent += 1
        if in_window:
            self.stats.heartbeat_ms.append((time.perf_counter() - clock) * 1000)

    @property
    def streams_opened(self) -> int:
        return self.stream.opened


async def every_period(first: float, stop_at: float) -> AsyncIterator[tuple[float, int]]:
    """``(now, period)`` once a :data:`HEARTBEAT_PERIOD_S` from ``first`` until ``stop_at``;
    a period whose work took longer than a period skips the periods it missed."""
    period = 0
    while True:
        due = first + period * HEARTBEAT_PERIOD_S
        if due >= stop_at:
            return
        await asyncio.sleep(max(0.0, due - time.time()))
        yield time.time(), period
        period = max(period + 1, math.ceil((time.time() - first) / HEARTBEAT_PERIOD_S))


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
    if config.get("aggregated"):
        by_job: dict[str, list[SimulatedAgent]] = collections.defaultdict(list)
        for agent in agents:
            by_job[agent.plan.job_id].append(agent)
        runners: list[SimulatedAgent | SimulatedAggregator] = [
            SimulatedAggregator(
                members,
                config["url"],
                random.Random(rng.random()),
                stats,
                window,
                config["start_spread_s"],
            )
            for members in by_job.values()
        ]
    else:
        runners = list(agents)
    tasks = [
        asyncio.create_task(runner.run(go["start_at"], go["drain_until"], events_per_s))
        for runner in runners
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
    beats = sum(r.beats_sent for r in runners if isinstance(r, SimulatedAggregator))
    stats.streams_opened += sum(
        r.streams_opened for r in runners if isinstance(r, SimulatedAggregator)
    )
    return {
        **asdict(stats),
        "beats_forwarded": beats,
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
