"""The aiohttp application: routes, request authentication and answers (served by
:mod:`supervisor.api.serving`).

Checks run in this order, cheapest and least revealing first, and the first
failure answers (statuses in :class:`~supervisor.api.refusals.Cause`):

1. from the headers alone, before any of the body is read: signing headers
   present and well formed (the timestamp and signature each have one
   spelling), job known, timestamp inside the replay window (401);
   ``Content-Length`` over the limit (413);
2. the body, read by :class:`BodyReader`: in chunks into an anonymous
   memory map of its own (unmapped, so returned to the OS, the moment the
   request ends however it ends), hashed as it arrives, within
   ``body_timeout_s`` from the first byte wanted (408, and the connection is
   closed: a body that never ends or a ``Content-Length`` that lies holds
   nothing longer), cut at the size limit (413), and counted against
   ``unauthenticated_buffer_bytes``, the most all bodies not yet
   authenticated may hold together (503 for the request that would pass
   it). A client that goes away mid-body is no error: counted and logged
   as a rate-limited ``client_gone``, nothing answered;
3. HMAC over method, raw path, job, timestamp and the body's hash (401);
4. ``X-Resurgo-Protocol`` (400), then strict decoding (400, protocol's reason);
5. every event or heartbeat names the header's job (403) and a node of the
   job's *current* allocation (403); a committed checkpoint lies inside the
   job's checkpoint root (403, :meth:`JobDirectory.refuse_events`).

Steps 4-5 and the directory's work for ``POST /v1/events`` (disk checks,
store writes) pass through the intake gate: at most ``INTAKE_AT_ONCE``
batches at a time, and each yields the loop once on entry. A burst of new
connections is then paid for in cheap steps (accept, parse, authenticate,
park at the gate) before the costly ones, so a ``/healthz`` probe sent
after 100 reports is answered while they are still being taken, not after
all of them (bench/RESULTS.md, "Hostile API traffic"; uvloop accepts one
connection per loop pass).

The events' store writes then go through :class:`~supervisor.api.groupcommit.GroupCommit`:
the batches checked by the time the loop gets to them share one durable
commit, each in a savepoint of its own, and each is answered only after it.

Every error answer to a request whose body was not read to its end closes
the connection. Every refusal and every internal error is logged at most N
times per cause per minute (:class:`~supervisor.api.refusals.RefusalLog`).

The heartbeat stream (``GET /v1/heartbeat/stream``, a WebSocket; a job
aggregator's ``GET /v1/job/heartbeats/stream`` is served the same way) passes
checks 1-4 on its signed upgrade request (an unsigned or stale upgrade is
refused with the same HTTP answers, and nothing is upgraded). Each frame then
holds one heartbeat body after a line with its own timestamp and signature
(:func:`agent.wire.protocol.sign_frame`, over the stream's path), so a frame is
checked like a POST: replay window, signature, strict decoding, step 5. It
is answered by one frame: the reply, or a refusal carrying the status and
cause an HTTP answer would have had (the stream stays open). A captured
upgrade therefore lets nobody speak for the job without its secret. The
stream is closed when its job is no longer known, or known with another
secret (a job id reused by Slurm), and when the server shuts down. What a
request costs aiohttp (parsing, routing, a response) is paid once per
connection instead of once a second per agent.

Replays. A captured request can be replayed only inside the window (±300 s
by default), and a replay changes nothing: events are idempotent by
``event_id`` in the directory, and a heartbeat older than a node's newest is
ignored. There is deliberately no cache of seen signatures answering exact
replays from memory: the HMAC must be checked over the whole body anyway, so
such a cache would save only JSON decoding, while it would have to keep whole
replies (memory growing with traffic) and would hand out stale commands.

A per-job secret cannot tell one node of a job from another: a job's ranks
can forge reports about *their own* job's nodes, never about other jobs' or
nodes outside their allocation, which is what protects other users.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from agent.wire import protocol
from agent.wire.protocol import (
    AuthError,
    Command,
    Event,
    EventKind,
    ProtocolError,
    Refusal,
    Reply,
    StaleTimestamp,
)
from supervisor.api.bodies import BodyReader, ClientGone
from supervisor.api.directory import JobDirectory
from supervisor.api.groupcommit import GroupCommit
from supervisor.api.ratelimit import PER_RANK_PER_MINUTE, RETRY_AFTER_S, EventBudget
from supervisor.api.refusals import Cause, RefusalLog
from supervisor.errors import RequestRefused

logger = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"
METRICS_PATH = "/metrics"
JOB_STATUS_PATH = "/v1/jobs/{job_id}"

# ASCII digits only: int() would also take spaces, underscores and other
# scripts' digits, letting two header spellings share one canonical string.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# And no leading zeros: "0017" and "17" would otherwise verify with one signature.
_TIMESTAMP = re.compile(r"0|[1-9][0-9]{0,11}")
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_REFUSALS = web.AppKey("refusals", RefusalLog)
# A stream whose agent went away without closing it is noticed by a ping
# unanswered for this long (agents send heartbeats far more often).
STREAM_PING_S = 60.0
# How long closing a stream waits for the agent's close frame (a dead node never sends it).
STREAM_CLOSE_S = 2.0
# The answer to nearly every heartbeat (nothing acknowledged, no commands), encoded once.
_EMPTY_REPLY = protocol.encode_reply(Reply())
# How long a request's body may take to arrive, from when the handler wants it.
BODY_TIMEOUT_S = 30.0
# Events one job may send a minute, at least (supervisor.api.ratelimit).
EVENTS_PER_MINUTE = 6000
# The most bytes all requests not yet authenticated may hold together.
UNAUTHENTICATED_BUFFER_BYTES = 128 << 20
# How many authenticated event batches are decoded and taken at once (the intake gate).
INTAKE_AT_ONCE = 2


def build_app(
    directory: JobDirectory,
    *,
    clock: Callable[[], float] = time.time,
    window_s: int = protocol.REPLAY_WINDOW_S,
    max_body_bytes: int = protocol.MAX_BODY_BYTES,
    refusal_log_per_minute: int = 20,
    metrics: Callable[[], bytes] | None = None,
    jobs_dir: str | None = None,
    facts: Callable[[], dict[str, Any]] | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
    unauthenticated_buffer_bytes: int = UNAUTHENTICATED_BUFFER_BYTES,
    events_per_minute: int = EVENTS_PER_MINUTE,
) -> web.Application:
    """The supervisor's HTTP API over ``directory``.

    Routes: ``POST /v1/events``, ``POST /v1/heartbeat`` and
    ``GET /v1/heartbeat/stream`` (agents), ``POST /v1/job/heartbeats`` and
    ``GET /v1/job/heartbeats/stream`` (a job's aggregator), ``POST /v1/driver``
    (the in-job driver),
    ``GET /v1/jobs/{job_id}`` (the CLI; signed like the rest),
    ``GET /healthz`` and, given ``metrics`` (the exposition text, produced in
    a worker thread since it reads the store), ``GET /metrics`` for Prometheus
    (both unauthenticated: they carry no secrets). ``jobs_dir``, the
    directory the daemon registers jobs from, is named in ``/healthz`` so that
    ``resurgo submit`` can say which one a supervisor that does not register
    its job watches (a path every user is told anyway). ``facts`` adds the
    supervisor's mode (drain or exclude) and the nodes a user's next jobs
    should leave out, for ``resurgo submit`` (node names, as ``sinfo`` shows
    anyone, and the blame's cause and job id). ``clock`` gives Unix
    seconds for the replay window and the refusal log's rate limit.
    ``body_timeout_s`` and ``unauthenticated_buffer_bytes``: see the module's
    docstring, check 2. ``events_per_minute``: each job's event budget
    (:mod:`supervisor.api.ratelimit`; 0: none).
    """
    api = _Api(
        directory,
        clock,
        window_s,
        BodyReader(max_body_bytes, body_timeout_s, unauthenticated_buffer_bytes),
        RefusalLog(logger, clock, per_window=refusal_log_per_minute),
        jobs_dir,
        facts,
        EventBudget(events_per_minute),
    )
    app = web.Application(client_max_size=max_body_bytes, middlewares=[api.guard])
    app[_REFUSALS] = api.refusals
    app[_API] = api
    app.on_shutdown.append(api.close_streams)
    app.router.add_post(protocol.EVENTS_PATH, api.events)
    app.router.add_post(protocol.HEARTBEAT_PATH, api.heartbeat)
    app.router.add_get(protocol.HEARTBEAT_STREAM_PATH, api.heartbeat_stream)
    app.router.add_post(protocol.JOB_HEARTBEATS_PATH, api.job_heartbeats)
    app.router.add_get(protocol.JOB_HEARTBEATS_STREAM_PATH, api.job_heartbeats_stream)
    app.router.add_post(protocol.DRIVER_PATH, api.driver)
    app.router.add_get(JOB_STATUS_PATH, api.job_status)
    app.router.add_get(HEALTH_PATH, api.health)
    if metrics is not None:
        add_metrics_route(app, metrics)
    return app


def build_metrics_app(metrics: Callable[[], bytes]) -> web.Application:
    """An application serving only ``GET /metrics`` (and ``/healthz``), for its own listener."""
    app = web.Application()
    add_metrics_route(app, metrics)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get(HEALTH_PATH, health)
    return app


def add_metrics_route(app: web.Application, metrics: Callable[[], bytes]) -> None:
    """``GET /metrics``: the exposition text, produced in a worker thread (it reads the store)."""

    async def scrape(request: web.Request) -> web.Response:
        body = await asyncio.to_thread(metrics)
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    app.router.add_get(METRICS_PATH, scrape)


def refusal_log(app: web.Application) -> RefusalLog | None:
    """The refusal log of an application built by :func:`build_app` (None for others)."""
    return app.get(_REFUSALS)


def open_streams(app: web.Application) -> int:
    """How many heartbeat streams are open now."""
    return len(app[_API].streams)


def _auth_refusal(error: AuthError) -> RequestRefused:
    """The 401 for a signature that did not verify: stale, or wrong."""
    cause = Cause.STALE_TIMESTAMP if isinstance(error, StaleTimestamp) else Cause.BAD_SIGNATURE
    return cause.refuse(str(error))


def _error(status: int, cause: str, reason: str) -> web.Response:
    """An error answer: JSON with the cause code and a reason for humans (agents only log it)."""
    return web.json_response({"error": cause, "reason": reason}, status=status)


class _Api:
    """The handlers, sharing the directory, the clock and the refusal log."""

    def __init__(
        self,
        directory: JobDirectory,
        clock: Callable[[], float],
        window_s: int,
        bodies: BodyReader,
        refusals: RefusalLog,
        jobs_dir: str | None = None,
        facts: Callable[[], dict[str, Any]] | None = None,
        budget: EventBudget | None = None,
    ) -> None:
        self._directory = directory
        self._budget = budget or EventBudget(0)
        self._jobs_dir = jobs_dir
        self._facts = facts
        self._clock = clock
        self._window_s = window_s
        self._bodies = bodies
        self._max_body_bytes = bodies.max_bytes
        self.refusals = refusals
        self.streams: set[web.WebSocketResponse] = set()
        self._intake = asyncio.Semaphore(INTAKE_AT_ONCE)
        self._commits = GroupCommit(directory.durably)

    @web.middleware
    async def guard(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Turn refusals into JSON answers and anything unexpected into a logged 500."""
        job = request.headers.get(protocol.HEADER_JOB)
        try:
            return await handler(request)
        except ClientGone as gone:
            self.refusals.record(Cause.CLIENT_GONE.status, Cause.CLIENT_GONE.value, str(gone), job)
            # Nobody reads this answer: aiohttp finds the connection closed.
            return _closing(_error(400, Cause.CLIENT_GONE.value, "the client went away"))
        except RequestRefused as refused:
            self.refusals.record(refused.status, refused.cause, refused.reason, job)
            answer = _error(refused.status, refused.cause, refused.reason)
            if refused.status == Cause.BUSY.status:
                answer.headers["Retry-After"] = "5"
            if refused.status == Cause.RATE_LIMITED.status:
                answer.headers["Retry-After"] = str(RETRY_AFTER_S)
            # Unread body bytes would be taken for the next request (or make aiohttp
            # wait for them): the connection ends with this answer.
            return answer if request.content.at_eof() else await _send_and_close(request, answer)
        except web.HTTPException as http:
            # The router's own 404/405 (and any other aiohttp refusal).
            if http.status < 400:
                raise
            cause = {404: Cause.NOT_FOUND.value, 405: Cause.METHOD_NOT_ALLOWED.value}.get(
                http.status, f"http_{http.status}"
            )
            self.refusals.record(http.status, cause, http.reason, job)
            answer = _error(http.status, cause, http.reason)
            if "Allow" in http.headers:
                answer.headers["Allow"] = http.headers["Allow"]
            return answer
        except Exception:
            # A bug here or in the directory: the traceback goes to the log
            # (rate-limited), never to the client, and the server keeps serving.
            self.refusals.internal_error(
                "unexpected error answering %s %r (job %r)",
                request.method,
                request.path[:200],
                None if job is None else job[:64],
            )
            return _error(500, "internal", "internal error; the supervisor's log has details")

    async def health(self, request: web.Request) -> web.Response:
        """``GET /healthz``: the server answers; refusal counts by cause and the jobs
        directory's path, no job data."""
        document: dict[str, Any] = {
            "status": "ok",
            "protocol": protocol.PROTOCOL_VERSION,
            "refused": self.refusals.totals,
        }
        if self._jobs_dir is not None:
            document["jobs_dir"] = self._jobs_dir
        if self._facts is not None:
            document.update(self._facts())
        return web.json_response(document)

    async def events(self, request: web.Request) -> web.Response:
        """``POST /v1/events``: record a batch; acknowledge its ids and return pending commands."""
        job_id, body = await self._authenticate(request)
        async with self._intake:
            # Yield once: the loop goes on accepting and answering (``/healthz``
            # among them) while a burst of reports waits here, authenticated.
            await asyncio.sleep(0)
            events = await self._checked_events(job_id, body)
        return await self._commits.run(lambda: self._take_events(job_id, events))

    def _take_events(self, job_id: str, events: Sequence[Event]) -> web.Response:
        """Record a checked batch (inside a group's durable commit); the answer."""
        accepted = self._directory.accept_events(job_id, events)
        senders = {(event.node, event.incarnation) for event in events}
        # Commands are for one agent: a batch mixing agents (which the Reporter
        # never sends) gets none rather than another agent's.
        commands = self._directory.commands_for(job_id, *senders.pop()) if len(senders) == 1 else ()
        return _reply(accepted, commands)

    async def _checked_events(self, job_id: str, body: bytes) -> tuple[Event, ...]:
        """Decode an authenticated batch and check it (steps 4-5)."""
        try:
            events = protocol.decode_events(body)
        except ProtocolError as error:
            raise Cause.MALFORMED.refuse(str(error)) from None
        for event in events:
            _own_job(job_id, event.job_id, f"event {event.event_id[:200]!r}")
        self._check_nodes(job_id, [event.node for event in events])
        self._check_ranks(
            job_id,
            [
                (e.payload.get("global_rank"), e.payload.get("local_rank"))
                for e in events
                # Its rank may lie outside the job's world: that is what it reports.
                if e.kind is not EventKind.WORLD_MISMATCH
            ],
        )
        bounds = self._directory.ranks(job_id)
        if not await self._budget.admit(job_id, len(events), bounds[0] if bounds else None):
            limit = self._budget.limit_for(bounds[0] if bounds else None)
            raise Cause.RATE_LIMITED.refuse(
                f"job {job_id!r} sent more than {limit} events in a minute (the supervisor's "
                f"events_per_minute, or {PER_RANK_PER_MINUTE} per rank): this batch of "
                f"{len(events)} was not stored; send it again after {RETRY_AFTER_S} s"
            )
        why = await self._directory.refuse_events(job_id, events)
        if why is not None:
            raise Cause.OUTSIDE_ROOT.refuse(why)
        return events

    async def heartbeat(self, request: web.Request) -> web.Response:
        """``POST /v1/heartbeat``: take a node's heartbeat; return its pending commands."""
        job_id, body = await self._authenticate(request)
        return _answer(self._take_heartbeat(job_id, body))

    async def heartbeat_stream(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/heartbeat/stream``: one agent's heartbeats over a WebSocket, each answered."""
        return await self._serve_stream(
            request, protocol.HEARTBEAT_STREAM_PATH, self._take_heartbeat
        )

    async def job_heartbeats_stream(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/job/heartbeats/stream``: a job's aggregator's requests over a WebSocket."""
        return await self._serve_stream(
            request, protocol.JOB_HEARTBEATS_STREAM_PATH, self._take_job_heartbeats
        )

    async def _serve_stream(
        self, request: web.Request, path: str, take: Callable[[str, bytes], bytes]
    ) -> web.StreamResponse:
        """A stream of signed frames, each checked like a request and answered by ``take``."""
        job_id, _ = await self._authenticate(request)
        secret = self._directory.secret(job_id)
        if secret is None:  # unregistered while the upgrade was read
            raise Cause.UNKNOWN_JOB.refuse(f"job {job_id!r} is not known to this supervisor")
        stream = web.WebSocketResponse(
            heartbeat=STREAM_PING_S,
            timeout=STREAM_CLOSE_S,
            max_msg_size=self._max_body_bytes,
            compress=False,
        )
        try:
            await stream.prepare(request)
        except ConnectionResetError:
            # The agent hung up while the upgrade was answered (it gave up waiting;
            # its next heartbeat opens another stream). This answer is never sent.
            logger.debug("job %s: an agent left before its stream was opened", job_id)
            return web.Response(status=400)
        self.streams.add(stream)
        try:
            async for message in stream:
                if message.type not in (WSMsgType.BINARY, WSMsgType.TEXT):
                    break  # an error frame; closing ones end the iteration themselves
                if self._directory.secret(job_id) is not secret:
                    await stream.close(
                        code=WSCloseCode.POLICY_VIOLATION,
                        message=f"job {job_id} is no longer known; reconnect".encode(),
                    )
                    break
                data = message.data
                frame = data if type(data) is bytes else data.encode()
                await stream.send_bytes(self._stream_answer(job_id, secret, frame, path, take))
        except ConnectionResetError:
            # The agent hung up before its answer was written: it opens a new
            # stream with its next heartbeat. Nothing to answer, nothing wrong here.
            logger.debug("job %s: an agent left its stream before its answer", job_id)
        finally:
            self.streams.discard(stream)
        return stream

    def _stream_answer(
        self,
        job_id: str,
        secret: bytes,
        frame: bytes,
        path: str,
        take: Callable[[str, bytes], bytes],
    ) -> bytes:
        """One frame's answer: the reply, or the refusal an HTTP answer would carry."""
        now_s = int(self._clock())
        try:
            try:
                body = protocol.open_frame(secret, job_id, frame, now_s, self._window_s, path)
            except AuthError as error:
                raise _auth_refusal(error) from None
            return take(job_id, body)
        except RequestRefused as refused:
            self.refusals.record(refused.status, refused.cause, refused.reason, job_id)
            return protocol.encode_refusal(Refusal(refused.status, refused.cause, refused.reason))
        except Exception:
            self.refusals.internal_error(
                "unexpected error taking a frame of %s (job %r)", path, job_id
            )
            return protocol.encode_refusal(
                Refusal(500, "internal", "internal error; the supervisor's log has details")
            )

    async def close_streams(self, app: web.Application) -> None:
        """At shutdown: close every heartbeat stream (their agents reconnect later).

        All at once, and a close that waits for the agent's close frame waits
        at most ``STREAM_CLOSE_S``: thousands of streams must not hold the
        shutdown one after the other.
        """
        await asyncio.gather(
            *(
                stream.close(code=WSCloseCode.GOING_AWAY, message=b"supervisor shutting down")
                for stream in list(self.streams)
            ),
            return_exceptions=True,
        )

    def _take_heartbeat(self, job_id: str, body: bytes) -> bytes:
        """Decode, check and take one heartbeat of ``job_id``; the encoded reply."""
        try:
            report = protocol.decode_heartbeat(body)
        except ProtocolError as error:
            raise Cause.MALFORMED.refuse(str(error)) from None
        _own_job(job_id, report.job_id, "heartbeat")
        self._check_nodes(job_id, [report.node])
        self._directory.accept_heartbeat(job_id, report)
        return _encoded_reply(
            (), self._directory.commands_for(job_id, report.node, report.agent_incarnation)
        )

    async def job_heartbeats(self, request: web.Request) -> web.Response:
        """``POST /v1/job/heartbeats``: a job's heartbeats from its aggregator; each agent's
        pending commands."""
        job_id, body = await self._authenticate(request)
        return _answer(self._take_job_heartbeats(job_id, body))

    def _take_job_heartbeats(self, job_id: str, body: bytes) -> bytes:
        """Decode, check and take a job's heartbeats; the encoded reply."""
        try:
            batch = protocol.decode_job_heartbeats(body)
        except ProtocolError as error:
            raise Cause.MALFORMED.refuse(str(error)) from None
        _own_job(job_id, batch.job_id, "job heartbeats")
        self._check_nodes(
            job_id, [beat.node for beat in batch.beats] + [r.node for r in batch.reports]
        )
        self._directory.accept_job_heartbeats(job_id, batch)
        agents = [(beat.node, beat.agent_incarnation) for beat in batch.beats]
        return protocol.encode_job_reply(self._directory.commands_for_agents(job_id, agents))

    async def driver(self, request: web.Request) -> web.Response:
        """``POST /v1/driver``: the in-job driver asks what to do; the directory answers."""
        job_id, body = await self._authenticate(request)
        try:
            question = protocol.decode_driver_request(body)
        except ProtocolError as error:
            raise Cause.MALFORMED.refuse(str(error)) from None
        if question.job_id != job_id:
            raise Cause.CROSS_JOB.refuse(
                f"driver request is about job {question.job_id!r}, but the request is signed "
                f"for job {job_id!r}: a job's driver speaks only for its own job"
            )
        answer = await self._directory.driver(job_id, question)
        return web.Response(
            body=protocol.encode_driver_answer(answer), content_type="application/json"
        )

    async def job_status(self, request: web.Request) -> web.Response:
        """``GET /v1/jobs/{job_id}``: the directory's summary of the job, signed with its secret."""
        job_id, _ = await self._authenticate(request)
        wanted = request.match_info["job_id"]
        if wanted != job_id:
            raise Cause.CROSS_JOB.refuse(
                f"the request is signed for job {job_id!r} and cannot read job {wanted[:64]!r}"
            )
        status = self._directory.status(job_id)
        if status is None:
            raise Cause.UNKNOWN_JOB.refuse(f"job {job_id!r} is not known to this supervisor")
        return web.json_response(
            {
                "protocol": protocol.PROTOCOL_VERSION,
                "type": "job_status",
                "job_id": job_id,
                "status": status,
            }
        )

    async def _authenticate(self, request: web.Request) -> tuple[str, bytes]:
        """The request's job id and body once the signature checks out; else raise a refusal."""
        headers = request.headers
        job_id = headers.get(protocol.HEADER_JOB)
        timestamp = headers.get(protocol.HEADER_TIMESTAMP)
        signature = headers.get(protocol.HEADER_SIGNATURE)
        if job_id is None or timestamp is None or signature is None:
            raise Cause.MISSING_AUTH.refuse(
                f"sign the request: {protocol.HEADER_JOB}, {protocol.HEADER_TIMESTAMP} and "
                f"{protocol.HEADER_SIGNATURE} are required (docs/protocol.md, Signing)"
            )
        try:
            protocol.check_name(job_id, "job_id")
        except ProtocolError:
            raise Cause.MALFORMED_AUTH.refuse(f"{protocol.HEADER_JOB} is not a job id") from None
        if not _TIMESTAMP.fullmatch(timestamp):
            raise Cause.MALFORMED_AUTH.refuse(
                f"{protocol.HEADER_TIMESTAMP} must be integer Unix seconds without leading zeros"
            )
        if not protocol.is_signature(signature):
            raise Cause.MALFORMED_AUTH.refuse(
                f"{protocol.HEADER_SIGNATURE} must be 64 lowercase hex digits"
            )
        secret = self._directory.secret(job_id)
        if secret is None:
            raise Cause.UNKNOWN_JOB.refuse(f"job {job_id!r} is not known to this supervisor")
        try:
            protocol.check_fresh(int(timestamp), int(self._clock()), self._window_s)
        except AuthError as error:
            raise _auth_refusal(error) from None
        async with self._bodies.read(request) as (body, digest):
            try:
                protocol.verify_hashed(
                    secret,
                    request.method,
                    request.rel_url.raw_path,
                    job_id,
                    int(timestamp),
                    digest,
                    signature,
                )
            except AuthError as error:
                raise _auth_refusal(error) from None
            # Authenticated: the body leaves the map (and the unauthenticated budget).
            data = bytes(body)
        version = headers.get(protocol.HEADER_PROTOCOL)
        if version != str(protocol.PROTOCOL_VERSION):
            raise Cause.UNSUPPORTED_PROTOCOL.refuse(
                f"{protocol.HEADER_PROTOCOL} is {(version or '')[:16]!r}; this supervisor speaks "
                f"{protocol.PROTOCOL_VERSION}: run one Resurgo version on agents and supervisor"
            )
        return job_id, data

    def _check_ranks(self, job_id: str, ranks: Sequence[tuple[object, object]]) -> None:
        """Refuse (400) events about a rank the job's world cannot have: each rank's
        history is kept, so made-up ranks would grow the supervisor's memory. An
        agent retries a refused batch: one that came before the heartbeat that
        showed how many ranks a node runs is taken after it."""
        bounds = self._directory.ranks(job_id)
        if bounds is None:
            return
        world, per_node = bounds
        for global_rank, local_rank in ranks:
            if isinstance(global_rank, int) and not 0 <= global_rank < world:
                raise Cause.UNKNOWN_RANK.refuse(
                    f"global rank {global_rank} is not a rank of job {job_id!r}, whose world "
                    f"has at most {world} ranks: report the ranks the launcher started"
                )
            if isinstance(local_rank, int) and not 0 <= local_rank < per_node:
                raise Cause.UNKNOWN_RANK.refuse(
                    f"local rank {local_rank} is not a rank of job {job_id!r}, which runs "
                    f"{per_node} rank(s) per node: report the ranks the launcher started"
                )

    def _check_nodes(self, job_id: str, nodes: Sequence[str]) -> None:
        """Refuse (403) reports about a node outside the job's current allocation."""
        allocation = self._directory.allocation(job_id) or frozenset()
        for node in nodes:
            if node not in allocation:
                raise Cause.FOREIGN_NODE.refuse(
                    f"node {node!r} is not in job {job_id!r}'s current allocation: an agent "
                    "reports only about the node it runs on, while that node is in the job"
                )


_API = web.AppKey("api", _Api)


def _own_job(job_id: str, about: str, what: str) -> None:
    """Refuse (403) a report signed for ``job_id`` that is about another job."""
    if about != job_id:
        raise Cause.CROSS_JOB.refuse(
            f"{what} is about job {about!r}, but the request is signed for job {job_id!r}: "
            "a job reports only about itself"
        )


def _closing(answer: web.Response) -> web.Response:
    answer.force_close()
    return answer


async def _send_and_close(request: web.Request, answer: web.Response) -> web.Response:
    """Send ``answer``, then close the connection without reading the rest of the body.

    aiohttp would otherwise go on reading ("lingering") what the client still
    sends, which a client that never finishes makes forever.
    """
    answer.force_close()
    with contextlib.suppress(ConnectionError):
        await answer.prepare(request)
        await answer.write_eof()
    if request.transport is not None:
        request.transport.close()
    return answer


def _reply(accepted: Sequence[str], commands: Sequence[Command]) -> web.Response:
    """A 200 with a protocol Reply; commands beyond the protocol's limit wait for the next one."""
    return _answer(_encoded_reply(accepted, commands))


def _answer(body: bytes) -> web.Response:
    return web.Response(body=body, content_type="application/json")


def _encoded_reply(accepted: Sequence[str], commands: Sequence[Command]) -> bytes:
    """The Reply's bytes, with at most the protocol's limit of commands."""
    if len(commands) > protocol.MAX_COMMANDS:
        logger.warning(
            "directory offered %d commands; sending the first %d",
            len(commands),
            protocol.MAX_COMMANDS,
        )
    if not accepted and not commands:
        return _EMPTY_REPLY
    reply = Reply(
        commands=tuple(commands[: protocol.MAX_COMMANDS]), accepted_event_ids=tuple(accepted)
    )
    return protocol.encode_reply(reply)
