"""The HTTP API, fuzzed through aiohttp's test server: refusals are 4xx JSON and record nothing.

The app is the real one (:func:`build_app`) over a directory that records
every write, and in the last tests over the daemon itself (its SQLite
store). Garbage bodies, mutated messages, mis-signed, replayed, stale and
oversized requests, random headers, methods and paths: every answer is one
the API documents, a refusal is a JSON ``{"error", "reason"}`` without a
traceback or a secret, nothing is ever a 500 (nothing is logged as an
internal error), and a refused request changes no state: no event, no
heartbeat, no driver question, no command handed out.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import os
import pwd
import sqlite3
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.wire import protocol
from agent.wire.protocol import (
    Command,
    CommandKind,
    DriverAnswer,
    DriverRequest,
    Event,
    EventKind,
    HeartbeatReport,
    RankStatus,
)
from supervisor.api import MemoryDirectory, build_app
from tests.json_slots import slots
from tests.unit.api_world import INCARNATION, JOB, NODES, NOW, OTHER_JOB, OTHER_SECRET, SECRET

FUZZ = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
MAX_BODY_BYTES = 16 << 10
DOCUMENTED = {200, 400, 401, 403, 404, 405, 413}
STOP = Command(CommandKind.STOP_RANKS, "c-1", {"grace_s": 5.0})


class RecordingDirectory(MemoryDirectory):
    """A MemoryDirectory that notes every call which changes or hands out state."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def accept_events(self, job_id: str, events: Sequence[Event]) -> Sequence[str]:
        self.writes.append(f"events {job_id}")
        return super().accept_events(job_id, events)

    def accept_heartbeat(self, job_id: str, report: HeartbeatReport) -> None:
        self.writes.append(f"heartbeat {job_id}")
        super().accept_heartbeat(job_id, report)

    def commands_for(self, job_id: str, node: str, incarnation: str) -> Sequence[Command]:
        self.writes.append(f"commands {job_id} {node}")
        return super().commands_for(job_id, node, incarnation)

    async def driver(self, job_id: str, request: DriverRequest) -> DriverAnswer:
        self.writes.append(f"driver {job_id}")
        return await super().driver(job_id, request)

    def state(self) -> tuple[Any, ...]:
        """Everything a request could change, for before/after comparisons."""
        return (
            len(self.writes),
            *(
                (
                    tuple(event.event_id for event in self.events(job)),
                    tuple(sorted(self.heartbeats(job).items())),
                    tuple(self.driver_requests(job)),
                )
                for job in (JOB, OTHER_JOB)
            ),
        )


class ErrorCounter(logging.Handler):
    """ERROR records of the API: an internal error is one, whatever the client was told."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class Api:
    """The real app in aiohttp's TestServer, driven from synchronous tests on its own loop."""

    def __init__(self, app: web.Application) -> None:
        self.loop = asyncio.new_event_loop()
        self.client = TestClient(TestServer(app), loop=self.loop)
        self.loop.run_until_complete(self.client.start_server())
        self.errors = ErrorCounter()
        logging.getLogger("supervisor.api").addHandler(self.errors)

    def send(
        self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
    ) -> Answer:
        async def request() -> Answer:
            async with self.client.request(
                method, path, data=body, headers=headers or {}, skip_auto_headers={"Content-Type"}
            ) as response:
                return Answer(response.status, await response.read())

        return self.loop.run_until_complete(request())

    def stream(self, path: str, body: bytes, headers: dict[str, str]) -> Answer:
        """POST ``body`` chunked, without a Content-Length."""

        async def chunks() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 4096):
                yield body[start : start + 4096]

        async def request() -> Answer:
            async with self.client.post(path, data=chunks(), headers=headers) as response:
                return Answer(response.status, await response.read())

        return self.loop.run_until_complete(request())

    def frames(self, frames: Sequence[bytes]) -> list[bytes | None]:
        """Send each frame on one signed heartbeat stream; each answer (None: stream closed)."""

        async def exchange() -> list[bytes | None]:
            path = protocol.HEARTBEAT_STREAM_PATH
            headers = protocol.signed_headers(SECRET, "GET", path, JOB, NOW, b"")
            answers: list[bytes | None] = []
            async with self.client.ws_connect(path, headers=headers) as stream:
                for frame in frames:
                    await stream.send_bytes(frame)
                    message = await stream.receive(timeout=10)
                    if message.type is not WSMsgType.BINARY:
                        answers.append(None)
                        break
                    answers.append(message.data)
            return answers

        return self.loop.run_until_complete(exchange())

    def close(self) -> None:
        logging.getLogger("supervisor.api").removeHandler(self.errors)
        self.loop.run_until_complete(self.client.close())
        self.loop.close()


