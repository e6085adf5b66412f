"""Thousands of hostile requests against the real API on 127.0.0.1: never a 5xx, never down.

One server runs for the whole module in a background thread (its own event
loop), over a :class:`MemoryDirectory` with two jobs and a fixed clock. The
tests send, through a plain ``http.client`` connection or a raw socket:
random bytes as bodies (signed and not), valid bodies mutated at the JSON
and the byte level and then validly signed, random and huge headers, random
methods and paths, oversized bodies, and raw garbage instead of HTTP. Every
answer must be one the API documents, no request may be logged as an
internal error, and ``/healthz`` must still answer 200: both are checked
after every test (``no_internal_error``), so no test relies on running last.
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from agent.wire import protocol
from agent.wire.protocol import EventKind
from supervisor.api import MemoryDirectory, bound_port, build_app, serve, shutdown
from tests.json_slots import slots
from tests.unit.api_world import INCARNATION, JOB, NODES, NOW, OTHER_JOB, OTHER_SECRET, SECRET

MAX_BODY_BYTES = 64 << 10
DOCUMENTED = {200, 400, 401, 403, 405, 413}
FUZZ = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

PAYLOADS: dict[EventKind, dict[str, Any]] = {
    EventKind.RANK_EXITED: {
        "global_rank": 5,
        "local_rank": 1,
        "pid": 4242,
        "exit_code": None,
        "signal": 9,
        "signal_name": "SIGKILL",
        "last_step": 120,
        "phase": "train",
    },
    EventKind.LAUNCHER_EXITED: {"exit_code": 1, "signal": None},
    EventKind.HANG: {
        "hung": [
            {
                "global_rank": 5,
                "local_rank": 1,
                "pid": 4242,
                "last_step": 120,
                "phase": "train",
                "seconds_since_progress": 61.5,
                "timeout_s": 60.0,
                "detector": "heartbeat",
            }
        ],
        "stacks": {"4": "Thread 4241 (idle)", "5": "Thread 4242 (active)"},
        "culprits": [
            {"global_rank": 5, "last_step": 120, "in_collective": False, "reason": "behind"}
        ],
    },
    EventKind.STRAGGLER: {
        "global_rank": 3,
        "local_rank": 3,
        "step_time_p50_s": 1.5,
        "step_time_p99_s": 2.0,
        "step_time_mean_s": 1.6,
        "steps_observed": 100,
        "node_median_step_time_s": 0.5,
    },
    EventKind.HEALTH_CHECK_FAILED: {
        "command": ["nvidia-smi", "-q"],
        "exit_code": None,
        "output_tail": "timeout",
        "timed_out": True,
    },
    EventKind.CHECKPOINT_COMMITTED: {"step": 100, "path": "/ckpt/100", "global_rank": 0},
    EventKind.STEP_LOSSES: {
        "global_rank": 0,
        "steps": [
            {"step": 101, "loss": 0.25, "cursor": 1212},
            {"step": 102, "loss": None, "cursor": None},
        ],
    },
    EventKind.RANKS_STOPPED: {
        "reason": "stop",
        "command_id": "c-1",
        "grace_s": 30.0,
        "ranks": [
            {
                "global_rank": 0,
                "local_rank": 0,
                "pid": 11,
                "method": "sigterm",
                "exit_code": 0,
                "signal": None,
            }
        ],
    },
    EventKind.AGENT_STARTED: {
        "agent_version": "0.1.0",
        "pid": 7,
        "argv": ["resurgo-agent"],
        "nnodes": 2,
        "node_rank": 0,
        "health_checks": ["ok builtin:ckpt_root (0.01 s): /ckpt is writable, 9.0 GB free"],
    },
    EventKind.AGENT_STOPPED: {"reason": "done"},
    EventKind.TIME_LIMIT_NEAR: {"end_unix_s": 1.7e9, "save_by_unix_s": 1.7e9 - 60, "attempt": 1},
}


def valid_events_body() -> bytes:
    events = [
        protocol.make_event(kind, JOB, NODES[seq % 2], INCARNATION, seq, NOW, payload)
        for seq, (kind, payload) in enumerate(PAYLOADS.items(), start=1)
    ]
    return protocol.encode_events(events)


def valid_heartbeat_body() -> bytes:
    rank = protocol.RankStatus(0, 0, 4242, 10, "train", NOW - 1.0, 0.5, 0.9, 0.55, 10)
    idle = protocol.RankStatus(1, 1, 4243, None, None, None, None, None, None, 0)
    report = protocol.HeartbeatReport(JOB, "node1", NOW, (rank, idle), INCARNATION)
    return protocol.encode_heartbeat(report)


def valid_driver_body() -> bytes:
    request = protocol.DriverRequest(
        JOB, protocol.DriverPhase.RELAUNCHED, attempt=2, exit_code=1, action_id="a/2/r", ok=True
    )
    return protocol.encode_driver_request(request)


VALID = {
    protocol.EVENTS_PATH: valid_events_body(),
    protocol.HEARTBEAT_PATH: valid_heartbeat_body(),
    protocol.DRIVER_PATH: valid_driver_body(),
}
PATHS = st.sampled_from(sorted(VALID))


class ErrorCounter(logging.Handler):
    """Counts ERROR records from the API: an internal error is one, whatever the answer was."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class ThreadedServer:
    """The real API served from a background thread's event loop on a free loopback port."""

    def __init__(self, directory: MemoryDirectory) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        app = build_app(directory, clock=lambda: NOW, max_body_bytes=MAX_BODY_BYTES)
        self._runner: web.AppRunner = self._call(serve(app, "127.0.0.1", 0))
        self.port = bound_port(self._runner)
        self.errors = ErrorCounter()

    def _call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(30)

    def close(self) -> None:
        self._call(shutdown(self._runner))
        self._call(_cancel_the_rest())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


