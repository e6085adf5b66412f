"""The job's aggregator: its agents' heartbeats in, one request a period to the supervisor.

Every node agent sends a heartbeat every few seconds. On a cluster of
thousands of nodes, one supervisor answering each of them pays for a signed
frame, its decoding and its answer per node per period, and that cost grows
with the nodes. The aggregator runs inside the job, in the in-job driver's
process on the batch host, and serves its agents the supervisor's own
heartbeat stream (:data:`~agent.wire.protocol.HEARTBEAT_STREAM_PATH`: a signed
upgrade, one signed frame per heartbeat, each answered), so an agent tells
the two apart by URL alone. Every ``period_s`` it forwards what it heard in
one signed frame of its own stream to the supervisor
(:data:`~agent.wire.protocol.JOB_HEARTBEATS_STREAM_PATH`; a ``POST`` of
:data:`~agent.wire.protocol.JOB_HEARTBEATS_PATH` where the supervisor has no
stream; :mod:`agent.wire.protocol.jobbeats`):

- a beat for every node heard since the last forward (its lease and step);
- the whole report of each node whose ranks changed in anything but their
  counters (pid, phase, whether a step is known, the compute time by 10% or
  more, the steps behind it past a power of two: :func:`shape_of`), and of
  each node whose whole report went out ``refresh_s`` ago or more, at most
  :data:`~agent.wire.protocol.MAX_JOB_REPORTS` a request, changes first.

The supervisor's answer lists each agent's commands; each goes back with the
answer to that agent's next heartbeat (or to its next event batch). The same
listener relays the agents' routine event batches (:mod:`agent.driver.eventrelay`);
a rank's death or a hang report goes straight from its agent to the
supervisor, as fast as without an aggregator.

The stream is as guarded as the supervisor's: an upgrade must be signed with
the job's secret inside the replay window (else 401), every frame is
verified, and a heartbeat about another job or a node outside the job's
allocation is refused, so nobody without the secret makes a node look alive.
If the aggregator dies (its batch host lost), the agents' heartbeats go
straight to the supervisor again (:class:`agent.node.client.Reporter`). So
they do when it lives but cannot reach the supervisor: after
:data:`CUT_OFF_S` of failed forwards it refuses their heartbeats (503,
``aggregator_cut_off``), and they come back once it reaches it again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections.abc import Callable, Collection

import aiohttp
from aiohttp import WSMsgType, web

from agent.driver.eventrelay import EventRelay, check_signed
from agent.wire import protocol
from agent.wire.auth import Rejected
from agent.wire.errors import describe
from agent.wire.periodic import every
from agent.wire.protocol import (
    AuthError,
    Command,
    HeartbeatReport,
    JobHeartbeats,
    ProtocolError,
    RankStatus,
    Refusal,
    Reply,
)
from agent.wire.streamline import JOB_HEARTBEATS, StreamLine

log = logging.getLogger(__name__)

# How often the job's heartbeats go to the supervisor.
PERIOD_S = 1.0
# A node's whole report goes again at least this often (its compute times move every step).
REFRESH_S = 30.0
# How long one forward may take before the next period's goes instead.
FORWARD_TIMEOUT_S = 5.0
# Forwards failing for this long cut the aggregator off: it refuses its agents'
# heartbeats, and they report straight to the supervisor until it takes them again
# (a batch host cut off from the supervisor must not make the job's nodes look lost;
# a supervisor slow within the forward timeout does not cut it off).
CUT_OFF_S = FORWARD_TIMEOUT_S
# A failing forward is logged again after this long.
_LOG_AGAIN_S = 60.0
# A stream whose agent went away without closing it is noticed by an unanswered ping.
_STREAM_PING_S = 60.0

# Compute times differing by less than this factor are the same for the shape.
_COMPUTE_RESOLUTION = math.log(1.1)

_Rank = tuple[int, int, int, str | None, bool, int, int | None]
_Shape = tuple[str, int | None, tuple[_Rank, ...]]


def shape_of(report: HeartbeatReport) -> _Shape:
    """What of a node's report the supervisor must hear at once when it changes: the
    agent, its launch, and each rank's identity, phase, whether it has a step, and its
    compute time to 10% (a straggler's rise) with the steps behind it in powers of two
    (a median of 2 steps, then of 4, 8, ...: the supervisor compares ranks once enough
    steps are behind their medians)."""
    return (
        report.agent_incarnation,
        report.attempt,
        tuple(_rank_shape(rank) for rank in report.ranks),
    )


def _rank_shape(rank: RankStatus) -> _Rank:
    compute = rank.compute_p50_s
    return (
        rank.global_rank,
        rank.local_rank,
        rank.pid,
        rank.phase,
        rank.step is None,
        rank.compute_observed.bit_length(),
        None if not compute else round(math.log(compute) / _COMPUTE_RESOLUTION),
    )


def due_reports(
    newest: dict[str, HeartbeatReport],
    sent: dict[str, tuple[_Shape, float]],
    now: float,
    refresh_s: float,
    limit: int = protocol.MAX_JOB_REPORTS,
) -> tuple[HeartbeatReport, ...]:
    """The whole reports to forward now: changed ones first, then the oldest due again."""
    changed: list[HeartbeatReport] = []
    stale: list[tuple[float, HeartbeatReport]] = []
    for node, report in newest.items():
        last = sent.get(node)
        if last is None or last[0] != shape_of(report):
            changed.append(report)
        elif now - last[1] >= refresh_s:
            stale.append((last[1], report))
    stale.sort(key=lambda item: item[0])
    return tuple([*changed, *(report for _, report in stale)][:limit])


class Aggregator:
    """One job's aggregator; :meth:`start` it inside a running event loop, then :meth:`close`."""

    def __init__(
        self,
        job_id: str,
        secret: bytes,
        supervisor_url: str,
        nodes: Collection[str],
        *,
        period_s: float = PERIOD_S,
        refresh_s: float = REFRESH_S,
        clock: Callable[[], float] = time.time,
        window_s: int = protocol.REPLAY_WINDOW_S,
    ) -> None:
        self.job_id = job_id
        self._secret = secret
        self._line = StreamLine(
            JOB_HEARTBEATS, supervisor_url, "the supervisor", job_id, secret, clock=clock
        )
        self._nodes = frozenset(nodes)
        self._period_s = period_s
        self._refresh_s = refresh_s
        self._clock = clock
        self._window_s = window_s
        self._newest: dict[str, HeartbeatReport] = {}
        self._sent: dict[str, tuple[_Shape, float]] = {}
        self._commands: dict[tuple[str, str], list[Command]] = {}
        self._streams: set[web.WebSocketResponse] = set()
        self._runner: web.AppRunner | None = None
        self._forwarder: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._failing_since: float | None = None
        self._logged_failure_s = 0.0
        self.relay = EventRelay(
            job_id, secret, supervisor_url, self._nodes, self._commands_held,
            clock=clock, window_s=window_s, cut_off=self._cut_off,
        )  # fmt: skip
        self.url = ""
        self.forwarded = 0  # requests the supervisor took
        self.heartbeats_taken = 0

    async def start(self, session: aiohttp.ClientSession, host: str) -> str:
        """Listen on ``host`` (a port the OS picks), start forwarding; the agents' URL."""
        app = web.Application(client_max_size=protocol.MAX_BODY_BYTES)
        app.router.add_get(protocol.HEARTBEAT_STREAM_PATH, self._stream)
        self.relay.attach(app)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        listener = socket.create_server((host, 0), family=_family(host), reuse_port=False)
        try:
            await web.SockSite(runner, listener).start()
        except BaseException:
            listener.close()
            await runner.cleanup()
            raise
        self._runner = runner
        self._session = session
        port = listener.getsockname()[1]
        self.url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        self._forwarder = asyncio.create_task(
            every(self._period_s, self.forward, log, "aggregator")
        )
        self.relay.start(session)
        return self.url

    async def close(self) -> None:
        """Stop forwarding and serving; the agents' next heartbeats go to the supervisor."""
        if self._forwarder is not None:
            self._forwarder.cancel()
            await asyncio.gather(self._forwarder, return_exceptions=True)
        await self.relay.close()
        await asyncio.gather(
            *(stream.close(message=b"the job's aggregator stopped") for stream in self._streams),
            return_exceptions=True,
        )
        if self._runner is not None:
            await self._runner.cleanup()
        await self._line.drop()

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        """One agent's heartbeat stream: a signed upgrade, then each frame answered."""
        self._check_upgrade(request)
        stream = web.WebSocketResponse(
            heartbeat=_STREAM_PING_S,
            max_msg_size=protocol.MAX_BODY_BYTES,
            compress=False,
        )
        await stream.prepare(request)
        self._streams.add(stream)
        try:
            async for message in stream:
                if message.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                    break
                data = message.data
                await stream.send_bytes(self.answer(data if type(data) is bytes else data.encode()))
        except ConnectionResetError:
            log.debug("an agent left its heartbeat stream before its answer")
        finally:
            self._streams.discard(stream)
        return stream

    def _check_upgrade(self, request: web.Request) -> None:
        """Refuse an upgrade not signed with the job's secret inside the replay window."""
        check_signed(request, b"", self.job_id, self._secret, self._clock, self._window_s)

    def answer(self, frame: bytes) -> bytes:
        """One frame's answer: the agent's commands, or the refusal that says why not."""
        try:
            body = protocol.open_frame(
                self._secret, self.job_id, frame, int(self._clock()), self._window_s
            )
            report = protocol.decode_heartbeat(body)
        except AuthError as error:
            return _refusal(401, "bad_signature", str(error))
        except ProtocolError as error:
            return _refusal(400, "malformed", str(error))
        if report.job_id != self.job_id:
            return _refusal(403, "cross_job", f"this aggregator is job {self.job_id}'s only")
        if report.node not in self._nodes:
            return _refusal(
                403, "foreign_node", f"node {report.node!r} is not in job {self.job_id}"
            )
        newest = self._newest.get(report.node)
        if newest is None or report.time_unix_s >= newest.time_unix_s:
            # Kept even when refused below: the next forward tries the supervisor again.
            self._newest[report.node] = report
        why = self._cut_off()
        if why is not None:
            return _refusal(503, "aggregator_cut_off", f"{why}: report to the supervisor")
        self.heartbeats_taken += 1
        commands = self._commands_held(report.node, report.agent_incarnation)
        return protocol.encode_reply(Reply(commands=tuple(commands)))

    def _commands_held(self, node: str, incarnation: str) -> list[Command]:
        """The commands held for an agent, handed over once."""
        return self._commands.pop((node, incarnation), [])

    def _cut_off(self) -> str | None:
        """Why the agents must report to the supervisor themselves now; None: they need not."""
        failing_s = self.failing_s()
        if failing_s > CUT_OFF_S:
            return f"the job's aggregator has not reached the supervisor for {failing_s:.0f} s"
        return None

    async def forward(self) -> None:
        """Send what was heard since the last forward: beats, and the whole reports due."""
        if not self._newest or self._session is None:
            return
        newest, self._newest = self._newest, {}
        now = self._clock()
        reports = due_reports(newest, self._sent, now, self._refresh_s)
        batch = JobHeartbeats(
            self.job_id, now, tuple(protocol.beat_of(r) for r in newest.values()), reports
        )
        body = protocol.encode_job_heartbeats(batch)
        try:
            async with asyncio.timeout(FORWARD_TIMEOUT_S):
                agents = await self._line.send(self._session, body, FORWARD_TIMEOUT_S)
        except Rejected as error:
            self._note_failure(error, now)
            return
        except (aiohttp.ClientError, TimeoutError, ConnectionError, ProtocolError) as error:
            await self._line.drop()
            self._note_failure(error, now)
            return
        if self._failing_since is not None:
            log.info("the supervisor takes the job's heartbeats again")
            self._failing_since = None
        self.forwarded += 1
        for report in reports:
            self._sent[report.node] = (shape_of(report), now)
        for agent in agents:
            key = (agent.node, agent.agent_incarnation)
            held = self._commands.setdefault(key, [])
            held.extend(agent.commands)
            del held[: -protocol.MAX_COMMANDS]
        self._forget_old_agents(newest)

    def failing_s(self) -> float:
        """How long every forward has failed (0 while they succeed)."""
        since = self._failing_since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    def _forget_old_agents(self, newest: dict[str, HeartbeatReport]) -> None:
        """Drop commands held for an agent its node's newer agent replaced."""
        current = {(node, report.agent_incarnation) for node, report in newest.items()}
        for key in [k for k in self._commands if k[0] in newest and k not in current]:
            del self._commands[key]

    def _note_failure(self, error: BaseException, now: float) -> None:
        if self._failing_since is None:
            self._failing_since = now
        elif now - self._logged_failure_s < _LOG_AGAIN_S:
            return
        self._logged_failure_s = now
        log.warning(
            "the supervisor did not take the job's heartbeats (%s) for %.0f s; "
            "retrying every %.0f s",
            describe(error),
            now - self._failing_since,
            self._period_s,
        )


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _refusal(status: int, cause: str, reason: str) -> bytes:
    return protocol.encode_refusal(Refusal(status, cause, protocol.clip_text(reason, 500)))