def directory_with_jobs() -> RecordingDirectory:
    directory = RecordingDirectory()
    directory.add_job(JOB, SECRET, NODES)
    directory.add_job(OTHER_JOB, OTHER_SECRET, ("node7",))
    return directory


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Api, RecordingDirectory]]:
    directory = directory_with_jobs()
    api = Api(build_app(directory, clock=lambda: NOW, max_body_bytes=MAX_BODY_BYTES))
    try:
        yield api, directory
    finally:
        api.close()
    assert api.errors.records == [], [record.getMessage() for record in api.errors.records]


@pytest.fixture
def api(served: tuple[Api, RecordingDirectory]) -> Api:
    return served[0]


@pytest.fixture
def directory(served: tuple[Api, RecordingDirectory]) -> RecordingDirectory:
    served[1].queue_command(JOB, "node1", STOP)  # a refused request must not hand it out
    return served[1]


# -- valid requests and how they are signed ------------------------------------------------


def events_body(*, job: str = JOB, node: str = "node1", seq: int = 1) -> bytes:
    events = [
        protocol.make_event(
            EventKind.CHECKPOINT_COMMITTED,
            job,
            node,
            INCARNATION,
            seq,
            NOW,
            {"step": 4, "path": "/c"},
        ),
        protocol.make_event(
            EventKind.RANK_EXITED,
            job,
            node,
            INCARNATION,
            seq + 1,
            NOW,
            {
                "global_rank": 1,
                "local_rank": 1,
                "pid": 42,
                "exit_code": None,
                "signal": 9,
                "signal_name": "SIGKILL",
                "last_step": 4,
                "phase": "train",
            },
        ),
    ]
    return protocol.encode_events(events)


def heartbeat_body(*, job: str = JOB, node: str = "node1", time_s: float = NOW) -> bytes:
    rank = RankStatus(0, 0, 42, 4, "train", NOW - 1.0, 0.5, 0.9, 0.6, 4)
    return protocol.encode_heartbeat(HeartbeatReport(job, node, time_s, (rank,), INCARNATION))


def driver_body(*, job: str = JOB) -> bytes:
    request = DriverRequest(job, protocol.DriverPhase.ENDED, attempt=1, exit_code=1)
    return protocol.encode_driver_request(request)


VALID = {
    protocol.EVENTS_PATH: events_body(),
    protocol.HEARTBEAT_PATH: heartbeat_body(),
    protocol.DRIVER_PATH: driver_body(),
}
PATHS = st.sampled_from(sorted(VALID))


def signed(
    path: str,
    body: bytes,
    *,
    job: str = JOB,
    secret: bytes = SECRET,
    timestamp: int = NOW,
    method: str = "POST",
) -> dict[str, str]:
    headers = protocol.signed_headers(secret, method, path, job, timestamp, body)
    headers["Content-Type"] = "application/json"
    return headers


def assert_refusal(answer: Answer) -> dict[str, Any]:
    """A documented 4xx with a JSON error naming its cause and reason, and nothing else."""
    assert answer.status in DOCUMENTED - {200}, answer
    document = answer.json()
    assert set(document) == {"error", "reason"}
    assert isinstance(document["error"], str) and document["error"]
    assert isinstance(document["reason"], str) and document["reason"]
    text = answer.body.decode()
    assert "Traceback" not in text
    assert SECRET.hex() not in text and OTHER_SECRET.hex() not in text
    return document