async def _cancel_the_rest() -> None:
    """End connection tasks still parked after shutdown, so the loop closes without warnings."""
    rest = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in rest:
        task.cancel()
    await asyncio.gather(*rest, return_exceptions=True)


class Client:
    """One keep-alive HTTP connection that reconnects after the server closed it."""

    def __init__(self, port: int) -> None:
        self._port = port
        self._connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def request(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> int | None:
        """The answer's status; None when the server closed the connection without one."""
        for _ in range(2):
            try:
                self._connection.request(method, path, body=body, headers=headers or {})
                response = self._connection.getresponse()
                response.read()
                if response.will_close:
                    self._connection.close()
                if currently_in_test_context():
                    # --hypothesis-show-statistics shows which answers the fuzzing reached.
                    event(f"status {response.status}")
                return response.status
            except (http.client.HTTPException, ConnectionError):
                # A stale keep-alive connection: retry once on a fresh one.
                self._connection.close()
        return None

    def close(self) -> None:
        self._connection.close()


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadedServer]:
    directory = MemoryDirectory()
    directory.add_job(JOB, SECRET, NODES)
    directory.add_job(OTHER_JOB, OTHER_SECRET, ("node7",))
    running = ThreadedServer(directory)
    api_logger = logging.getLogger("supervisor.api")
    api_logger.addHandler(running.errors)
    try:
        yield running
    finally:
        api_logger.removeHandler(running.errors)
        running.close()


@pytest.fixture(scope="module")
def client(server: ThreadedServer) -> Iterator[Client]:
    connection = Client(server.port)
    yield connection
    connection.close()


@pytest.fixture(autouse=True)
def no_internal_error(server: ThreadedServer, client: Client) -> Iterator[None]:
    """After every test, whichever ran before it: the server still answers, and none of
    the requests it took was an internal error."""
    yield
    assert client.request("GET", "/healthz") == 200
    errors = [record.getMessage() for record in server.errors.records]
    server.errors.records.clear()
    assert errors == []


def signed(path: str, body: bytes, job: str = JOB, secret: bytes = SECRET) -> dict[str, str]:
    headers = protocol.signed_headers(secret, "POST", path, job, NOW, body)
    headers["Content-Type"] = "application/json"
    return headers


# -- strategies --------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from([JOB, OTHER_JOB, "node1", "node7", "", "a" * 200, INCARNATION]),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def json_mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body with one to four JSON-level edits: replace, delete, add, duplicate, retarget."""
    path = draw(PATHS)
    document = copy.deepcopy(json.loads(VALID[path]))
    for _ in range(draw(st.integers(1, 4))):
        places = slots(document)
        if not places:
            break  # every field deleted: the empty object is the mutation
        container, key = draw(st.sampled_from(places))
        operation = draw(st.sampled_from(["replace", "delete", "add", "duplicate", "retarget"]))
        if operation == "retarget":
            # Aim at what must be 403: another job, or a node outside the allocation.
            for slot in slots(document):
                if slot[1] in ("job_id", "node") and draw(st.booleans()):
                    slot[0][slot[1]] = draw(st.sampled_from([OTHER_JOB, "node7", "node3"]))
        elif operation == "replace":
            container[key] = draw(JSON_VALUES)
        elif operation == "delete":
            del container[key]
        elif operation == "add" and isinstance(container, dict):
            container[draw(st.text(max_size=12))] = draw(JSON_VALUES)
        elif operation == "duplicate" and isinstance(container, list):
            container.append(copy.deepcopy(container[key]))
    return path, json.dumps(document).encode()


