"""The node agent's side of the wire: a spool-backed, retrying reporter to the supervisor.

:class:`Reporter` is the only code in the agent that talks HTTP. Events go
through an on-disk spool before anything is sent, so an agent crash or a
supervisor outage loses nothing:

1. :meth:`Reporter.emit` numbers the event, appends it to the spool (one JSON
   line, flushed and fsynced) and wakes the sender;
2. the sender task POSTs spooled events in order, in batches, to
   ``/v1/events`` and retries every failure with jittered exponential
   backoff (tenacity) until the supervisor answers;
3. only events the supervisor lists in ``accepted_event_ids`` are dropped from
   the spool, by advancing a durable cursor file;
4. a Reporter started on the same spool directory after a crash sends the
   earlier incarnation's unacknowledged events first, with their original
   ids, so the supervisor records each exactly once.

In a job with an aggregator (the in-job driver's, ``aggregator_url``), routine
events (:data:`~agent.wire.protocol.RELAYED_KINDS`) go to it instead, which
sends many agents' batches to the supervisor in one request and answers each
agent with its own acknowledgements (:mod:`agent.driver.eventrelay`); a batch
holding a rank's exit, a hang or a stop goes straight to the supervisor.

Heartbeats are best effort and never spooled: only the newest matters. They
go over one WebSocket to the supervisor's heartbeat stream, opened with a
signed upgrade request and kept open (a request per heartbeat costs the
supervisor several times more), and are sent as POSTs to a supervisor that
has no stream (:mod:`agent.wire.streamline`). In a job with an aggregator
(the in-job driver's, ``aggregator_url``) they go to the aggregator's stream
instead, which forwards the whole job's at once; when it does not answer they
go straight to the supervisor again. The wire format and signing live in
:mod:`agent.wire.protocol`, the spool in :mod:`agent.node.spool`, the job
secret and signed requests in :mod:`agent.wire.auth`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import tenacity

from agent.node.spool import Spool
from agent.wire import protocol
from agent.wire.auth import Rejected, signed_post
from agent.wire.errors import ConfigError, describe
from agent.wire.protocol import Command, Event, EventKind, HeartbeatReport, Reply
from agent.wire.streamline import HEARTBEATS, StreamLine

logger = logging.getLogger(__name__)

DEFAULT_BACKOFF = tenacity.wait_random_exponential(multiplier=0.5, max=protocol.RETRY_MAX_S)
DEFAULT_HEARTBEAT_TIMEOUT_S = 2.0

# Remembered command ids; a supervisor repeats a command for seconds, not for
# thousands of commands.
_SEEN_COMMANDS = 4096
# After the job's aggregator failed a heartbeat, heartbeats go straight to the
# supervisor this long before the aggregator is tried again.
AGGREGATOR_RETRY_S = 30.0
# A heartbeat that failed for one of these may have left the stream out of step.
_UNDELIVERED = (aiohttp.ClientError, TimeoutError, ConnectionError, protocol.ProtocolError)


class Reporter:
    """Delivers the agent's events to the supervisor in order, exactly once, whatever happens.

    Lifecycle: construct (takes the spool lock and loads undelivered events),
    ``await start()`` (or ``async with``), ``await emit(...)`` as things
    happen, ``await heartbeat(...)`` periodically, ``await close(...)``.
    ``emit`` works before ``start``; the events wait in the spool.

    Failures while sending are retried with ``backoff`` between attempts,
    forever, until :meth:`close`; events are never dropped or reordered:

    - supervisor unreachable (refused, timeout, 5xx): a warning per attempt;
    - 401/403: logged as errors with the supervisor's reason. This is a
      misconfiguration (wrong secret, clock outside the replay window, node
      not in the job) that an operator can fix while the agent keeps
      retrying; the events stay spooled meanwhile;
    - 429: the job sent more events than its budget a minute: a warning, and
      the batch is sent again after the backoff;
    - 400: the supervisor found a batch malformed, which is a bug in one of
      the two sides; logged as an error with the reason and retried (a fixed
      supervisor accepts it), never dropped.

    Commands found on any reply are passed to ``on_command`` once per
    ``command_id`` within this process.
    """

    def __init__(
        self,
        base_url: str,
        job_id: str,
        node: str,
        secret: bytes,
        spool_dir: Path,
        *,
        incarnation: str | None = None,
        on_command: Callable[[Command], None] | None = None,
        clock: Callable[[], float] = time.time,
        max_batch: int = 100,
        timeout_s: float = 5.0,
        heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        backoff: tenacity.wait.wait_base = DEFAULT_BACKOFF,
        heartbeat_stream: bool = True,
        aggregator_url: str = "",
    ) -> None:
        if len(secret) < 16:
            raise ConfigError(f"job secret is {len(secret)} bytes; use new_secret() (32 bytes)")
        if not 1 <= max_batch <= protocol.MAX_EVENTS_PER_BATCH:
            raise ConfigError(f"max_batch must be 1..{protocol.MAX_EVENTS_PER_BATCH}")
        self.job_id = protocol.check_name(job_id, "job_id")
        self.node = protocol.check_name(node, "node")
        self.incarnation = protocol.check_incarnation(incarnation or secrets.token_hex(8))
        self._base_url = base_url.rstrip("/")
        self._secret = secret
        self._on_command = on_command
        self._clock = clock
        self._max_batch = max_batch
        self._timeout_s = timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._backoff = backoff
        self._spool = Spool(Path(spool_dir), self.job_id, self.node)
        self._seq = 0
        self._seen_commands: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._session: aiohttp.ClientSession | None = None
        self._direct = StreamLine(
            HEARTBEATS, self._base_url, "the supervisor", self.job_id, secret,
            stream=heartbeat_stream, clock=clock,
        )  # fmt: skip
        self._aggregator: StreamLine[Reply] | None = None
        if aggregator_url:
            self._aggregator = StreamLine(
                HEARTBEATS, aggregator_url, "the job's aggregator", self.job_id, secret,
                clock=clock,
            )  # fmt: skip
        self._direct_until = 0.0  # heartbeats skip the aggregator until then
        self._sender: asyncio.Task[None] | None = None
        self._closed = False
        self._wake = asyncio.Event()
        self._nudge = asyncio.Event()
        self._idle = asyncio.Event()
        self.heartbeats_sent = 0
        self.heartbeat_failures = 0
        self.events_delivered = 0

    @property
    def pending(self) -> int:
        """Events spooled and not yet acknowledged by the supervisor."""
        return len(self._spool.pending)

    @property
    def spool_dir(self) -> Path:
        """The spool directory this Reporter holds."""
        return self._spool.directory

    async def start(self) -> None:
        """Open the HTTP session and start the sender; spooled events go out at once."""
        if self._closed:
            raise RuntimeError("Reporter is closed")
        if self._sender is not None:
            return
        self._session = aiohttp.ClientSession()
        self._sender = asyncio.create_task(self._send_forever(), name="resurgo-reporter")
        self._wake.set()

    async def __aenter__(self) -> Reporter:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def emit(self, kind: EventKind, payload: dict[str, Any]) -> Event:
        """Record an event durably and queue it for delivery; returns it with its id.

        Raises :class:`~agent.wire.protocol.ProtocolError` (and spools nothing) when
        ``payload`` does not fit ``kind``. Blocks the loop for one fsync.
        """
        if self._closed:
            raise RuntimeError("Reporter is closed; the event was not recorded")
        event = protocol.make_event(
            kind,
            self.job_id,
            self.node,
            self.incarnation,
            self._seq + 1,
            self._clock(),
            payload,
        )
        self._spool.append(event)
        self._seq += 1
        self._idle.clear()
        self._wake.set()
        return event

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every spooled event is acknowledged; False if ``timeout_s`` ran out."""
        if not self._spool.pending:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def heartbeat(self, report: HeartbeatReport) -> bool:
        """Send one heartbeat summary; True if the supervisor (or the job's aggregator) took it.

        Failures are counted in ``heartbeat_failures`` and logged at debug: the
        next heartbeat supersedes this one, and events carry what must not be
        lost. A stream that failed (closed, timed out, garbled) is dropped and
        the next heartbeat opens a new one; a refused heartbeat leaves it open.
        Given an aggregator, heartbeats go there; one it did not take goes
        straight to the supervisor at once, and so do all for
        :data:`AGGREGATOR_RETRY_S` before the aggregator is tried again (a
        batch host lost takes the aggregator with it: the supervisor must
        still hear the other nodes).
        An invalid ``report`` raises :class:`~agent.wire.protocol.ProtocolError` (a
        bug in the caller, not a delivery failure).
        """
        body = protocol.encode_heartbeat(report)
        aggregator = self._aggregator
        if aggregator is not None and self._clock() >= self._direct_until:
            if await self._send_heartbeat(aggregator, body):
                if self._direct_until:
                    logger.info("heartbeats go through the job's aggregator again")
                    self._direct_until = 0.0
                return True
            self._direct_until = self._clock() + AGGREGATOR_RETRY_S
            logger.warning(
                "the job's aggregator at %s did not take a heartbeat; heartbeats go "
                "straight to the supervisor for %.0f s",
                aggregator.base_url,
                AGGREGATOR_RETRY_S,
            )
        return await self._send_heartbeat(self._direct, body)

    async def _send_heartbeat(self, line: StreamLine[Reply], body: bytes) -> bool:
        """One try on ``line``; the reply's commands dispatched."""
        if self._session is None:
            raise RuntimeError("Reporter.start() was not called")
        try:
            async with asyncio.timeout(self._heartbeat_timeout_s):
                reply = await line.send(self._session, body, self._heartbeat_timeout_s)
        except Rejected as error:
            self.heartbeat_failures += 1
            logger.debug("heartbeat refused by %s: %s", line.name, describe(error))
            return False
        except _UNDELIVERED as error:
            await line.drop()
            self.heartbeat_failures += 1
            logger.debug("heartbeat not delivered to %s: %s", line.name, describe(error))
            return False
        self.heartbeats_sent += 1
        self._dispatch(reply.commands)
        return True

    @property
    def streams_opened(self) -> int:
        """Heartbeat streams opened so far, to the supervisor and the aggregator."""
        lines = (self._direct, self._aggregator)
        return sum(line.streams_opened for line in lines if line is not None)

    async def close(self, drain_timeout_s: float = 5.0) -> None:
        """Deliver what is spooled within ``drain_timeout_s``, then stop; the rest stays spooled."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._sender is not None:
                # Cut a backoff sleep short: one more attempt before giving up.
                self._nudge.set()
                if not await self.flush(drain_timeout_s):
                    logger.warning(
                        "closing with %d events undelivered; they stay in %s for the next start",
                        self.pending,
                        self.spool_dir,
                    )
                self._sender.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._sender
        finally:
            await self._direct.drop()
            if self._aggregator is not None:
                await self._aggregator.drop()
            if self._session is not None:
                await self._session.close()
            self._spool.close()

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._spool.pending:
                await self._deliver_next_batch()
            self._idle.set()

    async def _deliver_next_batch(self) -> None:
        retrying = tenacity.AsyncRetrying(
            wait=self._backoff,
            stop=tenacity.stop_never,
            # Every failure, expected or a bug, is retried: the events are safe
            # in the spool and the loop must outlive a bad tick. CancelledError
            # is a BaseException and still stops it.
            retry=tenacity.retry_if_exception_type(Exception),
            sleep=self._interruptible_sleep,
            before_sleep=self._log_retry,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                await self._post_batch()

    async def _post_batch(self) -> None:
        events = self._spool.batch(self._max_batch, protocol.MAX_BODY_BYTES - 4096)
        body = protocol.encode_events(events)
        reply = await self._relayed(events, body)
        if reply is None:
            reply = await self._post(self._base_url, protocol.EVENTS_PATH, body, self._timeout_s)
        accepted = set(reply.accepted_event_ids)
        # Only a prefix can leave the spool: the cursor is a position, and
        # anything after a gap is resent (the supervisor dedups it).
        count = 0
        while count < len(events) and events[count].event_id in accepted:
            count += 1
        self._spool.acknowledge(count)
        self.events_delivered += count
        self._dispatch(reply.commands)
        if count == 0:
            raise Rejected(200, f"reply did not list {events[0].event_id}")

    async def _relayed(self, events: list[Event], body: bytes) -> Reply | None:
        """The reply to ``events`` through the job's aggregator (routine events only); None
        when they must go straight to the supervisor: one starts or ends a recovery, there
        is no aggregator, or it failed (then all go straight to the supervisor for
        :data:`AGGREGATOR_RETRY_S`, as heartbeats do)."""
        aggregator = self._aggregator
        if (
            aggregator is None
            or self._clock() < self._direct_until
            or any(event.kind not in protocol.RELAYED_KINDS for event in events)
        ):
            return None
        try:
            return await self._post(
                aggregator.base_url, protocol.EVENTS_PATH, body, self._timeout_s
            )
        except (*_UNDELIVERED, Rejected) as error:
            self._direct_until = self._clock() + AGGREGATOR_RETRY_S
            logger.warning(
                "the job's aggregator did not take %d event(s) (%s); events and heartbeats go "
                "straight to the supervisor for %.0f s",
                len(events),
                describe(error),
                AGGREGATOR_RETRY_S,
            )
            return None

    async def _post(self, base_url: str, path: str, body: bytes, timeout_s: float) -> Reply:
        if self._session is None:
            raise RuntimeError("Reporter.start() was not called")
        data = await signed_post(
            self._session, base_url + path, self.job_id, self._secret, body,
            timeout_s=timeout_s, clock=self._clock,
        )  # fmt: skip
        return protocol.decode_reply(data)

    def _dispatch(self, commands: tuple[Command, ...]) -> None:
        for command in commands:
            if command.command_id in self._seen_commands:
                continue
            self._seen_commands[command.command_id] = None
            if len(self._seen_commands) > _SEEN_COMMANDS:
                self._seen_commands.popitem(last=False)
            logger.info(
                "command %s from the supervisor: %s", command.command_id, command.kind.value
            )
            if self._on_command is None:
                continue
            try:
                self._on_command(command)
            except Exception:
                # At most once: a handler that failed is not called again for
                # this id; the supervisor sees the outcome through events.
                logger.exception("handling command %s failed", command.command_id)

    async def _interruptible_sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._nudge.wait(), seconds)
        self._nudge.clear()

    def _log_retry(self, state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        where = (
            f"{self.pending} events spooled in {self.spool_dir}, "
            f"retry {state.attempt_number} in {delay:.1f} s"
        )
        if isinstance(error, Rejected) and error.status in (401, 403):
            logger.error(
                "supervisor refused the agent's credentials (%d): %s; %s. Check that the "
                "agent has the job's secret and the node clock is right (NTP); the events "
                "are kept and delivered once this is fixed",
                error.status,
                error.reason,
                where,
            )
        elif isinstance(error, Rejected) and error.status == 429:
            logger.warning(
                "supervisor asked this job to slow down (429): %s; %s",
                error.reason,
                where,
            )
        elif isinstance(error, Rejected) and 400 <= error.status < 500:
            logger.error(
                "supervisor rejected a batch of events (%d): %s; %s. This is a bug in "
                "Resurgo: please report it with this line; the events are kept",
                error.status,
                error.reason,
                where,
            )
        elif isinstance(error, Rejected) and error.status == 200:
            logger.warning(
                "supervisor acknowledged none of the batch (%s); %s", error.reason, where
            )
        elif isinstance(error, aiohttp.ClientError | TimeoutError | Rejected):
            logger.warning(
                "supervisor unreachable (%s): no answer for %.0f s (retried without limit); %s",
                describe(error), state.seconds_since_start, where,
            )  # fmt: skip
        else:
            logger.error("sending events failed unexpectedly; %s", where, exc_info=error)