def assert_nothing_recorded(directory: RecordingDirectory, before: tuple[Any, ...]) -> None:
    assert directory.state() == before, "a refused request changed the directory"


# -- garbage and mutated bodies -----------------------------------------------------------------


@FUZZ
@given(path=PATHS, body=st.binary(max_size=2048), sign=st.booleans())
def test_garbage_bodies_are_refused_400_when_signed_401_when_not_and_record_nothing(
    api: Api, directory: RecordingDirectory, path: str, body: bytes, sign: bool
) -> None:
    before = directory.state()
    answer = api.send("POST", path, body, signed(path, body) if sign else {})
    document = assert_refusal(answer)
    assert answer.status == (400 if sign else 401), document
    assert_nothing_recorded(directory, before)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from([JOB, OTHER_JOB, "node1", "node7", "", INCARNATION, "x" * 5000]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A valid body with one to three JSON edits, aimed at job ids and nodes half the time."""
    path = draw(PATHS)
    document = copy.deepcopy(json.loads(VALID[path]))
    for _ in range(draw(st.integers(1, 3))):
        found = slots(document)
        if not found:
            break
        container, key = draw(st.sampled_from(found))
        operation = draw(st.sampled_from(["replace", "delete", "retarget"]))
        if operation == "retarget":
            for where, name in slots(document):
                if name in ("job_id", "node", "event_id"):
                    where[name] = draw(st.sampled_from([OTHER_JOB, "node7", "node3", JOB]))
        elif operation == "replace":
            container[key] = draw(JSON)
        else:
            del container[key]
    return path, json.dumps(document).encode()


@FUZZ
@given(case=mutated())
def test_mutated_messages_validly_signed_are_taken_or_refused_recording_nothing(
    api: Api, directory: RecordingDirectory, case: tuple[str, bytes]
) -> None:
    path, body = case
    before = directory.state()
    answer = api.send("POST", path, body, signed(path, body))
    if answer.status == 200:
        return
    document = assert_refusal(answer)
    assert answer.status in (400, 403, 413), document
    assert_nothing_recorded(directory, before)


@FUZZ
@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=2048),
            mutated().map(lambda case: protocol.sign_frame(SECRET, JOB, NOW, case[1])),
            st.binary(max_size=512).map(lambda body: protocol.sign_frame(SECRET, JOB, NOW, body)),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_any_frame_on_the_heartbeat_stream_is_taken_or_refused_and_the_stream_goes_on(
    api: Api, directory: RecordingDirectory, frames: list[bytes]
) -> None:
    """Garbage, unsigned and mutated frames: each answered, a refusal records nothing."""
    answers = api.frames([*frames, protocol.sign_frame(SECRET, JOB, NOW, heartbeat_body())])
    assert len(answers) == len(frames) + 1 and None not in answers  # never closed on us
    for answer in answers:
        assert answer is not None
        decoded = protocol.decode_stream_answer(answer)
        if isinstance(decoded, protocol.Refusal):
            assert decoded.status in DOCUMENTED - {200, 404, 405}, decoded
            assert "Traceback" not in decoded.reason and SECRET.hex() not in decoded.reason
    # The refusals alone changed nothing: replaying only them leaves the directory as it is.
    refused = [
        frame
        for frame, answer in zip(frames, answers, strict=False)
        if answer is not None
        and isinstance(protocol.decode_stream_answer(answer), protocol.Refusal)
    ]
    if refused:
        before = directory.state()
        api.frames(refused)
        assert_nothing_recorded(directory, before)


@pytest.mark.parametrize(
    ("path", "body", "cause"),
    [
        (protocol.EVENTS_PATH, events_body(job=OTHER_JOB, node="node7"), "cross_job"),
        (protocol.EVENTS_PATH, events_body(node="node7"), "foreign_node"),
        (protocol.HEARTBEAT_PATH, heartbeat_body(job=OTHER_JOB, node="node7"), "cross_job"),
        (protocol.HEARTBEAT_PATH, heartbeat_body(node="node3"), "foreign_node"),
        (protocol.DRIVER_PATH, driver_body(job=OTHER_JOB), "cross_job"),
    ],
)
def test_a_job_reporting_about_another_job_or_a_node_outside_its_allocation_is_refused_403(
    api: Api, directory: RecordingDirectory, path: str, body: bytes, cause: str
) -> None:
    # Signed with JOB's own secret: a job's ranks hold it, so they could send exactly this.
    before = directory.state()
    document = assert_refusal(api.send("POST", path, body, signed(path, body)))
    assert document["error"] == cause
    assert_nothing_recorded(directory, before)


# -- signatures and the replay window -------------------------------------------------------------

ALTERATIONS = [
    "other job's secret",
    "zero secret",
    "signature digit flipped",
    "signature upper case",
    "signature of another path",
    "signature of another method",
    "body changed after signing",
    "body extended after signing",
    "job header names the other job",
    "timestamp header off by one",
    "timestamp header not digits",
    "no signature",
    "no job header",
    "no timestamp",
]


def altered(path: str, body: bytes, alteration: str) -> tuple[bytes, dict[str, str]]:
    """A request made wrong in one way that only the signature check can see (or a header)."""
    headers = signed(path, body)
    if alteration == "other job's secret":
        headers = signed(path, body, secret=OTHER_SECRET)
    elif alteration == "zero secret":
        headers = signed(path, body, secret=bytes(32))
    elif alteration == "signature digit flipped":
        signature = headers[protocol.HEADER_SIGNATURE]
        headers[protocol.HEADER_SIGNATURE] = ("1" if signature[0] == "0" else "0") + signature[1:]
    elif alteration == "signature upper case":
        headers[protocol.HEADER_SIGNATURE] = headers[protocol.HEADER_SIGNATURE].upper()
    elif alteration == "signature of another path":
        other = protocol.HEARTBEAT_PATH if path != protocol.HEARTBEAT_PATH else protocol.EVENTS_PATH
        headers[protocol.HEADER_SIGNATURE] = signed(other, body)[protocol.HEADER_SIGNATURE]
    elif alteration == "signature of another method":
        headers[protocol.HEADER_SIGNATURE] = signed(path, body, method="PUT")[
            protocol.HEADER_SIGNATURE
        ]
    elif alteration == "body changed after signing":
        body = body.replace(b":", b": ", 1)  # the same message, other bytes
    elif alteration == "body extended after signing":
        body = body + b" "
    elif alteration == "job header names the other job":
        headers[protocol.HEADER_JOB] = OTHER_JOB
    elif alteration == "timestamp header off by one":
        headers[protocol.HEADER_TIMESTAMP] = str(NOW + 1)
    elif alteration == "timestamp header not digits":
        headers[protocol.HEADER_TIMESTAMP] = "\uff11760000000"
    elif alteration == "no signature":
        del headers[protocol.HEADER_SIGNATURE]
    elif alteration == "no job header":
        del headers[protocol.HEADER_JOB]
    else:
        del headers[protocol.HEADER_TIMESTAMP]
    return body, headers


@FUZZ
@given(path=PATHS, alteration=st.sampled_from(ALTERATIONS))
def test_a_mis_signed_request_is_refused_401_and_records_nothing(
    api: Api, directory: RecordingDirectory, path: str, alteration: str
) -> None:
    body, headers = altered(path, VALID[path], alteration)
    before = directory.state()
    document = assert_refusal(api.send("POST", path, body, headers))
    assert api.send("POST", path, body, headers).status == 401, (alteration, document)
    assert document["error"] in {"bad_signature", "missing_auth", "malformed_auth"}
    assert_nothing_recorded(directory, before)


@FUZZ
@given(path=PATHS, skew=st.integers(-(10**9), 10**9) | st.integers(-400, 400))
def test_a_request_outside_the_replay_window_is_refused_and_a_replay_inside_changes_nothing(
    api: Api, directory: RecordingDirectory, path: str, skew: int
) -> None:
    timestamp = max(0, NOW + skew)
    seq = 1 + abs(skew) % 10**6 * 2  # fresh event ids, so the first send records something new
    body = {
        protocol.EVENTS_PATH: events_body(seq=seq),
        protocol.HEARTBEAT_PATH: heartbeat_body(time_s=float(timestamp)),
        protocol.DRIVER_PATH: driver_body(),
    }[path]
    headers = signed(path, body, timestamp=timestamp)
    before = directory.state()
    first = api.send("POST", path, body, headers)
    if abs(timestamp - NOW) > protocol.REPLAY_WINDOW_S:
        assert assert_refusal(first)["error"] == "stale_timestamp"
        assert_nothing_recorded(directory, before)
        return
    assert first.status == 200, first
    if path == protocol.DRIVER_PATH:
        return  # the driver's question is answered each time it is asked (intake decides)
    after_first = directory.state()[1:]
    replay = api.send("POST", path, body, headers)
    assert replay.status == 200
    assert directory.state()[1:] == after_first, "a replay changed what was recorded"


# -- size ---------------------------------------------------------------------------------------


@settings(FUZZ, max_examples=40)
@given(
    path=PATHS,
    size=st.integers(MAX_BODY_BYTES + 1, 4 * MAX_BODY_BYTES),
    chunked=st.booleans(),
    sign=st.booleans(),
)
def test_an_oversized_body_is_refused_413_or_401_unread_and_records_nothing(
    api: Api, directory: RecordingDirectory, path: str, size: int, chunked: bool, sign: bool
) -> None:
    body = b" " * size
    headers = signed(path, body) if sign else {"Content-Type": "application/json"}
    before = directory.state()
    answer = api.stream(path, body, headers) if chunked else api.send("POST", path, body, headers)
    document = assert_refusal(answer)
    # Authentication comes first: an unsigned client cannot make the server read the body.
    assert answer.status == (413 if sign else 401), document
    assert_nothing_recorded(directory, before)


# -- headers, methods, paths ------------------------------------------------------------------

HEADER_VALUES = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=80
) | st.sampled_from([JOB, OTHER_JOB, str(NOW), str(NOW + 10**6), "1", "9" * 500, "-1", "../4711"])


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
        HEADER_VALUES,
        min_size=1,
    ),
)
def test_any_signing_header_value_is_answered_without_an_internal_error(
    api: Api, directory: RecordingDirectory, path: str, replaced: dict[str, str]
) -> None:
    headers = {**signed(path, VALID[path]), **replaced}
    before = directory.state()
    answer = api.send("POST", path, VALID[path], headers)
    if answer.status == 200:
        return
    assert_refusal(answer)
    assert_nothing_recorded(directory, before)


@FUZZ
@given(
    method=st.sampled_from(["GET", "PUT", "DELETE", "PATCH", "POST", "HEAD", "OPTIONS"]),
    path=st.sampled_from([*VALID, "/healthz", f"/v1/jobs/{JOB}", f"/v1/jobs/{OTHER_JOB}"])
    | st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789/._-%", max_size=30).map(
        lambda text: "/" + text.lstrip("/")  # "//x" would name another host
    ),
    sign=st.booleans(),
)
def test_any_method_and_path_is_answered_with_a_documented_status(
    api: Api, directory: RecordingDirectory, method: str, path: str, sign: bool
) -> None:
    headers = signed(path, b"", method=method) if sign else {}
    before = directory.state()
    answer = api.send(method, path, b"", headers)
    assert answer.status in DOCUMENTED, answer
    if answer.status != 200 and method != "HEAD":
        assert_refusal(answer)
    if answer.status != 200:
        assert_nothing_recorded(directory, before)


# -- the daemon's own directory: a refused request leaves the store as it was --------------------


def store_digest(path: Path) -> str:
    """Every row of every table, read on a separate connection."""
    db = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return hashlib.sha256("\n".join(db.iterdump()).encode()).hexdigest()
    finally:
        db.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Api, Any, bytes]]:
    from supervisor.config import SupervisorConfig
    from supervisor.core.policy import Policy
    from supervisor.daemon import Supervisor
    from supervisor.jobs import JobSpec, read_secret, write_job_dir
    from tests.fakes.slurm import JOB as DAEMON_JOB
    from tests.fakes.slurm import FakeSlurm

    class Slurm(FakeSlurm):
        async def jobs(self) -> dict[int, Any]:
            found = await self.job(int(DAEMON_JOB))
            user = pwd.getpwuid(os.getuid()).pw_name
            return {} if found is None else {found.job_id: replace(found, user_name=user)}

    state = tmp_path_factory.mktemp("daemon")
    config = SupervisorConfig(state_dir=str(state / "state"))
    supervisor = Supervisor(config, Policy(), slurm=Slurm(), clock=lambda: float(NOW))  # type: ignore[arg-type]
    spec = JobSpec(name="toy", nodes=4, command=("true",), ckpt_root="/nonexistent", min_nodes=2)
    directory = write_job_dir(config.jobs_path, DAEMON_JOB, spec)
    asyncio.run(supervisor.polling.poll())
    assert supervisor.intake.allocation(DAEMON_JOB)
    api = Api(build_app(supervisor.intake, clock=lambda: NOW, max_body_bytes=MAX_BODY_BYTES))
    try:
        yield api, supervisor, read_secret(directory)
    finally:
        api.close()
        supervisor.store.close()


@settings(FUZZ, max_examples=60)
@given(path=PATHS, data=st.data())
def test_a_refused_request_leaves_the_daemons_store_and_leases_as_they_were(
    daemon: tuple[Api, Any, bytes], path: str, data: st.DataObject
) -> None:
    api, supervisor, secret = daemon
    ways = ["mis-signed", "stale", "other job", "garbage", "mutated", "oversized"]
    way = data.draw(st.sampled_from(ways + ([] if path == protocol.DRIVER_PATH else ["foreign"])))
    job = "4242"
    node = sorted(supervisor.intake.allocation(job))[0]
    body = {
        protocol.EVENTS_PATH: events_body(job=job, node=node),
        protocol.HEARTBEAT_PATH: heartbeat_body(job=job, node=node),
        protocol.DRIVER_PATH: driver_body(job=job),
    }[path]
    timestamp = NOW
    if way == "other job":
        body = body.replace(job.encode(), b"4243")
    elif way == "foreign":
        body = body.replace(node.encode(), b"node9")
    elif way == "garbage":
        body = data.draw(st.binary(max_size=256))
    elif way == "mutated":
        document = json.loads(body)
        container, key = data.draw(st.sampled_from(slots(document)))
        container[key] = data.draw(JSON.filter(lambda value: value != container[key]))
        body = json.dumps(document).encode()
    elif way == "stale":
        timestamp = NOW + data.draw(st.sampled_from([-1, 1])) * data.draw(st.integers(301, 10**8))
    elif way == "oversized":
        body = body + b" " * MAX_BODY_BYTES
    headers = protocol.signed_headers(
        secret if way != "mis-signed" else OTHER_SECRET, "POST", path, job, timestamp, body
    )
    before = (store_digest(supervisor.store.path), supervisor.store.leases_for(job))
    answer = api.send("POST", path, body, headers)
    if answer.status == 200:
        assert way == "mutated"  # an edit the protocol accepts (an unknown field, a new value)
        return
    assert_refusal(answer)
    assert (store_digest(supervisor.store.path), supervisor.store.leases_for(job)) == before