@st.composite
def byte_mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body with bytes flipped, inserted, deleted or the tail cut off."""
    path = draw(PATHS)
    body = bytearray(VALID[path])
    for _ in range(draw(st.integers(1, 8))):
        if not body:
            break
        at = draw(st.integers(0, len(body) - 1))
        operation = draw(st.sampled_from(["flip", "insert", "delete", "truncate"]))
        if operation == "flip":
            body[at] = draw(st.integers(0, 255))
        elif operation == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif operation == "delete":
            del body[at : at + draw(st.integers(1, 16))]
        else:
            del body[at:]
    return path, bytes(body)


HEADER_NAMES = st.text(
    alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_!#$%&'*+.^`|~",
    min_size=1,
    max_size=30,
).filter(
    lambda name: (
        name.lower()
        not in {"content-length", "transfer-encoding", "expect", "connection", "upgrade", "host"}
    )
)
# Latin-1 without control characters: what http.client can put on the wire.
HEADER_VALUES = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF, blacklist_characters="\x7f"),
    max_size=80,
)


# -- properties --------------------------------------------------------------


@FUZZ
@given(path=PATHS, body=st.binary(max_size=4096), sign=st.booleans())
def test_random_bytes_are_refused_400_or_401(
    client: Client, path: str, body: bytes, sign: bool
) -> None:
    status = client.request("POST", path, body, signed(path, body) if sign else {})
    assert status == (400 if sign else 401)


@FUZZ
@given(case=json_mutated())
def test_json_mutated_valid_bodies_never_fail_the_server(
    client: Client, case: tuple[str, bytes]
) -> None:
    path, body = case
    assert client.request("POST", path, body, signed(path, body)) in {200, 400, 403, 413}


@FUZZ
@given(case=byte_mutated())
def test_byte_mutated_valid_bodies_never_fail_the_server(
    client: Client, case: tuple[str, bytes]
) -> None:
    path, body = case
    assert client.request("POST", path, body, signed(path, body)) in {200, 400, 403}


@FUZZ
@given(
    path=PATHS,
    replaced=st.dictionaries(
        st.sampled_from(
            [
                protocol.HEADER_JOB,
                protocol.HEADER_TIMESTAMP,
                protocol.HEADER_SIGNATURE,
                protocol.HEADER_PROTOCOL,
            ]
        ),
        HEADER_VALUES | st.sampled_from([JOB, OTHER_JOB, str(NOW), str(NOW + 10**6), "1"]),
    ),
    extra=st.dictionaries(HEADER_NAMES, HEADER_VALUES, max_size=5),
)
def test_random_headers_on_a_valid_body_never_fail_the_server(
    client: Client, path: str, replaced: dict[str, str], extra: dict[str, str]
) -> None:
    body = VALID[path]
    headers = {**signed(path, body), **extra, **replaced}
    assert client.request("POST", path, body, headers) in {200, 400, 401}


@settings(FUZZ, max_examples=200)
@given(
    path=PATHS,
    name=HEADER_NAMES | st.sampled_from([protocol.HEADER_JOB, protocol.HEADER_SIGNATURE]),
    size=st.integers(1 << 12, 1 << 17),
    count=st.integers(1, 3),
)
def test_huge_headers_never_fail_the_server(
    client: Client, path: str, name: str, size: int, count: int
) -> None:
    body = VALID[path]
    headers = signed(path, body)
    for index in range(count):
        headers[f"{name}-{index}" if index else name] = "x" * size
    # The HTTP parser refuses a header over 8190 bytes (400) before the API sees it.
    assert client.request("POST", path, body, headers) in {200, 400, 401}


@FUZZ
@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "POST"])
    | st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ", min_size=1, max_size=12),
    path=st.sampled_from([*VALID, "/healthz", f"/v1/jobs/{JOB}", f"/v1/jobs/{OTHER_JOB}"])
    | st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/._-%", max_size=40).map(
        lambda text: "/" + text
    ),
    sign=st.booleans(),
)
def test_random_methods_and_paths_never_fail_the_server(
    client: Client, method: str, path: str, sign: bool
) -> None:
    headers = protocol.signed_headers(SECRET, method, path, JOB, NOW, b"") if sign else {}
    # 404 only for a path the API does not serve.
    assert client.request(method, path, b"", headers) in DOCUMENTED | {404}


@settings(FUZZ, max_examples=100)
@given(path=PATHS, size=st.integers(MAX_BODY_BYTES + 1, 4 * MAX_BODY_BYTES))
def test_oversized_bodies_are_refused_413(client: Client, path: str, size: int) -> None:
    body = b" " * size
    assert client.request("POST", path, body, signed(path, body)) in {413, None}


@settings(FUZZ, max_examples=600)
@given(
    prefix=st.sampled_from(
        [
            b"",
            b"POST /v1/events HTTP/1.1\r\n",
            b"POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n",
            b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
            b"GET /healthz HTTP/1.1\r\n",
        ]
    ),
    garbage=st.binary(max_size=2048),
)
def test_raw_garbage_instead_of_http_never_fails_the_server(
    server: ThreadedServer, prefix: bytes, garbage: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        try:
            raw.sendall(prefix + garbage)
            # End of input: an incomplete request must not leave the server waiting.
            raw.shutdown(socket.SHUT_WR)
            answer = raw.recv(64)
        except ConnectionError:
            return
    if answer.startswith(b"HTTP/1."):
        status = int(answer.split()[1])
        assert status in DOCUMENTED | {404}, answer
