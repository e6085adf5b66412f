"""The job's event relay: its agents' routine event batches in, one request for them all out.

A node agent's events are spooled and acknowledged end to end
(:class:`agent.node.client.Reporter`). On a cluster of thousands of nodes the
supervisor would pay a signed request, a check and a durable commit for each
agent's batch. In a job with an aggregator the agents post their routine
batches (:data:`~agent.wire.protocol.RELAYED_KINDS`: step reports,
checkpoints, stragglers, a start) to the aggregator's ``/v1/events`` instead.
The relay checks each as the supervisor would (signed with the job's secret
inside the replay window, this job's, from a node of its allocation), and
sends every batch that arrived while its previous request was answered as
one signed ``POST /v1/events`` to the supervisor: the batches queue for at
most one supervisor round trip, and the supervisor stores them in one take.
Each agent's answer lists the ids of its own events the supervisor accepted
(and the commands held for it), so an event leaves an agent's spool only
once the supervisor has it.

Events that start or end a recovery (a rank's exit, a hang, a failed health
check, ranks stopped) never come here: an agent sends them straight to the
supervisor, so detection is as fast as without an aggregator. Nothing is
kept here: when the supervisor cannot be reached (or refuses the request
for a reason of the whole job, its event budget) every waiting agent is
answered so, with 503 or the supervisor's own status, and sends its batch
straight to the supervisor itself. A request refused for one batch's
content (400, 403) is split, each batch sent alone, so one agent's bad batch
never holds back another's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from agent.wire import protocol
from agent.wire.auth import Rejected, signed_post
from agent.wire.errors import describe
from agent.wire.protocol import AuthError, Command, Event, ProtocolError, Reply

log = logging.getLogger(__name__)

# One relayed request may take this long; the agents' own timeout is 5 s.
FORWARD_TIMEOUT_S = 4.0
# Room left in a request's body for its envelope.
_ENVELOPE_BYTES = 4096


@dataclass
class _Waiting:
    """One agent's batch and its answer, once the supervisor gave it."""

    events: tuple[Event, ...]
    size: int
    answer: asyncio.Future[web.Response] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class EventRelay:
    """One job's event relay, served on the aggregator's listener (see the module docstring)."""

    def __init__(
        self,
        job_id: str,
        secret: bytes,
        supervisor_url: str,
        nodes: Collection[str],
        commands_for: Callable[[str, str], Sequence[Command]],
        *,
        clock: Callable[[], float] = time.time,
        window_s: int = protocol.REPLAY_WINDOW_S,
        cut_off: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.job_id = job_id
        self._secret = secret
        self._url = supervisor_url.rstrip("/") + protocol.EVENTS_PATH
        self._nodes = frozenset(nodes)
        self._commands_for = commands_for
        self._clock = clock
        self._window_s = window_s
        self._cut_off = cut_off
        self._session: aiohttp.ClientSession | None = None
        self._waiting: list[_Waiting] = []
        self._wake = asyncio.Event()
        self._sender: asyncio.Task[None] | None = None
        self._closed = False
        self.batches_relayed = 0  # agents' batches the supervisor answered
        self.requests_sent = 0

    def attach(self, app: web.Application) -> None:
        """Serve ``POST /v1/events`` on ``app``."""
        app.router.add_post(protocol.EVENTS_PATH, self._take)

    def start(self, session: aiohttp.ClientSession) -> None:
        """Start sending (inside a running loop)."""
        self._session = session
        self._sender = asyncio.create_task(self._send_forever(), name="resurgo-event-relay")

    async def close(self) -> None:
        """Stop sending; waiting agents (and any that come now) are told to send to the
        supervisor, so no request waits on the listener's shutdown."""
        self._closed = True
        if self._sender is not None:
            self._sender.cancel()
            await asyncio.gather(self._sender, return_exceptions=True)
        self._answer_all(self._waiting, _unreachable("the job's aggregator stopped"))
        self._waiting = []

    async def _take(self, request: web.Request) -> web.Response:
        """An agent's batch: checked, queued, answered once the supervisor answered it."""
        body = await request.read()
        check_signed(request, body, self.job_id, self._secret, self._clock, self._window_s)
        try:
            events = protocol.decode_events(body)
        except ProtocolError as error:
            raise refused(web.HTTPBadRequest, str(error)) from None
        for event in events:
            if event.job_id != self.job_id:
                raise refused(web.HTTPForbidden, f"this aggregator is job {self.job_id}'s only")
            if event.node not in self._nodes:
                raise refused(web.HTTPForbidden, f"node {event.node!r} is not in job {self.job_id}")
            if event.kind not in protocol.RELAYED_KINDS:
                raise refused(
                    web.HTTPBadRequest,
                    f"a {event.kind.value} event goes straight to the supervisor",
                )
        why = "the job's aggregator stopped" if self._closed else self._cut_off()
        if why is not None:
            return _unreachable(why)
        waiting = _Waiting(events, len(body))
        self._waiting.append(waiting)
        self._wake.set()
        return await waiting.answer

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                group = self._next_group()
                await self._relay(group, split_on_refusal=len(group) > 1)

    def _next_group(self) -> list[_Waiting]:
        """The oldest waiting batches that fit one request."""
        group: list[_Waiting] = []
        count = size = 0
        for waiting in self._waiting:
            count += len(waiting.events)
            size += waiting.size
            if group and (
                count > protocol.MAX_EVENTS_PER_BATCH
                or size > protocol.MAX_BODY_BYTES - _ENVELOPE_BYTES
            ):
                break
            group.append(waiting)
        del self._waiting[: len(group)]
        return group

    async def _relay(self, group: list[_Waiting], split_on_refusal: bool) -> None:
        """Send ``group``'s events in one request and answer each of its agents."""
        group = [waiting for waiting in group if not waiting.answer.done()]
        if not group or self._session is None:
            self._answer_all(group, _unreachable("the job's aggregator is not sending"))
            return
        body = protocol.encode_events([event for waiting in group for event in waiting.events])
        try:
            async with asyncio.timeout(FORWARD_TIMEOUT_S):
                data = await signed_post(
                    self._session, self._url, self.job_id, self._secret, body,
                    timeout_s=FORWARD_TIMEOUT_S, clock=self._clock,
                )  # fmt: skip
            reply = protocol.decode_reply(data)
        except Rejected as error:
            if split_on_refusal and error.status in (400, 403):
                for waiting in group:  # one agent's batch must not hold back the others
                    await self._relay([waiting], split_on_refusal=False)
                return
            if error.status >= 500:
                self._answer_all(group, _unreachable(f"the supervisor answered {error.status}"))
            else:
                self._answer_all(group, _passed_on(error))
            return
        except (aiohttp.ClientError, TimeoutError, ConnectionError, ProtocolError) as error:
            log.warning("the supervisor did not take %d agent(s)' events (%s): they send "
                        "them straight to it", len(group), describe(error))  # fmt: skip
            self._answer_all(group, _unreachable(f"the supervisor did not answer ({error!r})"))
            return
        self.requests_sent += 1
        accepted = set(reply.accepted_event_ids)
        for waiting in group:
            first = waiting.events[0]
            own = tuple(e.event_id for e in waiting.events if e.event_id in accepted)
            commands = tuple(self._commands_for(first.node, first.incarnation))
            if len(group) == 1:  # the supervisor answered this agent's batch alone
                commands = (*reply.commands, *commands)
            _settle(waiting, web.Response(
                body=protocol.encode_reply(Reply(commands=commands, accepted_event_ids=own)),
                content_type="application/json",
            ))  # fmt: skip
            self.batches_relayed += 1

    @staticmethod
    def _answer_all(group: Sequence[_Waiting], response: web.Response) -> None:
        for waiting in group:
            _settle(waiting, web.Response(
                status=response.status, body=response.body, content_type="text/plain"
            ))  # fmt: skip


def check_signed(
    request: web.Request,
    body: bytes,
    job_id: str,
    secret: bytes,
    clock: Callable[[], float],
    window_s: int,
) -> None:
    """Refuse a request not signed with the job's secret inside the replay window (the
    supervisor's own check: :func:`agent.wire.protocol.verify`)."""
    headers = request.headers
    if headers.get(protocol.HEADER_JOB) != job_id:
        raise refused(web.HTTPForbidden, f"this aggregator is job {job_id}'s only")
    if headers.get(protocol.HEADER_PROTOCOL) != str(protocol.PROTOCOL_VERSION):
        raise refused(web.HTTPBadRequest, "unsupported protocol version")
    timestamp = headers.get(protocol.HEADER_TIMESTAMP, "")
    if not timestamp.isascii() or not timestamp.isdigit() or len(timestamp) > 12:
        raise refused(web.HTTPUnauthorized, "missing or malformed timestamp")
    try:
        protocol.verify(
            secret, request.method, request.raw_path, job_id, int(timestamp), body,
            headers.get(protocol.HEADER_SIGNATURE, ""), int(clock()), window_s,
        )  # fmt: skip
    except AuthError as error:
        raise refused(web.HTTPUnauthorized, str(error)) from None


def refused(kind: type[web.HTTPException], reason: str) -> web.HTTPException:
    """An HTTP refusal whose body says why."""
    return kind(text=reason, content_type="text/plain")


def _settle(waiting: _Waiting, response: web.Response) -> None:
    if not waiting.answer.done():  # the agent may have hung up meanwhile
        waiting.answer.set_result(response)


def _unreachable(why: str) -> web.Response:
    return web.Response(
        status=503, text=f"{why}: send the events to the supervisor", content_type="text/plain"
    )


def _passed_on(error: Rejected) -> web.Response:
    return web.Response(status=error.status, text=error.reason, content_type="text/plain")
